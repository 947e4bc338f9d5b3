"""The speed benchmark on a tiny model: what gets measured at each checkpoint, and what it shows."""

import pytest

from streamchat import defaults
from streamchat.bench import speed
from streamchat.engine.settings import GenerationSettings
from streamchat.errors import ConfigError
from tests.support.models import tiny_model

SETTINGS = GenerationSettings()


def test_sizes_and_checkpoints_are_validated_with_the_option_named():
    assert speed.sizes_for(False) == speed.FULL
    assert (speed.FULL.sinks, speed.FULL.window, speed.FULL.steps) == (defaults.SINKS, defaults.WINDOW, 9)
    assert speed.parse_checkpoints("100,200") == (100, 200) and speed.parse_checkpoints(None) is None
    assert speed.sizes_for(True, checkpoints=(10, 20), steps=None).checkpoints == (10, 20)
    with pytest.raises(ConfigError, match="--checkpoints 'a,b': give whole numbers"):
        speed.parse_checkpoints("a,b")
    for checkpoints in ((200, 100), (100, 100), (0, 10)):
        with pytest.raises(ConfigError, match="give increasing token counts"):
            speed.sizes_for(True, checkpoints=checkpoints)
    with pytest.raises(ConfigError, match="--steps 0: must be at least 1"):
        speed.sizes_for(True, steps=0)
    with pytest.raises(ConfigError, match="need sinks >= 0 and window >= 1"):
        speed.sizes_for(True, window=0)


def test_a_run_measures_every_policy_at_every_checkpoint():
    sizes = speed.SpeedSizes(sinks=4, window=28, checkpoints=(16, 64, 96), steps=2)
    seen = []
    measurements, memory_kind = speed.run_speed(tiny_model(), sizes, SETTINGS, seen.append)
    assert seen == measurements
    assert [(m.streamed, m.fill) for m in measurements] == [(16, 16), (64, 32), (96, 32)]
    for measurement in measurements:
        assert set(measurement.latency) == set(speed.POLICIES) == set(measurement.peak_memory)
        assert all(seconds > 0 for seconds in measurement.latency.values())
        assert all(peak > 2**20 for peak in measurement.peak_memory.values())
    assert memory_kind in ("peak RSS", "peak RSS since start")
    rows = speed.rows(measurements)
    assert [column.key for column in speed.columns()] == list(rows[0])
    assert rows[1]["streaming_vs_dense"] == pytest.approx(
        measurements[1].latency["streaming"] / measurements[1].latency["dense"]
    )


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
