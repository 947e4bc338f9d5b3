"""The benches' sizes: the full or --quick preset, with the options given; sizes below their floor are refused."""

from dataclasses import dataclass

import pytest

from streamchat.bench.options import require_at_least, sizes_for
from streamchat.errors import ConfigError


@dataclass(frozen=True)
class Sizes:
    tokens: int
    window: int

    def __post_init__(self) -> None:
        require_at_least("--window", self.window, 1)


FULL, QUICK = Sizes(tokens=1000, window=100), Sizes(tokens=10, window=4)


def test_the_preset_chosen_takes_only_the_options_given():
    assert sizes_for(False, FULL, QUICK) == FULL
    assert sizes_for(True, FULL, QUICK) == QUICK
    assert sizes_for(True, FULL, QUICK, tokens=50, window=None) == Sizes(tokens=50, window=4)
    assert sizes_for(False, FULL, QUICK, window=7) == Sizes(tokens=1000, window=7)


def test_an_option_below_its_floor_is_refused_by_name_and_value():
    with pytest.raises(ConfigError, match=r"^--window 0: must be at least 1$"):
        sizes_for(False, FULL, QUICK, window=0)
    require_at_least("--sinks", 0, 0)
