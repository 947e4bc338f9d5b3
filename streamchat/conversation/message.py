"""A message of a conversation, as the chat template, the journal and the OpenAI API all write it:
{"role": "user", "content": "Hello!"}. A TypedDict, not a class: chat templates read messages as dicts."""

from __future__ import annotations

from typing import Literal, TypedDict

Role = Literal["system", "user", "assistant"]


class Message(TypedDict):
    role: Role
    content: str
