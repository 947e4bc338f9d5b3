"""A Responses API response's id: where it stands in its conversation, so `previous_response_id` needs no state.

    response_id("20250101-120000-3fa2c1", 4)              # "resp_20250101-120000-3fa2c1_4"
    system, history = conversation_until(sessions, rid)  # ApiError: 400 malformed, 404 unknown or taken back

An id names the conversation the response was in and how many messages it held once the
response was said. A request naming it goes on from there: its history is the conversation's
journal up to that point, so the history matcher continues the conversation (only the new
message is read) when that response is its last, and starts one from that history (a
replay) when the client branches from an older response. Journals outlive the server, and
so do the ids.
"""

from __future__ import annotations

import re
from pathlib import Path

from streamchat.conversation.message import Message
from streamchat.errors import SessionFileError
from streamchat.serve.apis.request import ApiError
from streamchat.serve.matching import is_session_id
from streamchat.storage.journal import SUFFIX
from streamchat.storage.session_file import read_session

PREFIX = "resp_"
_COUNT = re.compile(r"[1-9][0-9]{0,8}")
PARAM = "previous_response_id"


def response_id(conversation: str, messages: int) -> str:
    """The id of the response that left `conversation` holding `messages` messages (its own the last)."""
    return f"{PREFIX}{conversation}_{messages}"


def conversation_until(sessions: Path, text: str) -> tuple[str | None, list[Message]]:
    """The system prompt of the conversation the response `text` was in, and its messages through that response,
    from its journal in `sessions` (a blocking read)."""
    conversation, messages = _parts(text)
    path = sessions / f"{conversation}{SUFFIX}"
    if not path.is_file():
        raise ApiError(404, f"no response {text!r}: its conversation is not here", param=PARAM, code="not_found")
    try:
        saved = read_session(path)
    except SessionFileError as error:
        raise ApiError(404, f"no response {text!r}: {error}", param=PARAM, code="not_found") from None
    if len(saved.messages) < messages:
        raise ApiError(
            404,
            f"no response {text!r}: its conversation holds {len(saved.messages)} messages "
            "(taken back, or its reply not ended yet)",
            param=PARAM,
            code="not_found",
        )
    return saved.system_prompt, saved.messages[:messages]


def _parts(text: str) -> tuple[str, int]:
    """The conversation and message count `text` names; 400 when it is no id this server writes."""
    conversation, _, count = text.removeprefix(PREFIX).rpartition("_")
    # A response ends an exchange (a user message, then its reply): it leaves an even count, two or more.
    if not (
        text.startswith(PREFIX) and is_session_id(conversation) and _COUNT.fullmatch(count) and int(count) % 2 == 0
    ):
        raise ApiError(400, f"{PARAM} {text!r} is not a response id this server wrote", param=PARAM)
    return conversation, int(count)
