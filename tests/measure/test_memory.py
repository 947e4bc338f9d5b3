"""Peak memory probes: a reset forgets earlier peaks. Running out of memory is a one-line error."""

import subprocess
import sys

import pytest
import torch

from streamchat.errors import OutOfMemoryError
from streamchat.measure.memory import out_of_memory_errors

# Run in a fresh process: a test worker's heap, after hundreds of tests, can hand a block back from memory it
# already holds (its resident size then does not grow, and no peak shows), which this test does not control.
PEAK_SCRIPT = """
import torch
from streamchat.measure.memory import LinuxPeakRss, memory_probe
probe = memory_probe(torch.device("cpu"))
if not isinstance(probe, LinuxPeakRss):
    raise SystemExit(3)
probe.reset()
before = probe.peak()
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
del block
seen = probe.peak() - before
probe.reset()
print(seen, probe.peak() - before)
"""


def test_the_cpu_probe_sees_a_peak_that_has_gone_again():
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=False)
    if result.returncode == 3:
        pytest.skip("the peak RSS cannot be reset on this system")
    assert result.returncode == 0, result.stderr
    seen, after_reset = map(int, result.stdout.split())
    assert seen >= 60 * 2**20
    assert after_reset < 32 * 2**20


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
