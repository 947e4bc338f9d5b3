"""How the engine's step scales with conversations: decode rows fed together, prompts read together.

    python scripts/engine_scaling_figures.py [--rows 1,2,4,8] [--context 256] [--prompt 45]
    python scripts/engine_scaling_figures.py --random-init llama-2-7b --device cuda --quantize none

The serving targets with the server taken away (no HTTP, no sessions): what one engine step
costs as it carries more conversations, on the default model (or random weights in a known
shape, --random-init, for a GPU without downloads).

- decode: R replies decoding together, each its own cache of --context tokens: ms per step,
  the step against one row's, and R x one row's ms / R rows' ms, the throughput R
  conversations get over one (a step that costs what one row's costs gives R x).
- prompts: P new conversations' prompts of --prompt tokens each, read at once, each in its own
  cache (the server's first turns of conversations that start together): ms until every
  prompt is read, against one prompt alone (the last first token's wait over one's).

A step whose cost stays flat as rows are added (memory-bound: a GPU's) lets R conversations
decode at nearly R times one's speed; a step whose cost grows with its rows (compute-bound: a
CPU's int4 products past one row) cannot. Rows take turns within a round; medians of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.cache.ledger import NO_LABEL
from streamchat.engine.engine import Engine
from streamchat.generation.decoder import Decoder
from streamchat.generation.requests import EndlessReply, Reading, read_prompt
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.measure.bandwidth import synchronize
from streamchat.measure.models import ModelChoice

STEPS = 16  # decode steps timed per round
SINKS = 16  # each cache's sinks: a short system turn's


def random_ids(count: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (1, count), generator=generator).to(device)


def decoding_engine(model: Any, rows: int, context: int, window: int) -> Engine:
    """An engine with `rows` replies decoding, each after `context` tokens of its own; the pool already joined."""
    engine = Engine(model)
    vocab, device = model.config.vocab_size, model.get_input_embeddings().weight.device
    for row in range(rows):
        cache = SinkCache.for_model(model, SINKS, window)
        decoder = Decoder(cache)
        logits = read_prompt(model, cache, random_ids(context, vocab, row, device)[0].tolist())
        decoder.start(logits, GenerationSettings(temperature=0.0), Sampler(row))
        engine.submit(EndlessReply(decoder))
    for _ in range(2):  # the first step joins the pool; the second runs as every later one
        engine.step()
    return engine


def decode_ms(engine: Engine, device: torch.device) -> float:
    """Milliseconds per step over STEPS steps."""
    synchronize(device)
    started = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    synchronize(device)
    return (time.perf_counter() - started) / STEPS * 1e3


def prompts_ms(model: Any, prompts: int, length: int, window: int, seed: int) -> float:
    """Milliseconds until `prompts` prompts of `length` tokens, submitted together, are all read."""
    engine = Engine(model)
    vocab, device = model.config.vocab_size, model.get_input_embeddings().weight.device
    readings = []
    for index in range(prompts):
        cache = SinkCache.for_model(model, SINKS, window)
        ids = random_ids(SINKS + length, vocab, seed + index, device)
        read_prompt(model, cache, ids[0, :SINKS].tolist())  # the system turn, before
        prompt = [(ids[0, SINKS:].tolist(), 0)]
        readings.append(Reading(cache, prompt, NO_LABEL, defaults.PREFILL_CHUNK, lambda eviction: eviction))
    synchronize(device)
    started = time.perf_counter()
    for reading in readings:
        engine.submit(reading)
    left = len(readings)
    while left:
        left -= sum(output.ended for output in engine.step())
    synchronize(device)
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--random-init", default=None, help="random weights in this shape (a preset, config.json)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--rows", default="1,2,4,8", help="conversations side by side, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="tokens in each decoding cache")
    parser.add_argument("--prompt", type=int, default=45, help="tokens in each new conversation's prompt")
    parser.add_argument("--window", type=int, default=defaults.WINDOW)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    rows = [int(value) for value in arguments.rows.split(",")]
    choice = ModelChoice(None, arguments.device, arguments.dtype, arguments.quantize, arguments.random_init)
    subject = choice.bench_model()
    model, device = subject.model, subject.device
    print(f"{subject.name}, {subject.precision}, {device}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        engines = {count: decoding_engine(model, count, arguments.context, arguments.window) for count in rows}
        decode: dict[int, list[float]] = {count: [] for count in rows}
        reads: dict[int, list[float]] = {count: [] for count in rows}
        for round_index in range(arguments.rounds):
            for count in rows:
                decode[count].append(decode_ms(engines[count], device))
                reads[count].append(prompts_ms(model, count, arguments.prompt, arguments.window, 100 * round_index))
    one_decode, one_read = statistics.median(decode[rows[0]]), statistics.median(reads[rows[0]])
    print(f"decode, caches of {SINKS}+{arguments.context} tokens; prompts of {arguments.prompt} tokens read at once")
    print(f"{'rows':>4} {'step ms':>8} {'x one':>6} {'tok/s':>8} {'tok/s x one':>11}   {'prompts ms':>10} {'x one':>6}")
    for count in rows:
        step, read = statistics.median(decode[count]), statistics.median(reads[count])
        print(
            f"{count:>4} {step:>8.2f} {step / one_decode:>6.2f} {count * 1e3 / step:>8.1f}"
            f" {count * one_decode / (step * rows[0]):>11.2f}   {read:>10.1f} {read / one_read:>6.2f}"
        )


if __name__ == "__main__":
    main()
