"""Peak memory probes: a reset forgets earlier peaks."""

import pytest
import torch

from streamchat.bench.memory import LinuxPeakRss, memory_probe


def test_the_cpu_probe_sees_a_peak_that_has_gone_again():
    probe = memory_probe(torch.device("cpu"))
    if not isinstance(probe, LinuxPeakRss):
        pytest.skip("the peak RSS cannot be reset on this system")
    probe.reset()
    before = probe.peak()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del block
    assert probe.peak() - before >= 60 * 2**20
    probe.reset()
    assert probe.peak() - before < 32 * 2**20
