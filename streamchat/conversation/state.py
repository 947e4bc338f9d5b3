"""A conversation as a value: what it says, how it is set, and, between turns, its exact tensors.

    state = session.snapshot()        # ConversationState; state.tensors is None mid-turn
    other.restore(state)              # the same conversation, exactly (or replayed when no tensors)

The text half (messages, system prompt, settings) is what a journal or session file
holds; the tensor half (streamchat.conversation.tensors names them) is what a cache
state file holds. Plain, typed data: storage writes its settings as text and reads them
back without knowing the session, and importing it costs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamchat import defaults
from streamchat.conversation.message import Message
from streamchat.generation.settings import GenerationSettings

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorState:
    """A conversation's tensors between two turns, on the CPU, ready for safetensors."""

    tensors: dict[str, torch.Tensor]
    seed: int  # the seed the sampler was drawing with (the setting may say "random")


@dataclass(frozen=True)
class RecalledNote:
    """What recall brought back with a user message: the note as the chat template reads it before the message,
    and the transcript messages its passages came from (streamchat.conversation.recall)."""

    messages: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class ConversationState:
    """Everything a conversation is. `tensors` is None when it was not taken (or the cache was mid-turn)."""

    messages: list[Message]  # prompt turns (user, tool results) and replies, alternating
    system_prompt: str | None
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    eviction: str = defaults.EVICTION_POLICY  # what the cache evicts, a token or a whole turn at a time
    tensors: TensorState | None = None
    # The notes recall read before user messages, by the message's index: part of what the cache read.
    recalled: dict[int, RecalledNote] = field(default_factory=dict)
    # The tools its first turn describes (OpenAI's function specs), fixed when it starts; None: none.
    tools: list[dict[str, Any]] | None = None

    @property
    def answered(self) -> list[Message]:
        """The messages less a last one still waiting for its reply."""
        return self.messages[: len(self.messages) // 2 * 2]

    @property
    def answered_recalled(self) -> dict[int, RecalledNote]:
        """The notes of the answered messages."""
        return {index: note for index, note in self.recalled.items() if index < len(self.answered)}
