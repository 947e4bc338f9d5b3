"""The speed benchmark on a tiny model: what gets measured at each checkpoint, and what it shows; with --tp 2,
one process's decode ms/token and two's."""

import itertools
import os
import re
import subprocess
import sys

import pytest

from streamchat import defaults
from streamchat.bench import speed
from streamchat.bench.options import sizes_for
from streamchat.errors import ConfigError
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.waiting import HANG_GUARD_SECONDS

SETTINGS = GenerationSettings()


def test_sizes_and_checkpoints_are_validated_with_the_option_named():
    assert sizes_for(False, speed.FULL, speed.QUICK) == speed.FULL
    assert (speed.FULL.sinks, speed.FULL.window, speed.FULL.steps) == (defaults.SINKS, defaults.WINDOW, 9)
    assert speed.parse_checkpoints("100,200") == (100, 200) and speed.parse_checkpoints(None) is None
    assert sizes_for(True, speed.FULL, speed.QUICK, checkpoints=(10, 20), steps=None).checkpoints == (10, 20)
    with pytest.raises(ConfigError, match="--checkpoints 'a,b': give whole numbers"):
        speed.parse_checkpoints("a,b")
    for checkpoints in ((200, 100), (100, 100), (0, 10)):
        with pytest.raises(ConfigError, match="give increasing token counts"):
            sizes_for(True, speed.FULL, speed.QUICK, checkpoints=checkpoints)
    with pytest.raises(ConfigError, match="--steps 0: must be at least 1"):
        sizes_for(True, speed.FULL, speed.QUICK, steps=0)
    with pytest.raises(ConfigError, match=r"^--keep 4 --window 0: need keep >= 0 and window >= 1$"):
        sizes_for(True, speed.FULL, speed.QUICK, window=0)


def test_a_run_measures_every_policy_at_every_checkpoint():
    sizes = speed.SpeedSizes(sinks=4, window=28, checkpoints=(16, 64, 96), steps=2)
    seen = []
    measurements, memory_kind = speed.run_speed(tiny_model(), sizes, SETTINGS, seen.append)
    assert seen == measurements
    assert [(m.streamed, m.fill) for m in measurements] == [(16, 16), (64, 32), (96, 32)]
    for measurement in measurements:
        assert list(measurement.latency) == list(measurement.peak_memory) == ["streaming", "dense", "recompute"]
        assert all(seconds > 0 for seconds in measurement.latency.values())
        # A probe that found no figure reports 0.
        assert all(isinstance(peak, int) and peak > 0 for peak in measurement.peak_memory.values())
    assert memory_kind in ("peak RSS", "peak RSS since start")
    if memory_kind == "peak RSS since start":
        # Never reset: each policy's peak can only have grown since the checkpoint before.
        for before, after in itertools.pairwise(measurements):
            assert all(after.peak_memory[p] >= before.peak_memory[p] for p in speed.POLICIES)
    rows = speed.rows(measurements)
    assert len(rows) == len(sizes.checkpoints)
    assert [column.key for column in speed.columns()] == list(rows[0])
    for row, measurement in zip(rows, measurements, strict=True):
        latency = measurement.latency
        assert row["streaming_vs_dense"] == latency["streaming"] / latency["dense"]
        assert row["recompute_vs_streaming"] == latency["recompute"] / latency["streaming"]
        assert [row[f"{policy}_mib"] * 2**20 for policy in speed.POLICIES] == [
            measurement.peak_memory[policy] for policy in speed.POLICIES
        ]


def test_a_run_samples_as_the_chat_would_when_given_no_settings():
    sizes = speed.SpeedSizes(sinks=2, window=6, checkpoints=(4, 12), steps=1)
    measurements, _ = speed.run_speed(tiny_model(), sizes)
    assert [(m.streamed, m.fill) for m in measurements] == [(4, 4), (12, 8)]


def test_rows_are_milliseconds_ratios_and_mib_per_checkpoint():
    measured = speed.Measurement(
        streamed=2000,
        fill=64,
        latency={"streaming": 0.002, "dense": 0.004, "recompute": 0.050},
        peak_memory={"streaming": 3 * 2**20, "dense": 5 * 2**19, "recompute": 2**30},
    )
    [row] = speed.rows([measured])
    assert row == {
        "streamed": 2000,
        "fill": 64,
        "streaming_ms": pytest.approx(2.0),
        "dense_ms": pytest.approx(4.0),
        "recompute_ms": pytest.approx(50.0),
        "streaming_vs_dense": pytest.approx(0.5),
        "recompute_vs_streaming": pytest.approx(25.0),
        "streaming_mib": 3.0,
        "dense_mib": 2.5,
        "recompute_mib": 1024.0,
    }
    assert speed.describe(measured) == "   2,000 tokens streamed: streaming 2.0 ms, dense 4.0 ms, recompute 50.0 ms"


def test_checks_look_at_full_cache_checkpoints_only():
    sizes = speed.SpeedSizes(sinks=4, window=28, checkpoints=(16, 64, 10_000, 20_000), steps=1)
    latency = {"streaming": 0.010, "dense": 0.010, "recompute": 0.300}

    def measured(streamed: int, fill: int, mib: int, **latencies: float) -> speed.Measurement:
        return speed.Measurement(streamed, fill, latency | latencies, dict.fromkeys(speed.POLICIES, mib * 2**20))

    measurements = [
        measured(16, 16, 50, streaming=0.5),  # not full yet: ignored
        measured(64, 32, 90, streaming=0.0104),
        measured(10_000, 32, 100),  # the memory baseline
        measured(20_000, 32, 102),
    ]
    found = {check.name: (round(check.value, 3), check.met) for check in speed.checks(measurements, sizes)}
    assert found == {
        "streaming / dense latency, full cache (worst)": (1.04, True),
        "recompute / streaming latency, cache 32 (worst)": (28.846, True),
        "streaming memory growth % from 10,000 to 20,000 tokens": (2.0, False),
    }


# ---- --tp N ------------------------------------------------------------------------------------

TP_LINE = r"decode \d+\.\d\d ms/token · {} on cpu · 16 tokens"


@pytest.mark.multiprocess
def test_bench_speed_tp_2_reports_decode_ms_per_token_for_one_process_and_for_two(tiny_chat_model):
    command = [sys.executable, "-m", "streamchat", "bench", "speed", "--tp", "2", "--model", str(tiny_chat_model)]
    command += ["--device", "cpu", "--dtype", "float32", "--window", "40", "--steps", "16"]
    result = subprocess.run(
        command, capture_output=True, timeout=HANG_GUARD_SECONDS, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(TP_LINE.format("1 process"), lines[0])
    assert re.fullmatch(TP_LINE.format(r"2 processes \(gloo\)"), lines[1])


def test_bench_speed_tp_refuses_random_weights_in_one_line():
    command = [sys.executable, "-m", "streamchat", "bench", "speed", "--tp", "2", "--random-init", "tiny"]
    result = subprocess.run(command, capture_output=True, timeout=HANG_GUARD_SECONDS)
    assert result.returncode == 2
    assert (
        result.stderr.decode() == "error: --tp loads --model's weights sharded: give --model instead of --random-init\n"
    )
