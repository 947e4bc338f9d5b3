"""streamchat's attention: transformers' sdpa results, and a compiled decode step that reads each KV head once."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch._dynamo
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from streamchat.cache import SinkCache, forward
from streamchat.cache.masks import BOOLEAN_MASK_ATTENTION
from streamchat.engine.compiled_decode import decode_logits
from streamchat.loading.loader import attention_implementation
from streamchat.placement.attention import (
    ATTENTION_NAME,
    decode_attention,
    decode_mask,
    register_attention,
    streamchat_attention_forward,
)
from tests.support.models import VOCAB, tiny_config

BATCH, HEADS, KV_HEADS, SLOTS, HEAD_DIM = 2, 9, 3, 37, 16


class _Layer(torch.nn.Module):
    """What the attention functions read from a model's attention layer."""

    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def _tensors(queries: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(queries)
    query = torch.randn(BATCH, HEADS, queries, HEAD_DIM, generator=generator).to(dtype)
    keys = torch.randn(BATCH, KV_HEADS, SLOTS, HEAD_DIM, generator=generator).to(dtype)
    values = torch.randn(BATCH, KV_HEADS, SLOTS, HEAD_DIM, generator=generator).to(dtype)
    return query, keys, values


def _row_masks(queries: int) -> torch.Tensor:
    """[2, 1, queries, SLOTS]: each row of the batch holds different slots; each query sees up to its own."""
    held = torch.zeros(BATCH, SLOTS, dtype=torch.bool)
    held[0, :30] = True
    held[1, 5:SLOTS:2] = True
    held[1, :4] = True
    mask = held[:, None, None, :].expand(BATCH, 1, queries, SLOTS).clone()
    causal = torch.ones(queries, queries, dtype=torch.bool).tril()
    mask[:, 0, :, SLOTS - queries :] &= causal
    return mask


def _reference(query, keys, values, mask, scale) -> torch.Tensor:
    """Attention in float64 with every head's keys repeated: [B, q, H, D]."""
    groups = HEADS // KV_HEADS
    keys = keys.double().repeat_interleave(groups, dim=1)
    values = values.double().repeat_interleave(groups, dim=1)
    scores = (query.double() @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).transpose(1, 2)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_decode_query_gives_the_reference_result_for_each_row_of_a_batch(dtype, tolerance):
    query, keys, values = _tensors(1, dtype)
    mask = _row_masks(1)
    scale = 0.3
    ours = decode_attention(query, keys, values, mask, scale)
    assert ours.shape == (BATCH, 1, HEADS, HEAD_DIM) and ours.dtype == dtype
    reference = _reference(query, keys, values, mask, scale)
    assert (ours.double() - reference).abs().max().item() < tolerance
    # Each row attends only to its own slots: the second row alone gives the same second row.
    alone = decode_attention(query[1:], keys[1:], values[1:], mask[1:], scale)
    torch.testing.assert_close(alone[0], ours[1])
    # A caller may convert the mask once for many layers: the same result.
    assert torch.equal(decode_attention(query, keys, values, decode_mask(mask), scale), ours)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_a_decode_query_on_cpu_agrees_with_transformers_sdpa(dtype, tolerance):
    # On CPU decode attention is two products and a softmax (fewer, larger kernels); SDPA the same math.
    query, keys, values = _tensors(1, dtype)
    mask = _row_masks(1)
    ours = decode_attention(query, keys, values, mask, 0.3)
    theirs, _ = sdpa_attention_forward(_Layer(), query, keys, values, mask, scaling=0.3)
    assert (ours.double() - theirs.double()).abs().max().item() < tolerance


def test_on_cpu_a_boolean_mask_becomes_the_least_float_where_a_slot_is_hidden():
    mask = torch.tensor([True, False, True])
    assert decode_mask(mask).tolist() == [0.0, torch.finfo(torch.float32).min, 0.0]
    assert decode_mask(decode_mask(mask)).tolist() == decode_mask(mask).tolist()
    assert decode_mask(None) is None
    # A float mask in the model's dtype is widened: the masked scores and the softmax stay float32.
    assert decode_mask(torch.tensor([0.0, -1e4], dtype=torch.bfloat16)).dtype == torch.float32


def test_a_decode_query_with_no_mask_attends_to_every_slot():
    query, keys, values = _tensors(1, torch.float32)
    ours = decode_attention(query, keys, values, None)
    everything = torch.ones(BATCH, 1, 1, SLOTS, dtype=torch.bool)
    reference = _reference(query, keys, values, everything, HEAD_DIM**-0.5)
    assert (ours.double() - reference).abs().max().item() < 1e-5


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("queries", [1, 5])
def test_the_attention_function_is_decode_attention_for_one_query_and_transformers_sdpa_for_chunks(
    dtype, tolerance, queries
):
    query, keys, values = _tensors(queries, dtype)
    mask = _row_masks(queries)
    ours, _ = streamchat_attention_forward(_Layer(), query, keys, values, mask, dropout=0.0, scaling=0.25)
    if queries == 1:
        theirs = decode_attention(query, keys, values, mask, 0.25)
    else:
        theirs, _ = sdpa_attention_forward(_Layer(), query, keys, values, mask, dropout=0.0, scaling=0.25)
    assert ours.shape == (BATCH, queries, HEADS, HEAD_DIM)
    assert torch.equal(ours, theirs)
    assert (ours.double() - _reference(query, keys, values, mask, 0.25)).abs().max().item() < tolerance


def test_softcapping_is_refused_as_transformers_sdpa_refuses_it():
    query, keys, values = _tensors(1, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        streamchat_attention_forward(_Layer(), query, keys, values, None, softcap=30.0)


def test_models_with_sdpa_load_with_it_and_the_cache_hands_it_boolean_masks():
    assert attention_implementation(tiny_config("llama")) == ATTENTION_NAME == register_attention()
    assert attention_implementation(tiny_config("gemma2")) == "eager"  # softcapping: no sdpa version
    assert ATTENTION_NAME in BOOLEAN_MASK_ATTENTION


def _compiled_decode_graphs(attention: str, device: str = "cpu") -> tuple[list[torch.fx.GraphModule], Any, SinkCache]:
    """The FX graphs torch.compile makes of one sink-cache decode step of a tiny llama (9 heads, 3 KV heads)."""
    config = tiny_config("llama", num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, hidden_size=HEADS * 8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval().to(device)
    cache = SinkCache.for_model(model, 4, 28)
    cache.static_extent = True  # as the compiled decoder runs it: over every slot
    forward(model, cache, torch.randint(3, VOCAB, (1, 12), device=device))
    graphs: list[torch.fx.GraphModule] = []

    def record(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    step = torch.compile(decode_logits, backend=record, fullgraph=True, dynamic=False)
    token = torch.tensor([[7]], device=device)
    with cache.decode_pass():
        step(model, cache, token)
    return graphs, config, cache


def _attention_reads(graphs: list[torch.fx.GraphModule], head_dim: int) -> tuple[list[torch.Size], list[torch.Size]]:
    """The query and key shapes [B, heads, S, D] of every attention in the graphs: SDPA calls, or score products."""
    sdpa = {torch.nn.functional.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
    queries, keys = [], []
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function":
                continue
            shapes = [arg.meta["example_value"].shape for arg in node.args[:2] if isinstance(arg, torch.fx.Node)]
            if node.target in sdpa:
                queries.append(shapes[0])
                keys.append(shapes[1])
            elif node.target in (torch.matmul, operator.matmul) and shapes[0][-1] == shapes[1][-2] == head_dim:
                # The scores: query [B, KV, G, D] @ keys transposed [B, KV, D, S] (the values' product has S there).
                queries.append(shapes[0])
                keys.append(torch.Size([*shapes[1][:-2], shapes[1][-1], shapes[1][-2]]))
    return queries, keys


def test_the_compiled_decode_step_reads_each_kv_head_once():
    graphs, config, cache = _compiled_decode_graphs(register_attention())
    queries, keys = _attention_reads(graphs, config.head_dim)
    assert len(keys) == config.num_hidden_layers
    capacity = cache.ledger.slots
    assert set(keys) == {torch.Size([1, KV_HEADS, capacity, config.head_dim])}
    # The group's query heads ride as rows of one query per KV head.
    assert set(queries) == {torch.Size([1, KV_HEADS, HEADS // KV_HEADS, config.head_dim])}
    expanded = [
        node
        for graph in graphs
        for node in graph.graph.nodes
        if isinstance(node.meta.get("example_value"), torch.Tensor)
        and node.meta["example_value"].shape[-2:] == (capacity, config.head_dim)
        and node.meta["example_value"].numel() > KV_HEADS * capacity * config.head_dim
    ]
    assert expanded == []  # nothing the size of H heads of keys: no repeat_kv, no expand


def test_transformers_sdpa_compiled_reads_keys_repeated_per_query_head():
    """What the step above avoids, seen by the same inspection: it can tell the two apart."""
    graphs, config, cache = _compiled_decode_graphs("sdpa")
    _, keys = _attention_reads(graphs, config.head_dim)
    assert set(keys) == {torch.Size([1, HEADS, cache.ledger.slots, config.head_dim])}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_decode_query_gives_the_reference_result_for_each_row(dtype):
    query, keys, values = (tensor.cuda() for tensor in _tensors(1, dtype))
    mask = _row_masks(1).cuda()
    ours = decode_attention(query, keys, values, mask, 0.3)
    reference = _reference(query.cpu(), keys.cpu(), values.cpu(), mask.cpu(), 0.3)
    assert (ours.double().cpu() - reference).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)
    compiled = torch.compile(decode_attention, fullgraph=True, dynamic=False)(query, keys, values, mask, 0.3)
    assert (compiled.double().cpu() - reference).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
def test_on_cuda_the_compiled_decode_step_reads_each_kv_head_once():
    graphs, config, cache = _compiled_decode_graphs(register_attention(), device="cuda")
    _, keys = _attention_reads(graphs, config.head_dim)
    assert set(keys) == {torch.Size([1, KV_HEADS, cache.ledger.slots, config.head_dim])}
