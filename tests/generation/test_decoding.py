"""Replies decoded in the engine's shared steps equal the same replies decoded alone, row by row: tokens, caches,
sampling; a benchmark's endless reply feeds the model's own greedy tokens."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.engine import Engine
from streamchat.engine.work import Advanced, DecodeRow, Fed
from streamchat.generation.decoder import Decoder
from streamchat.generation.decoding import Reply, endless_reply
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.placement.fusion import fuse_projections
from tests.generation.test_decoder import _LateReader
from tests.support.models import VOCAB, tiny_model
from tests.support.tokenizers import byte_level_tokenizer

WINDOW = 48
GREEDY = GenerationSettings(temperature=0.0)
SAMPLED = GenerationSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.3)
# Each row counts its own reply's tokens.
PENALIZED = GenerationSettings(temperature=0.8, top_p=0.9, frequency_penalty=0.6, presence_penalty=0.4)
GREEDY_PENALIZED = GenerationSettings(temperature=0.0, frequency_penalty=0.3, presence_penalty=1.0)


class Conversation:
    """One row: its own sinks, prompt, settings and seed; joins at round `joins`, decodes `count` tokens."""

    def __init__(self, model, sinks: int, prompt: int, count: int, joins: int, settings, seed: int) -> None:
        self.sinks, self.prompt, self.count, self.joins = sinks, prompt, count, joins
        self.settings, self.seed = settings, seed
        self.cache = SinkCache.for_model(model, sinks, WINDOW)
        ids = torch.randint(3, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(seed))
        self.decoder = Decoder(self.cache, vocab_size=VOCAB)
        self.decoder.start(forward(model, self.cache, ids).logits, settings, Sampler(seed=seed))
        self.model = model
        self.tokens: list[int] = []
        self.ended = False

    def alone(self, count: int | None = None) -> list[int]:
        """Its next `count` tokens (its reply's), decoded in an engine of its own: one row a step."""
        next_token = endless_reply(self.model, self.decoder)
        return [next_token().token for _ in range(count or self.count)]

    # ---- a request of the engine's (engine/work.py: Request): `count` tokens, drawn and fed as a reply's are ----

    def next_work(self) -> DecodeRow:
        drawn = self.decoder.draw()
        self.decoder.checkpoint()
        return DecodeRow(self.cache, drawn.on_device, drawn.token_id)

    def advance(self, fed: Fed) -> Advanced:
        token = self.decoder.fed(fed.logits)  # None: a guess drawn again, its step taken back
        if token is not None:
            self.tokens.append(token)
        return Advanced((), len(self.tokens) < self.count)

    def end(self, error: BaseException | None) -> None:
        assert error is None
        self.ended = True


def run_rounds(engine: Engine, conversations: list[Conversation]) -> int:
    """Replies joining at their round, each decoding in the engine's steps until it ends; the most rows one step
    fed."""
    waiting, widest, rounds = sorted(conversations, key=lambda c: c.joins), 0, 0
    while waiting or not all(conversation.ended for conversation in conversations):
        while waiting and waiting[0].joins <= rounds:
            engine.submit(waiting.pop(0))
        if engine.has_work():
            fed = engine.rows_fed
            engine.step()
            widest = max(widest, engine.rows_fed - fed)
        rounds += 1
    return widest


def conversations(model, settings) -> list[Conversation]:
    # Different sinks, prompt lengths (so positions and sink shifts differ), lengths and arrival times:
    # the window fills and evicts in every row, rows join and leave while others decode.
    return [
        Conversation(model, 4, 20, 90, 0, settings, 1),
        Conversation(model, 7, 40, 60, 5, settings, 2),
        Conversation(model, 2, 5, 120, 0, settings, 3),
        Conversation(model, 4, 44, 30, 40, settings, 4),
        Conversation(model, 9, 30, 70, 12, settings, 5),
    ]


@pytest.mark.parametrize("model_type", ["llama", "llama-fused", "gemma2"])
@pytest.mark.parametrize(
    "settings",
    [GREEDY, SAMPLED, PENALIZED, GREEDY_PENALIZED],
    ids=["greedy", "sampled", "penalized", "greedy-penalized"],
)
def test_every_row_of_a_batch_decodes_the_tokens_it_decodes_alone(model_type, settings):
    # float32; gemma2 has sliding layers beside the sink layers; fused llama runs the lean forward
    model = tiny_model(model_type.removesuffix("-fused"))
    if model_type.endswith("-fused"):
        model = copy.deepcopy(model)  # fusing works in place; tiny_model's models are shared
        fuse_projections(model)
        assert Engine(model).runner.lean is not None
    alone = [conversation.alone() for conversation in conversations(model, settings)]
    batched = conversations(model, settings)
    engine = Engine(model)
    widest = run_rounds(engine, batched)
    assert widest == 5  # every row decoded together at some point
    assert engine.runner.members == [] and engine.steps < sum(c.count for c in batched)
    assert [conversation.tokens for conversation in batched] == alone
    assert len({tuple(tokens) for tokens in alone}) == len(alone)  # five different streams
    assert all(conversation.cache.stats().evicted > 0 for conversation in batched)


def test_rows_fed_before_the_host_reads_their_tokens_decode_the_tokens_read_first():
    """The order on a GPU (generation/decoder.py), on the CPU: each row's token is fed as drawn and read after the
    step; a guess its shortlist could not decide is taken back and drawn again, the others' rows going on."""
    model = tiny_model("llama")
    alone = [conversation.alone() for conversation in conversations(model, SAMPLED)]
    batched = conversations(model, SAMPLED)
    for conversation in batched:
        conversation.decoder._reader = _LateReader()
    engine = Engine(model)
    run_rounds(engine, batched)
    assert [conversation.tokens for conversation in batched] == alone
    assert engine.rows_fed > sum(len(tokens) for tokens in alone)  # guesses were fed, and taken back


def test_a_cache_after_a_batch_holds_what_it_holds_decoded_alone_and_owns_its_storage():
    model = tiny_model("llama")
    alone = conversations(model, SAMPLED)
    for conversation in alone:
        conversation.alone()
    batched = conversations(model, SAMPLED)
    run_rounds(Engine(model), batched)
    for one, other in zip(alone, batched, strict=True):
        mine, theirs = CacheSnapshot.whole(one.cache).tensors(), CacheSnapshot.whole(other.cache).tensors()
        assert mine.keys() == theirs.keys()
        for name in mine:
            torch.testing.assert_close(theirs[name], mine[name], rtol=0, atol=1e-5, msg=name)
        for layer in other.cache.layers:
            assert layer.keys._base is None and layer.keys.is_contiguous()  # no view of the pool left
    # ... and each goes on decoding alone exactly as the one never batched
    for one, other in zip(alone, batched, strict=True):
        assert other.alone(20) == one.alone(20)


def test_a_benchmark_s_engine_steps_feed_the_greedy_tokens_of_the_model_s_own_forward():
    model = copy.deepcopy(tiny_model("llama", vocab_size=VOCAB))
    fuse_projections(model)  # the lean pass, as the chat's engine runs it
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    cache, reference = SinkCache.for_model(model, 4, 12), SinkCache.for_model(model, 4, 12)
    decoder = Decoder(cache, vocab_size=VOCAB)
    decoder.start(forward(model, cache, ids).logits, GREEDY, Sampler(0))
    next_token = endless_reply(model, decoder)
    logits, expected = forward(model, reference, ids).logits, []
    for _ in range(20):  # past the window: evicting
        expected.append(int(logits[0, -1].argmax()))
        logits = forward(model, reference, torch.tensor([expected[-1:]])).logits
    assert [next_token().token for _ in range(20)] == expected
    assert cache.held_tokens() == reference.held_tokens()
    assert cache.stats() == reference.stats() and cache.stats().evicted > 0


# ---- Reply: a reply's text as it grows, stop strings that straddle tokens, its stats ----


def grow(text: str, stop: tuple[str, ...] = ()) -> tuple[Reply, list[str]]:
    """Feed `text` one byte-level token per character until the reply stops."""
    tokenizer = byte_level_tokenizer()
    started = time.perf_counter() - 1.0
    reply = Reply(tokenizer, GenerationSettings(max_new_tokens=100, stop=stop), started, prefilled=started + 0.25)
    shown = []
    for character in text:
        for token in tokenizer.encode(character, add_special_tokens=False):
            shown.append(reply.add(token))
        if reply.reason == "stop_string":
            break
    shown.append(reply.flush())
    return reply, shown


def test_without_stop_strings_every_token_shows_and_the_text_is_whole():
    reply, shown = grow("Hello, wörld")
    assert "".join(shown) == reply.text == "Hello, wörld"
    assert reply.reason == "max_new_tokens"


def test_a_stop_string_across_tokens_cuts_the_text_before_it():
    reply, shown = grow("one two END three", stop=("END",))
    assert reply.text == "".join(shown) == "one two "
    assert reply.reason == "stop_string"


def test_the_earliest_of_several_stop_strings_wins():
    reply, _ = grow("abc xyz def", stop=("def", " xy"))
    assert reply.text == "abc"


def test_stats_count_the_tokens_and_time_the_prompt_the_first_token_and_the_rest():
    reply, _ = grow("hello there")
    stats = reply.stats(prompt_tokens=7)
    assert stats.prompt_tokens == 7 and stats.generated_tokens == len(reply.ids) == 11
    assert stats.prefill_seconds == 0.25 and stats.time_to_first_token >= 1.0
    assert stats.decode_seconds >= 0 and stats.stop_reason == "max_new_tokens"


def test_text_that_may_begin_a_stop_string_waits_until_it_cannot():
    reply, shown = grow("xEN yEN", stop=("END",))
    assert shown == ["x", "", "", "EN ", "y", "", "", "EN"]  # " " rules out "END"; the reply end releases the rest
    assert reply.text == "xEN yEN" and reply.reason == "max_new_tokens"


def test_the_stop_string_that_ended_a_reply_is_the_earliest_in_its_text():
    reply, _ = grow("one two three", stop=("three", "two", "e t"))
    assert (reply.text, reply.reason, reply.stop_string) == ("on", "stop_string", "e t")
    assert reply.stats(prompt_tokens=1).stop_string == "e t"
    assert grow("one two three", stop=("three", "two"))[0].stop_string == "two"
    assert grow("one two")[0].stop_string is None
