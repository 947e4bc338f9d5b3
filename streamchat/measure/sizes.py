"""How big a benchmark runs: the full sizes or the --quick ones, with the options the user gave."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from streamchat.errors import ConfigError

# A frozen dataclass of sizes (PplSizes, SpeedSizes) that validates itself when built.
Sizes = TypeVar("Sizes")


def sizes_for(quick: bool, full: Sizes, quick_sizes: Sizes, **options: object) -> Sizes:
    """`quick_sizes` or `full`, with every option that was given (not None) in place of its default."""
    given = {name: value for name, value in options.items() if value is not None}
    return dataclasses.replace(quick_sizes if quick else full, **given)


def require_at_least(option: str, value: int, least: int) -> None:
    """Refuse `option` (as typed on the command line) when `value` is below `least`."""
    if value < least:
        raise ConfigError(f"{option} {value}: must be at least {least}")
