"""Whole conversations with compiled decode steps: the same transcript as eager ones, /regen included.

On the CPU with the aot_eager backend (the same kernels as eager, so the same bits);
on a GPU (the cuda tier) with inductor and CUDA graphs, in float32 where fused kernels
round within what a greedy argmax tolerates.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

from streamchat.conversation.driven import DrivenSession
from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.engine.engine import Engine
from streamchat.generation.driver import Driver
from streamchat.generation.events import Compiled, Compiling, Evicted, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer

VOCAB = 700
QUESTIONS = [f"Question {number}: what comes after {number}?" for number in range(20)]


def conversation(model, backend: str | None) -> tuple[list[str], list[object]]:
    """20 turns through 4 + 48 slots, with a /regen every fifth turn: the replies, and the events."""
    settings = GenerationSettings(max_new_tokens=12, temperature=0.0)
    options = SessionOptions(keep=4, window=48, settings=settings)
    session = DrivenSession(
        ChatSession(model, byte_level_tokenizer(), options), Driver(Engine(model, compile_backend=backend))
    )
    replies, events = [], []
    for turn, question in enumerate(QUESTIONS):
        turn_events = list(session.chat(question))
        if turn % 5 == 4:
            turn_events = list(session.regenerate())
        events += turn_events
        replies.append(next(e for e in turn_events if isinstance(e, TurnFinished)).reply)
    return replies, events


def test_a_compiled_conversation_with_regenerations_matches_the_eager_one():
    model = tiny_model("llama", vocab_size=VOCAB)
    eager, eager_events = conversation(model, None)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled, events = conversation(model, "aot_eager")
    assert compiled == eager
    assert sum(isinstance(event, Evicted) for event in eager_events) > 20
    # The first compiled step says so, once: it is what makes the first reply slow.
    assert [type(event) for event in events if isinstance(event, (Compiling, Compiled))] == [Compiling, Compiled]
    assert not any(isinstance(event, (Compiling, Compiled)) for event in eager_events)


@pytest.mark.cuda
def test_on_cuda_a_conversation_with_cuda_graphs_matches_the_eager_one():
    model = copy.deepcopy(tiny_model("llama", vocab_size=VOCAB)).to("cuda")
    eager, _ = conversation(model, None)
    torch._dynamo.reset()
    compiled, _ = conversation(model, "inductor")
    assert compiled == eager
