import os
import subprocess
import sys

import pytest
import torch

from streamchat.placement.int4_linear import (
    GROUP_SIZE,
    INT4_KERNEL_MAX_ROWS,
    Int4Linear,
    PackedLayout,
    fits_int4_kernel,
    packed_layout,
    quantize_groups,
)


def linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)


def test_this_torch_packs_int4_weights_as_the_layer_reads_them():
    assert packed_layout() == {"AVX512": PackedLayout(64, paired=False), "AVX2": PackedLayout(32, paired=False)}.get(
        torch.backends.cpu.get_cpu_capability(), PackedLayout(32, paired=True)
    )
    original = linear(96, 128, torch.bfloat16)
    assert torch.equal(Int4Linear(original).levels().int(), quantize_groups(original.weight)[0])


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_the_layouts_of_other_cpus_are_read_too(capability: str):
    # aten packs by the CPU's capability; a process told to use a lesser one packs as such a CPU does.
    code = (
        "import torch\n"
        "from streamchat.placement.int4_linear import Int4Linear, packed_layout, quantize_groups\n"
        "torch.manual_seed(0)\n"
        "original = torch.nn.Linear(64, 128)\n"
        "same = torch.equal(Int4Linear(original).levels().int(), quantize_groups(original.weight)[0])\n"
        "print(torch.backends.cpu.get_cpu_capability(), tuple(packed_layout()), same)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()},
    )
    expected = {"AVX2": "(32, False)", "DEFAULT": "(32, True)"}[capability]
    assert run.stdout == f"{capability} {expected} True\n"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "seq", [1, 17, 65], ids=["decode (int4 kernel)", "prompt chunk (int4 kernel)", "long chunk (widened weights)"]
)
def test_it_computes_with_the_grouped_weights(dtype: torch.dtype, bias: bool, seq: int):
    original = linear(96, 64, dtype, bias)
    layer = Int4Linear(original)
    hidden = torch.randn(2, seq, 96, dtype=dtype)  # [batch, seq, in]; 130 rows go past INT4_KERNEL_MAX_ROWS
    assert (2 * seq > INT4_KERNEL_MAX_ROWS) == (seq == 65)
    # What the layer stands for: each group's levels times its step, plus its minimum, in float32.
    expected = hidden.float() @ layer.widened(torch.float32).T + (original.bias.float() if bias else 0)
    got = layer(hidden)
    assert got.shape == (2, seq, 64) and got.dtype == dtype
    assert torch.allclose(got.float(), expected, atol=2e-2 * expected.abs().max().item())


def test_each_group_spans_its_own_range_in_sixteen_levels():
    original = linear(64, 64, torch.float32)
    q, step, minimum = quantize_groups(original.weight)
    groups = original.weight.reshape(64, 2, GROUP_SIZE)  # [out, groups, 32]
    assert torch.equal(minimum, groups.amin(dim=-1))
    assert q.amin().item() == 0 and q.amax().item() == 15
    rebuilt = Int4Linear(original).widened(torch.float32)
    assert ((rebuilt - original.weight).abs() <= step.repeat_interleave(GROUP_SIZE, dim=1) / 2 + 1e-6).all()


def test_weights_already_on_a_q4_1_grid_come_back_exactly():
    # A Q4_1 block: w = q * d + m with q spanning 0..15 (what the default model's GGUF holds).
    levels = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0))
    levels[:, [0, 1, GROUP_SIZE, GROUP_SIZE + 1]] = torch.tensor([0, 15, 0, 15])  # each group spans 0..15, as Q4_1's
    # Each group's own step and minimum, powers of two so that (maximum - minimum) / 15 is the step exactly.
    d = 2.0 ** -torch.randint(3, 8, (64, 2), generator=torch.Generator().manual_seed(1))
    m = -8 * d
    weight = levels * d.repeat_interleave(GROUP_SIZE, dim=1) + m.repeat_interleave(GROUP_SIZE, dim=1)
    original = torch.nn.Linear(64, 64, bias=False)
    original.weight = torch.nn.Parameter(weight)
    assert torch.equal(Int4Linear(original).widened(torch.float32), weight)


@pytest.mark.parametrize(
    ("shape", "fits"), [((32, 64), True), ((576, 1536), True), ((56, 64), False), ((64, 48), False)]
)
def test_only_shapes_the_kernel_takes_are_taken(shape: tuple[int, int], fits: bool):
    assert fits_int4_kernel(torch.nn.Linear(*shape)) is fits


def test_outputs_in_a_partial_block_stay_as_they_are():
    # 96 outputs are three blocks of 32 but one and a half of 64: aten packs a partial block differently.
    assert fits_int4_kernel(torch.nn.Linear(32, 96)) is (packed_layout().block == 32)
