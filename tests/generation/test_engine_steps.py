"""Replies decoded in the engine's shared steps equal the same replies decoded alone, row by row: tokens, caches,
sampling."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.engine import Engine
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.engine.work import DecodeRow, Fed
from streamchat.generation.decoder import Decoder
from streamchat.generation.engine_steps import DecodingReply, Waiting, engine_step
from streamchat.generation.events import TextDelta
from streamchat.generation.prompt_reading import Reading
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.placement.fusion import fuse_projections
from tests.distributed.test_follower import Recorder, Replayer
from tests.generation.test_decoder import _LateReader
from tests.support.models import VOCAB, tiny_model

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
        step = engine_step(self.model, self.decoder)
        return [step().token for _ in range(count or self.count)]

    # ---- a request of the engine's (engine/work.py: Request): `count` tokens, drawn and fed as a reply's are ----

    def next_work(self) -> DecodeRow:
        drawn = self.decoder.draw()
        self.decoder.checkpoint()
        return DecodeRow(self.cache, drawn.on_device, drawn.token_id)

    def advance(self, fed: Fed) -> bool:
        token = self.decoder.fed(fed.logits)  # None: a guess drawn again, its step taken back
        if token is not None:
            self.tokens.append(token)
        return len(self.tokens) < self.count

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


def chat_session(model, settings: GenerationSettings, system: str, **options):
    """A session over `model`, as the tests below chat: a byte-level tokenizer, a 40-token window."""
    from streamchat.conversation.session import ChatSession, SessionOptions
    from tests.support.tokenizers import byte_level_tokenizer

    chosen = SessionOptions(settings=settings, window=40, system_prompt=system, **options)
    return ChatSession(model, byte_level_tokenizer(), chosen)


def test_a_session_snapshot_after_batched_turns_is_the_one_never_batched_and_restores_the_same():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=30, temperature=0.7, seed=5)

    def session(system: str):
        return chat_session(model, settings, system)

    systems, questions = ["Be brief.", "You are a poet who likes long words."], ["Hi there.", "And then?"]
    alone = [session(system) for system in systems]
    for one in alone:
        for question in questions:
            list(one.chat(question))
    engine = Engine(model)
    batched = [session(system) for system in systems]
    for one in batched:
        one.run_in(engine)
    for question in questions:
        turns = [one.chat(question) for one in batched]
        while turns:
            for turn in list(turns):
                if next(turn, None) is None:
                    turns.remove(turn)
            if engine.has_work():
                engine.step()
    assert engine.rows_fed > engine.steps and engine.runner.members == []
    assert engine.chunk_tokens > 0  # the prompts were read in the engine's steps too
    for one, other in zip(alone, batched, strict=True):
        mine, theirs = one.snapshot(), other.snapshot()
        assert theirs.messages == mine.messages and theirs.tensors is not None
        assert theirs.tensors.tensors.keys() == mine.tensors.tensors.keys()
        for name, tensor in mine.tensors.tensors.items():
            torch.testing.assert_close(theirs.tensors.tensors[name], tensor, rtol=0, atol=1e-5, msg=name)
        restored = session(other.system_prompt)
        list(restored.restore(theirs))
        assert [e.text for e in restored.chat("More?") if hasattr(e, "text")] == [
            e.text for e in one.chat("More?") if hasattr(e, "text")
        ]


def test_a_driver_takes_each_reply_s_text_from_the_reply_and_resumes_its_conversation_once_its_request_ended():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=25, temperature=0.7, seed=3)
    systems = ["Be brief.", "You are a poet."]
    alone = [chat_session(model, settings, system) for system in systems]
    engine = Engine(model)
    shared = [chat_session(model, settings, system) for system in systems]
    for one in shared:
        one.run_in(engine)
    for question in ["Hi there.", "And then?"]:
        turns = {index: one.chat(question) for index, one in enumerate(shared)}
        awaited: dict[int, DecodingReply | Reading] = {}  # the request each conversation waits on
        texts = {index: "" for index in turns}
        waits = []
        while turns:
            for index, turn in list(turns.items()):
                if index in awaited:  # the driver resumes it only once its request ended
                    continue
                for event in turn:
                    if isinstance(event, Waiting):
                        awaited[index] = event.request
                        waits.append((index, event.request))
                        break
                    if isinstance(event, TextDelta):
                        texts[index] += event.text  # the end of the text, held back until the reply ended
                else:
                    del turns[index]
            if engine.has_work():
                engine.step()
            for index, request in list(awaited.items()):
                texts[index] += "".join(e.text for e in request.said() if isinstance(e, TextDelta))
                if request.ended:
                    del awaited[index]
        # One wait a request, however many steps it took: its prompt read, its reply, its turn's end fed.
        assert len({id(request) for _, request in waits}) == len(waits)
        kinds = sorted((index, type(request).__name__) for index, request in waits)
        assert kinds == [(i, kind) for i in (0, 1) for kind in ("DecodingReply", "Reading", "Reading")]
        for index, one in enumerate(alone):
            mine = "".join(e.text for e in one.chat(question) if isinstance(e, TextDelta))
            assert texts[index] == mine and len(mine) > 5
            assert shared[index].transcript == one.transcript
    assert engine.rows_fed > engine.steps  # the replies decoded together


def test_a_conversation_with_its_own_engine_runs_each_step_and_yields_nothing_but_its_events():
    from streamchat.conversation.session import ChatSession, SessionOptions
    from tests.support.tokenizers import byte_level_tokenizer

    model = copy.deepcopy(tiny_model("llama", vocab_size=700))
    fuse_projections(model)  # the chat's models are fused: the engine's lean pass
    settings = GenerationSettings(max_new_tokens=40, temperature=0.7, seed=9)

    def session() -> ChatSession:
        options = SessionOptions(settings=settings, window=40, system_prompt="Hi.")
        return ChatSession(model, byte_level_tokenizer(), options)

    alone, shared = session(), session()
    engine = Engine(model)
    shared.run_in(engine)
    for question in ["Hello there.", "And then what happened?", "Go on."]:
        mine = list(alone.chat(question))
        [theirs] = driven(engine, [shared.chat(question)])
        assert not any(isinstance(event, Waiting) for event in mine)
        assert [e.text for e in theirs if hasattr(e, "text")] == [e.text for e in mine if hasattr(e, "text")]
    assert_same_conversation(alone, shared)
    own = alone.token_loop.own_engine.engine
    assert own.steps > 0 and own.runner.members == []  # every step ran through its engine, one row

    def stopped_after_three_deltas(session: ChatSession) -> tuple[str, int]:
        deltas, finished = 0, None
        for event in session.chat("Tell me more, at length."):
            deltas += isinstance(event, TextDelta)
            if deltas == 3:
                session.stop()  # a Ctrl-C: heeded before the next token is drawn
            finished = event
        return finished.stats.stop_reason, deltas

    assert stopped_after_three_deltas(alone) == ("interrupted", 3)


def test_ranks_in_lockstep_each_through_its_own_engine_feed_the_leader_s_tokens():
    from streamchat.conversation.session import ChatSession, SessionOptions
    from tests.support.tokenizers import byte_level_tokenizer

    model = copy.deepcopy(tiny_model("llama", vocab_size=700))
    fuse_projections(model)
    settings = GenerationSettings(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=4)

    def session(channel, seed: int = 4) -> ChatSession:
        options = SessionOptions(settings=replace(settings, seed=seed), window=40, system_prompt="Hi.", channel=channel)
        return ChatSession(model, byte_level_tokenizer(), options)

    questions = ["Hello there.", "And then what happened?"]
    alone, leader_channel = session(None), Recorder()
    leader = session(leader_channel)
    for question in questions:
        list(alone.chat(question))
        list(leader.chat(question))
    assert leader.transcript == alone.transcript  # the leader draws as a run without ranks does
    follower = session(Replayer(leader_channel.steps), seed=5)  # a follower never draws: its seed is moot
    follower_engine = follower.token_loop.own_engine.engine
    for question in questions:
        list(follower.chat(question))
    assert follower.transcript == leader.transcript and follower.cache_stats() == leader.cache_stats()
    tokens_told = [step for step in leader_channel.steps if type(step) is int]
    assert follower_engine.steps >= len(tokens_told) > 0  # the follower fed every token told in its engine


def test_a_benchmark_s_engine_steps_feed_the_greedy_tokens_of_the_model_s_own_forward():
    model = copy.deepcopy(tiny_model("llama", vocab_size=VOCAB))
    fuse_projections(model)  # the lean pass, as the chat's engine runs it
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    cache, reference = SinkCache.for_model(model, 4, 12), SinkCache.for_model(model, 4, 12)
    decoder = Decoder(cache, vocab_size=VOCAB)
    decoder.start(forward(model, cache, ids).logits, GREEDY, Sampler(0))
    step = engine_step(model, decoder)
    logits, expected = forward(model, reference, ids).logits, []
    for _ in range(20):  # past the window: evicting
        expected.append(int(logits[0, -1].argmax()))
        logits = forward(model, reference, torch.tensor([expected[-1:]])).logits
    assert [step().token for _ in range(20)] == expected
    assert cache.held_tokens() == reference.held_tokens()
    assert cache.stats() == reference.stats() and cache.stats().evicted > 0


def assert_same_conversation(alone, shared) -> None:
    """`shared` says and holds what `alone` does: its transcript, its cache's figures, its cache within 1e-5."""
    assert shared.transcript == alone.transcript and shared.cache_stats() == alone.cache_stats()
    theirs = shared.snapshot().tensors.tensors
    for name, tensor in alone.snapshot().tensors.tensors.items():
        torch.testing.assert_close(theirs[name], tensor, rtol=0, atol=1e-5, msg=name)


def driven(engine: Engine, turns: list) -> list[list]:
    """Every turn's events (Waiting included), each turn resumed once a round and the engine stepped between."""
    said: list[list] = [[] for _ in turns]
    going = dict(enumerate(turns))
    while going:
        for index, turn in list(going.items()):
            event = next(turn, None)
            if event is None:
                del going[index]
            else:
                said[index].append(event)
        if engine.has_work():
            engine.step()
    return said


def test_conversations_that_begin_alike_read_their_sinks_once_and_go_on_as_each_would_alone():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=20, temperature=0.7, seed=2)
    questions = ["Hi there.", "Tell me more.", "And then?"]
    apart, apart_tokens = [], 0
    for question in questions:  # each alone: its own engine, its own sinks read
        one = chat_session(model, settings, "You are a poet.")
        engine = Engine(model)
        one.run_in(engine, shared_sinks=SharedSinks())
        driven(engine, [one.chat(question)])
        apart.append(one)
        apart_tokens += engine.chunk_tokens
    engine, shared = Engine(model), SharedSinks()
    together = [chat_session(model, settings, "You are a poet.") for _ in questions]
    for one in together:
        one.run_in(engine, shared_sinks=shared)
    said = driven(engine, [one.chat(question) for one, question in zip(together, questions, strict=True)])
    sinks = together[0].cache.sinks
    assert shared.copies == 2 and engine.chunk_tokens == apart_tokens - 2 * sinks  # the sinks read once
    assert sum(isinstance(event, Waiting) for event in said[1]) > 1  # it waited while the first read them
    for one, other in zip(apart, together, strict=True):
        assert_same_conversation(one, other)


def test_sinks_a_conversation_stopped_reading_are_read_by_the_one_that_waited_for_them():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=12, temperature=0.0)
    alone = chat_session(model, settings, "Be brief.")
    list(alone.chat("Why?"))
    engine, shared = Engine(model), SharedSinks()
    first, second = (chat_session(model, settings, "Be brief.") for _ in range(2))
    for one in (first, second):
        one.run_in(engine, shared_sinks=shared)
    reading, waiting = first.chat("Hello."), second.chat("Why?")
    assert isinstance(next(reading), Waiting)  # its sinks queued
    assert isinstance(next(waiting), Waiting)  # the same sinks: it waits for them
    reading.close()  # its client left before the step
    said = driven(engine, [waiting])[0]
    assert shared.copies == 0 and second.transcript == alone.transcript
    assert [e.text for e in said if isinstance(e, TextDelta)]


def test_replays_that_begin_alike_read_their_sinks_once_and_say_how_many_they_copied():
    from streamchat.conversation.state import ConversationState
    from streamchat.generation.events import Replayed

    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=8, temperature=0.0)
    history = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi! How are you?"}]
    state = ConversationState(history, "Be brief.", settings)
    alone = chat_session(model, settings, "Be brief.")
    engine = Engine(model)
    alone.run_in(engine, shared_sinks=SharedSinks())
    driven(engine, [alone.restore(state)])
    engine, shared = Engine(model), SharedSinks()
    together = [chat_session(model, settings, "Be brief.") for _ in range(2)]
    for one in together:
        one.run_in(engine, shared_sinks=shared)
    said = driven(engine, [one.restore(state) for one in together])
    replayed = [next(event for event in events if isinstance(event, Replayed)) for events in said]
    sinks = alone.cache.sinks
    assert shared.copies == 1 and [event.copied for event in replayed] == [0, sinks]
    assert replayed[0].tokens == replayed[1].tokens == alone.cache_stats().seen
    for one in together:
        assert_same_conversation(alone, one)


def test_a_prompt_read_in_the_engine_s_steps_is_awaited_once_and_an_abandoned_one_is_read_no_further():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=4, temperature=0.0)
    alone = chat_session(model, settings, "Be brief.", prefill_chunk=8)
    question = "Tell me everything about the sea, the sky and the ships."
    list(alone.chat(question))
    engine = Engine(model)
    going, leaving = (chat_session(model, settings, "Be brief.", prefill_chunk=8) for _ in range(2))
    for one in (going, leaving):
        one.run_in(engine)
    turns = [going.chat(question), leaving.chat(question)]
    waits = [next(turn) for turn in turns]
    assert all(isinstance(wait.request, Reading) and wait.request.tokens > 3 * 8 for wait in waits)
    engine.step()  # both read their first chunk
    turns[1].close()  # its client left mid-read
    read = leaving.cache_stats().seen
    assert read == 8 and not waits[1].request.ended
    said = driven(engine, [turns[0]])[0]
    assert leaving.cache_stats().seen == read  # no step read on behind its back
    awaited = {id(event.request): type(event.request) for event in said if isinstance(event, Waiting)}
    # Its prompt, its reply and its turn's end: each one request, waited on until it ended.
    assert id(waits[0].request) in awaited
    assert sorted(kind.__name__ for kind in awaited.values()) == ["DecodingReply", "Reading", "Reading"]
    assert going.transcript == alone.transcript and engine.steps > 4
