"""A message of a conversation, as the chat template, the journal and the OpenAI API all write it:
{"role": "user", "content": "Hello!"}, the role "system", "user" or "assistant"."""

from __future__ import annotations

Message = dict[str, str]
