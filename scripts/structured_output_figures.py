"""Replies held to JSON schemas: whether they parse and validate, and what holding one costs the others.

    python scripts/structured_output_figures.py [--replies 200] [--rows 8] [--rounds 5]

Two parts, on the default model (or --model), as `run` loads it:

- replies: --replies answers to the shipped chat questions, each in a new conversation, each
  held to one of a few schemas in turn (objects, arrays, enums, numbers with bounds, nested;
  every string and array bounded, so that the longest value fits --max-new-tokens),
  sampled with its own seed: how many parse, how many validate (jsonschema, when installed),
  how many ended by themselves (a stop token once the value was whole) rather than at
  --max-new-tokens.
- speed: --rows replies decoding side by side in one engine, as a server's conversations do,
  every row free against one row held to a schema that never closes (an array of strings: its
  grammar works at every token); and one row alone, free and held. ms per step: a step feeds
  every row one token, so the step's time is every row's time per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources
from typing import Any

import torch

from streamchat.cache import SinkCache
from streamchat.conversation.driven import driven_session
from streamchat.conversation.session import SessionOptions
from streamchat.engine.engine import Engine
from streamchat.generation.constraint import JsonFormat
from streamchat.generation.decoder import Decoder
from streamchat.generation.events import TurnFinished
from streamchat.generation.requests import EndlessReply, read_prompt
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.measure.models import ModelChoice

# The longest string a schema lets a reply write. Every string and array of these schemas is bounded, so the longest
# value fits --max-new-tokens (a token holds at least a character): a small model can loop inside an unbounded
# string until the limit cuts the reply (finish_reason "length"), and no grammar can stop that.
TEXT = 80
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": TEXT},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {"type": "string", "maxLength": TEXT}, "minItems": 1, "maxItems": 5}
        },
        "required": ["steps"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "topic": {"type": "string", "maxLength": TEXT},
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": TEXT}, "maxItems": 4},
        },
        "required": ["topic", "sentiment", "keywords"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": TEXT},
            "parts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": TEXT},
                        "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
                    },
                    "required": ["name", "minutes"],
                    "additionalProperties": False,
                },
                "maxItems": 4,
            },
        },
        "required": ["title", "parts"],
        "additionalProperties": False,
    },
]
NEVER_CLOSES = {"type": "array", "items": {"type": "string"}}
SYSTEM = "You answer in JSON only."
CONTEXT = 256  # tokens in each decoding cache, for the speed part
SINKS = 16
STEPS = 16  # decode steps timed per round


def replies(model: Any, tokenizer: Any, count: int, max_new_tokens: int) -> None:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    questions = resources.files("streamchat.data").joinpath("chat_questions.txt").read_text().splitlines()
    parsed = valid = ended = tokens = 0
    started = time.perf_counter()
    for index in range(count):
        schema = SCHEMAS[index % len(SCHEMAS)]
        settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.7, top_p=0.9, seed=index)
        options = SessionOptions(system_prompt=SYSTEM, settings=settings, reply_format=JsonFormat(schema))
        finished = next(
            event
            for event in driven_session(model, tokenizer, options).chat(questions[index % len(questions)])
            if isinstance(event, TurnFinished)
        )
        tokens += finished.stats.generated_tokens
        ended += finished.stats.stop_reason == "eos"
        try:
            value = json.loads(finished.reply)
        except json.JSONDecodeError:
            print(f"reply {index} does not parse ({finished.stats.stop_reason}): {finished.reply[:120]!r}")
            continue
        parsed += 1
        if jsonschema is not None:
            try:
                jsonschema.validate(value, schema)
            except jsonschema.ValidationError as error:
                print(f"reply {index} does not validate: {error.message}")
                continue
        valid += 1
    seconds = time.perf_counter() - started
    checked = "validate" if jsonschema is not None else "validate (not checked: pip install jsonschema)"
    print(
        f"replies: {count}, parse {parsed} ({100 * parsed / count:.1f} %), {checked} {valid} "
        f"({100 * valid / count:.1f} %), ended by themselves {ended}; {tokens / count:.1f} tokens a reply, "
        f"{seconds:.1f} s"
    )


def decoding_engine(model: Any, tokenizer: Any, rows: int, held: int, window: int) -> Engine:
    """`rows` replies decoding side by side after CONTEXT tokens each, the first `held` of them held to a schema
    that never closes."""
    engine = Engine(model)
    vocab = model.config.vocab_size
    stops = frozenset({tokenizer.eos_token_id})
    for row in range(rows):
        cache = SinkCache.for_model(model, SINKS, window)
        decoder = Decoder(cache, vocab_size=len(tokenizer))
        ids = torch.randint(10, vocab - 1, (CONTEXT,), generator=torch.Generator().manual_seed(row)).tolist()
        constraint = JsonFormat(NEVER_CLOSES).constraint(tokenizer, stops) if row < held else None
        settings = GenerationSettings(temperature=0.7, seed=row)
        decoder.start(read_prompt(model, cache, ids), settings, Sampler(row), constraint=constraint)
        engine.submit(EndlessReply(decoder))
    for _ in range(2):  # the first step joins the batch; the second runs as every later one
        engine.step()
    return engine


def step_ms(engine: Engine) -> float:
    started = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    return (time.perf_counter() - started) / STEPS * 1e3


def speed(model: Any, tokenizer: Any, rows: int, rounds: int, window: int) -> None:
    setups = {
        f"{rows} free": (rows, 0),
        f"{rows}, one held": (rows, 1),
        "1 free": (1, 0),
        "1 held": (1, 1),
    }
    engines = {name: decoding_engine(model, tokenizer, count, held, window) for name, (count, held) in setups.items()}
    timings: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(rounds):  # side by side: each setup once a round
        for name, engine in engines.items():
            timings[name].append(step_ms(engine))
    medians = {name: statistics.median(values) for name, values in timings.items()}
    print(f"speed: caches of {SINKS}+{CONTEXT} tokens, medians of {rounds} rounds of {STEPS} steps")
    print(f"{'rows':>14} {'step ms':>8} {'x free':>7}")
    for name, (count, _) in setups.items():
        free = medians[f"{count} free" if count == rows else "1 free"]
        print(f"{name:>14} {medians[name]:>8.2f} {medians[name] / free:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--replies", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=1024)
    arguments = parser.parse_args()
    subject = ModelChoice(arguments.model, None, None, None).bench_model()
    print(f"{subject.name}, {subject.precision}, {subject.device}, {torch.get_num_threads()} threads")
    if arguments.replies:
        replies(subject.model, subject.tokenizer, arguments.replies, arguments.max_new_tokens)
    if arguments.rows:
        with torch.inference_mode():
            speed(subject.model, subject.tokenizer, arguments.rows, arguments.rounds, arguments.window)


if __name__ == "__main__":
    main()
