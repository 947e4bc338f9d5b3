"""The state file a session wrote while a mirror beside the cache kept its tokens (before the cache's record).

tests/conversation/test_tensors.py restores it with the code of today and checks that it
resumes as that code resumed it: the same view of the cache, the same next replies (the
JSON beside it holds both, from a session of that time restored from this very file).
Written once, by the code of that time (commit a14b996), with:

    PYTHONPATH=<a checkout of a14b996> python tests/conversation/mirror_era_state.py

The session overflows its window many times, reads a prompt longer than the cache (its
middle skipped) and ends with a message partly forgotten, so that every part of the saved
record (mirror.sinks, mirror.window, mirror.forgotten) matters.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.conversation.state import ConversationState, TensorState
from streamchat.generation.events import Resumed, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer

DATA = Path(__file__).resolve().parent / "data"
STATE = DATA / "mirror_era_state.safetensors"
EXPECTED = DATA / "mirror_era_state.json"
VOCAB = 700
WINDOW = 48
SETTINGS = GenerationSettings(max_new_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=11)
BEFORE = ["Hello there!", "Tell me about the sea. " * 12, "What is the capital of France?"]
AFTER = ["Write a short poem about the stars.", "Thank you, goodbye."]


def make_session() -> ChatSession:
    options = SessionOptions(window=WINDOW, settings=SETTINGS, system_prompt="You are terse.")
    return session_under_test(tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), options)


def play(session: ChatSession, turns: list[str]) -> None:
    for text in turns:
        [event for event in session.chat(text) if isinstance(event, TurnFinished)]


def resumed(expected: dict) -> ChatSession:
    """A new session restored from the state file, as `expected` (the JSON) describes it."""
    session = make_session()
    tensors = TensorState(load_file(STATE), expected["seed"])
    # Greedy from here: the replies after it hang on the stored keys, not on a last bit of a sampled draw
    # that another CPU's float arithmetic might round the other way.
    greedy = dataclasses.replace(SETTINGS, temperature=0.0)
    state = ConversationState(expected["messages"], "You are terse.", greedy, tensors=tensors)
    events = list(session.restore(state))
    assert isinstance(events[-1], Resumed), events[-1]
    return session


def main() -> None:
    session = make_session()
    play(session, BEFORE)
    state = session.snapshot()
    saved_view = dataclasses.asdict(session.cache_view())
    DATA.mkdir(exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.tensors.tensors.items()}, STATE)
    # What that code made of its own file: restored, then two more turns.
    session = resumed({"seed": state.tensors.seed, "messages": state.messages})
    play(session, AFTER)
    expected = {
        "seed": state.tensors.seed,
        "messages": state.messages,
        "view": saved_view,
        "transcript_after": session.transcript,
        "view_after": dataclasses.asdict(session.cache_view()),
    }
    EXPECTED.write_text(json.dumps(expected, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
