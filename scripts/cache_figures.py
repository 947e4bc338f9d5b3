#!/usr/bin/env python3
"""The sink cache's accuracy figures, as the tests measure them, printed instead of asserted.

    .venv/bin/python scripts/cache_figures.py drift          # 1,000,000 synthetic tokens, bf16 and fp16
    .venv/bin/python scripts/cache_figures.py architectures  # every supported model type vs the reference
    .venv/bin/python scripts/cache_figures.py architectures llama:yarn gemma2

Run from a clone, after `python3 scripts/bootstrap.py test` set up .venv: it reuses the
tests' own players and tiny models (tests/cache, tests/support).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from streamchat.cache.architectures import SUPPORTED_MODEL_TYPES
from tests.cache.test_against_reference import stream
from tests.cache.test_sink_cache import UNIT_ROUNDOFF, Player
from tests.support.models import tiny_model


def drift() -> None:
    """The worst cached key after a million tokens through 4+60, against its exact in-cache value."""
    for dtype in (torch.bfloat16, torch.float16):
        player = Player(sinks=4, window=60, dtype=dtype)
        steps = random.Random(7)  # the test's mix of single tokens and 30-60 token chunks
        worst = 0.0
        while player.seen < 1_000_000:
            count = 1 if steps.random() < 0.25 else steps.randint(30, 60)
            returned, positions = player.feed(count)
            if player.seen % 97 == 0 or player.seen > 999_000:
                worst = max(worst, player.worst_error(returned, positions))
        roundings = worst / UNIT_ROUNDOFF[dtype]
        print(f"{dtype}: worst relative key error {worst:.3e} = {roundings:.2f} unit roundoffs (bound 2)", flush=True)


def architectures(names: list[str]) -> None:
    """fp32 max |logit difference| and bf16 top-1 agreement against the paper-style reference."""
    torch.set_num_threads(1)
    for name in names or sorted(SUPPORTED_MODEL_TYPES):
        model_type, _, scaling = name.partition(":")
        worst, _ = stream(tiny_model(model_type, rope_scaling=scaling or None), follow=False)
        bf16 = tiny_model(model_type, rope_scaling=scaling or None, dtype=torch.bfloat16)
        _, agreement = stream(bf16, follow=True)
        print(f"{name:16} fp32 max|dlogit| {worst:.2e}   bf16 top-1 agreement {agreement:.2%}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("drift", "architectures"):
        sys.exit(__doc__)
    if sys.argv[1] == "drift":
        drift()
    else:
        architectures(sys.argv[2:])
