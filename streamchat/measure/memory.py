"""Peak memory of a stretch of work: CUDA's allocator peak on a GPU, the process's peak RSS on a CPU.

A probe is reset before the work and read after it, so each decode step is measured
on its own even when policies take turns in one process. Running out of memory, on
any device, becomes a one-line domain error.
"""

from __future__ import annotations

import re
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from streamchat.errors import out_of_memory_as

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
# Writing "5" to clear_refs resets the process's peak RSS (VmHWM) to its current RSS (Linux 4.0+).
_RESET_PEAK_RSS = "5"


class MemoryProbe(Protocol):
    kind: str  # what the numbers are, for table headers

    def reset(self) -> None: ...

    def peak(self) -> int:
        """Bytes at the peak since the last reset."""
        ...


class CudaPeak:
    kind = "CUDA max allocated"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


class LinuxPeakRss:
    kind = "peak RSS"

    def reset(self) -> None:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)

    def peak(self) -> int:
        match = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
        return int(match.group(1)) * 1024 if match else 0


class LifetimePeakRss:
    """Where the peak cannot be reset (macOS, Windows, locked-down Linux): the peak since the process began."""

    kind = "peak RSS since start"

    def reset(self) -> None:
        pass

    def peak(self) -> int:
        import resource  # Unix only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports kilobytes, macOS bytes.
        return peak if sys.platform == "darwin" else peak * 1024


def memory_probe(device: torch.device) -> MemoryProbe:
    if device.type == "cuda":
        return CudaPeak(device)
    try:
        LinuxPeakRss().reset()
    except OSError:
        return LifetimePeakRss()
    return LinuxPeakRss()


def out_of_memory_errors(smaller: str) -> AbstractContextManager[None]:
    """Turn an allocation failure inside the block (CUDA, MPS or CPU) into an OutOfMemoryError.

    `smaller`: the command's options that shrink the run, e.g. "--tokens or --window".
    """
    return out_of_memory_as(
        f"the benchmark ran out of memory: try a smaller {smaller}, --dtype bfloat16 or float16, or a smaller model"
    )
