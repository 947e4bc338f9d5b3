"""Peak memory probes: a reset forgets earlier peaks. Running out of memory is a one-line error."""

import pytest
import torch

from streamchat.errors import OutOfMemoryError
from streamchat.measure.memory import LinuxPeakRss, memory_probe, out_of_memory_errors


def test_the_cpu_probe_sees_a_peak_that_has_gone_again():
    probe = memory_probe(torch.device("cpu"))
    if not isinstance(probe, LinuxPeakRss):
        pytest.skip("the peak RSS cannot be reset on this system")
    probe.reset()
    before = probe.peak()
    # 256 MiB, touched, to see 60: a machine that reclaims cold pages (DAMON) can take a worker's resident memory
    # below the peak the reset set, and a smaller block would then not reach it.
    block = torch.ones(256 * 2**20 // 4)
    del block
    assert probe.peak() - before >= 60 * 2**20
    probe.reset()
    assert probe.peak() - before < 32 * 2**20


@pytest.mark.parametrize(
    "failure",
    [
        MemoryError(),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 8 GB"),
        RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)"),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)
def test_running_out_of_memory_on_any_device_is_a_domain_error(failure):
    with pytest.raises(OutOfMemoryError) as raised, out_of_memory_errors("--tokens or --window"):
        raise failure
    assert str(raised.value) == (
        "the benchmark ran out of memory: try a smaller --tokens or --window, --dtype bfloat16 or float16, "
        "or a smaller model"
    )


def test_other_runtime_errors_pass_through():
    with pytest.raises(RuntimeError, match="shape mismatch"), out_of_memory_errors("--window"):
        raise RuntimeError("shape mismatch")
