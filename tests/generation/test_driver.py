"""The driver runs conversations' moves over one engine: each step's text handed on from the step, each
conversation resumed once its request ended, sinks read once for those that begin alike, an abandoned move
finished unheard; what each conversation says and holds is what it says and holds alone."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.conversation.state import ConversationState
from streamchat.engine.engine import Engine
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.engine.work import Request
from streamchat.generation.driver import Driver
from streamchat.generation.events import PromptProgress, PromptSkipped, Replayed, TextDelta, TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.placement.fusion import fuse_projections
from tests.distributed.test_follower import Recorder, Replayer
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer


def chat_session(model, settings: GenerationSettings, system: str, **options) -> ChatSession:
    """A session over `model`, as the tests below chat: a byte-level tokenizer, a 40-token window."""
    chosen = SessionOptions(settings=settings, window=40, system_prompt=system, **options)
    return ChatSession(model, byte_level_tokenizer(), chosen)


def alone(session: ChatSession, move) -> list:
    """The events of one move, run by a driver of its own engine."""
    return list(Driver(Engine(session.model)).run(move))


def text_of(events) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def recorded(task, requests: list):
    """`task`, each request it waits on noted in `requests` as it passes."""
    for item in task:
        if isinstance(item, Request):
            requests.append(item)
        yield item


def driven(driver: Driver, tasks: list) -> list[list]:
    """What each task said, all started together and run round by round until each ended (cleanly)."""
    said: list[list] = [[] for _ in tasks]
    ended: list[list] = [[] for _ in tasks]
    for task, heard, end in zip(tasks, said, ended, strict=True):
        driver.start(task, heard.append, end.append)
    while not all(ended):
        driver.round()
    assert ended == [[None]] * len(tasks)
    assert not driver.busy()
    return said


def assert_same_conversation(alone: ChatSession, shared: ChatSession) -> None:
    """`shared` says and holds what `alone` does: its transcript, its cache's figures, its cache within 1e-5."""
    assert shared.transcript == alone.transcript and shared.cache_stats() == alone.cache_stats()
    theirs = shared.snapshot().tensors.tensors
    for name, tensor in alone.snapshot().tensors.tensors.items():
        torch.testing.assert_close(theirs[name], tensor, rtol=0, atol=1e-5, msg=name)


def test_a_snapshot_after_turns_run_together_is_the_one_never_run_together_and_restores_the_same():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=30, temperature=0.7, seed=5)
    systems, questions = ["Be brief.", "You are a poet who likes long words."], ["Hi there.", "And then?"]
    apart = [chat_session(model, settings, system) for system in systems]
    for one in apart:
        for question in questions:
            alone(one, one.chat(question))
    driver = Driver(Engine(model))
    together = [chat_session(model, settings, system) for system in systems]
    for question in questions:
        driven(driver, [one.chat(question) for one in together])
    engine = driver.engine
    assert engine.rows_fed > engine.steps and engine.runner.members == []
    assert engine.chunk_tokens > 0  # the prompts were read in the engine's steps too
    for one, other in zip(apart, together, strict=True):
        assert_same_conversation(one, other)
        restored = chat_session(model, settings, other.system_prompt)
        alone(restored, restored.restore(other.snapshot()))
        assert text_of(alone(restored, restored.chat("More?"))) == text_of(alone(one, one.chat("More?")))


def test_each_step_s_text_goes_to_the_conversation_that_said_it_and_it_resumes_once_its_request_ended():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=25, temperature=0.7, seed=3)
    systems = ["Be brief.", "You are a poet."]
    apart = [chat_session(model, settings, system) for system in systems]
    driver = Driver(Engine(model))
    together = [chat_session(model, settings, system) for system in systems]
    for question in ["Hi there.", "And then?"]:
        waited: list[list] = [[], []]
        said = driven(
            driver, [recorded(one.chat(question), waits) for one, waits in zip(together, waited, strict=True)]
        )
        for index, one in enumerate(apart):
            # One wait a request, however many steps it took: its prompt read, its reply, its turn's end fed.
            assert [type(request).__name__ for request in waited[index]] == ["Reading", "DecodingReply", "Reading"]
            mine = alone(one, one.chat(question))
            assert text_of(said[index]) == text_of(mine) and len(text_of(mine)) > 5
            assert isinstance(said[index][-1], TurnFinished) and said[index][-1].reply == mine[-1].reply
            assert together[index].transcript == one.transcript
    assert driver.engine.rows_fed > driver.engine.steps  # the replies decoded together


def test_a_move_run_alone_says_nothing_but_its_events_and_heeds_a_stop_before_the_next_token():
    model = copy.deepcopy(tiny_model("llama", vocab_size=700))
    fuse_projections(model)  # the chat's models are fused: the engine's lean pass
    settings = GenerationSettings(max_new_tokens=40, temperature=0.7, seed=9)
    one = chat_session(model, settings, "Hi.")
    driver = Driver(Engine(model))
    for question in ["Hello there.", "And then what happened?"]:
        events = list(driver.run(one.chat(question)))
        assert not any(isinstance(event, Request) for event in events) and isinstance(events[-1], TurnFinished)
    assert driver.engine.steps > 0 and driver.engine.runner.members == []  # one row a step, through its cache

    deltas, finished = 0, None
    for event in driver.run(one.chat("Tell me more, at length.")):
        deltas += isinstance(event, TextDelta)
        if deltas == 3:
            one.stop()  # a Ctrl-C: heeded before the next token is drawn
        finished = event
    assert (finished.stats.stop_reason, deltas) == ("interrupted", 3)


def test_ranks_in_lockstep_each_with_its_own_driver_feed_the_leader_s_tokens():
    model = copy.deepcopy(tiny_model("llama", vocab_size=700))
    fuse_projections(model)
    settings = GenerationSettings(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=4)

    def session(channel, seed: int = 4) -> ChatSession:
        return chat_session(model, replace(settings, seed=seed), "Hi.", channel=channel)

    questions = ["Hello there.", "And then what happened?"]
    apart, leader_channel = session(None), Recorder()
    leader = session(leader_channel)
    for question in questions:
        alone(apart, apart.chat(question))
        alone(leader, leader.chat(question))
    assert leader.transcript == apart.transcript  # the leader draws as a run without ranks does
    follower = session(Replayer(leader_channel.steps), seed=5)  # a follower never draws: its seed is moot
    follower_driver = Driver(Engine(model))
    for question in questions:
        list(follower_driver.run(follower.chat(question)))
    assert follower.transcript == leader.transcript and follower.cache_stats() == leader.cache_stats()
    tokens_told = [step for step in leader_channel.steps if type(step) is int]
    assert follower_driver.engine.steps >= len(tokens_told) > 0  # the follower fed every token told in its engine


def test_conversations_that_begin_alike_read_their_sinks_once_and_go_on_as_each_would_alone():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=20, temperature=0.7, seed=2)
    questions = ["Hi there.", "Tell me more.", "And then?"]
    apart, apart_tokens = [], 0
    for question in questions:  # each alone: its own engine, its own sinks read
        one = chat_session(model, settings, "You are a poet.", shared_sinks=SharedSinks())
        driver = Driver(Engine(model))
        driven(driver, [one.chat(question)])
        apart.append(one)
        apart_tokens += driver.engine.chunk_tokens
    driver, shared = Driver(Engine(model)), SharedSinks()
    together = [chat_session(model, settings, "You are a poet.", shared_sinks=shared) for _ in questions]
    waited: list[list] = [[] for _ in together]
    moves = [
        recorded(one.chat(question), waits) for one, question, waits in zip(together, questions, waited, strict=True)
    ]
    driven(driver, moves)
    sinks = together[0].cache.sinks
    assert shared.copies == 2 and driver.engine.chunk_tokens == apart_tokens - 2 * sinks  # the sinks read once
    assert waited[1][0] is waited[0][0]  # it waited while the first read them
    for one, other in zip(apart, together, strict=True):
        assert_same_conversation(one, other)


def test_sinks_a_conversation_abandoned_reading_are_read_by_the_one_that_waited_for_them():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=12, temperature=0.0)
    apart = chat_session(model, settings, "Be brief.")
    alone(apart, apart.chat("Why?"))
    driver, shared = Driver(Engine(model)), SharedSinks()
    first, second = (chat_session(model, settings, "Be brief.", shared_sinks=shared) for _ in range(2))
    left = driver.run(first.chat("Tell me a long story. " * 12))  # longer than the cache: it says so first
    assert isinstance(next(left), PromptSkipped)  # said once it waits on its sinks' reading, before the step
    said, ended = [], []
    driver.start(second.chat("Why?"), said.append, ended.append)
    driver.move_tasks()  # the same sinks: it waits for the first's reading of them
    left.close()  # its consumer went away before the step
    while not ended:
        driver.round()
    assert ended == [None] and shared.copies == 0 and first.cache_stats().seen == 0
    assert second.transcript == apart.transcript and text_of(said)


def test_replays_that_begin_alike_read_their_sinks_once_and_say_how_many_they_copied():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=8, temperature=0.0)
    history = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi! How are you?"}]
    state = ConversationState(history, "Be brief.", settings)
    apart = chat_session(model, settings, "Be brief.", shared_sinks=SharedSinks())
    alone(apart, apart.restore(state))
    driver, shared = Driver(Engine(model)), SharedSinks()
    together = [chat_session(model, settings, "Be brief.", shared_sinks=shared) for _ in range(2)]
    said = driven(driver, [one.restore(state) for one in together])
    replayed = [next(event for event in events if isinstance(event, Replayed)) for events in said]
    sinks = apart.cache.sinks
    assert shared.copies == 1 and [event.copied for event in replayed] == [0, sinks]
    assert replayed[0].tokens == replayed[1].tokens == apart.cache_stats().seen
    for one in together:
        assert_same_conversation(apart, one)


def test_a_prompt_abandoned_mid_read_is_read_no_further_and_the_others_go_on():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=4, temperature=0.0)
    apart = chat_session(model, settings, "Be brief.", prefill_chunk=8)
    question = "Tell me everything about the sea, the sky and the ships."
    alone(apart, apart.chat(question))
    driver = Driver(Engine(model))
    going, leaving = (chat_session(model, settings, "Be brief.", prefill_chunk=8) for _ in range(2))
    said, ended, waited = [], [], []
    driver.start(recorded(going.chat(question), waited), said.append, ended.append)
    left = driver.run(leaving.chat(question))
    assert isinstance(next(left), PromptProgress)  # one step: both read their first chunk
    assert leaving.cache_stats().seen == going.cache_stats().seen == 8
    left.close()  # its consumer went away mid-read
    while not ended:
        driver.round()
    assert leaving.cache_stats().seen == 8  # no step read on behind its back
    assert ended == [None] and going.transcript == apart.transcript and driver.engine.steps > 4
    # Its prompt, its reply and its turn's end: each one request, waited on until it ended.
    assert [type(request).__name__ for request in waited] == ["Reading", "DecodingReply", "Reading"]
    assert text_of(said) == apart.transcript[-1]["content"]


def test_a_move_torn_off_mid_round_leaves_nothing_behind_and_the_conversation_recovers():
    model = tiny_model("llama", vocab_size=700)
    settings = GenerationSettings(max_new_tokens=12, temperature=0.0)
    apart, one = chat_session(model, settings, "Be brief."), chat_session(model, settings, "Be brief.")
    driver = Driver(Engine(model))
    step, steps = driver.engine.step, []

    def interrupted_at_the_fifth():
        steps.append(len(steps))
        if len(steps) == 5:
            raise KeyboardInterrupt  # a second Ctrl-C, in the middle of the reply
        return step()

    driver.engine.step = interrupted_at_the_fifth
    with pytest.raises(KeyboardInterrupt):
        list(driver.run(one.chat("Hello.")))
    assert not driver.engine.has_work() and not driver.busy()
    driver.engine.step = step
    list(driver.run(one.recover()))  # the half-done turn dropped, the cache rebuilt
    assert one.transcript == [] and one.cache_stats().seen == 0
    assert text_of(driver.run(one.chat("Hello."))) == text_of(alone(apart, apart.chat("Hello.")))
