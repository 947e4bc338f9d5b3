#!/usr/bin/env python3
"""The sink cache's accuracy figures, as the tests measure them, printed instead of asserted.

    .venv/bin/python -m tests.cache.figures drift          # 1,000,000 synthetic tokens, bf16 and fp16
    .venv/bin/python -m tests.cache.figures architectures  # every supported model type vs the reference
    .venv/bin/python -m tests.cache.figures architectures llama:yarn gemma2
    .venv/bin/python -m tests.cache.figures snapshot       # /regen's bytes per turn, Llama-2-7B at 4+2000

Run from a clone's root, after `python3 scripts/bootstrap.py test` set up .venv: it reuses the
tests' own players and tiny models (tests/cache, tests/support), so it lives beside them.
"""

from __future__ import annotations

import random
import sys

import torch

from streamchat.cache.architectures import SUPPORTED_MODEL_TYPES
from tests.cache.players import UNIT_ROUNDOFF, Player
from tests.cache.test_against_reference import stream
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


def snapshot() -> None:
    """Bytes /regen keeps per turn, before (a host copy of the whole cache) and now (what the reply can write).

    Measured on Llama-2-7B's shapes with 2 of its 32 layers (every layer holds the same),
    random weights, bfloat16, a full 4 + 2000 cache, the default 512-token replies.
    """
    from transformers import AutoModelForCausalLM

    from streamchat import defaults
    from streamchat.cache import SinkCache, forward
    from streamchat.cache.snapshots import CacheSnapshot
    from streamchat.measure.models import random_config

    config = random_config("llama-2-7b")
    layers, config.num_hidden_layers = config.num_hidden_layers, 2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    cache = SinkCache.for_model(model, defaults.SINKS, defaults.WINDOW)
    ids = torch.randint(3, config.vocab_size, (1, defaults.SINKS + defaults.WINDOW + 100))
    for start in range(0, ids.shape[-1], defaults.PREFILL_CHUNK):
        forward(model, cache, ids[:, start : start + defaults.PREFILL_CHUNK])
    # Before: the keys and values of all sinks + window slots, and both copies of the sinks, per layer.
    slot_bytes = sum((layer.keys.nbytes + layer.values.nbytes) / layer.slots for layer in cache.layers)
    whole = slot_bytes * cache.capacity + sum(2 * layer.pristine_sinks.nbytes for layer in cache.layers)
    reply = CacheSnapshot.take(cache, reach=defaults.MAX_NEW_TOKENS + 2)  # a reply, then its end of turn
    scale = layers / config.num_hidden_layers
    saved = reply.slots.numel()
    print(f"before: {whole * scale / 2**20:,.0f} MiB copied to host memory per turn (the whole cache)")
    print(f"now:    {reply.nbytes * scale / 2**20:,.0f} MiB kept on the device per turn ({saved} of 2,005 slots)")


if __name__ == "__main__":
    commands = {"drift": drift, "architectures": lambda: architectures(sys.argv[2:]), "snapshot": snapshot}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]]()
