"""A client of the OpenAI chat API as most are: stateless, it resends the whole history every turn.

Conversations run side by side, one thread each, against a server on a loopback address;
each turn is one streamed request (`stream_options.include_usage`), greedy, with at most
`max_tokens` tokens. Every request has a timeout and a run has a deadline, so a server that
stalls ends the run, it does not hang it. What each request took is a Reply: the time to
its first token, the tokens generated, the prompt tokens the server read (`prompt_tokens -
cached_tokens`, when it reports usage), the X-Streamchat-Cache header, its error.

The standard library's http.client speaks the protocol: the bench needs no HTTP client
package, and nothing here follows proxies from the environment.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from streamchat.conversation.message import Message

SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and briefly."
QUESTIONS_FILE = "chat_questions.txt"
CACHE_HEADER = "X-Streamchat-Cache"
# Conversation c starts this many questions after conversation c - 1, so no two ask the same in turn.
QUESTION_STRIDE = 7
# An error body is read up to this many bytes; its message is cut to one short line.
ERROR_BODY_BYTES = 64 * 1024
ERROR_CHARS = 200


@dataclass(frozen=True)
class Endpoint:
    """A server on this machine."""

    host: str
    port: int


@dataclass(frozen=True)
class Workload:
    """What every conversation says: `turns` user turns, each answered with at most `max_tokens` tokens."""

    conversations: int
    turns: int
    max_tokens: int
    request_timeout: float  # seconds for one request, from sending it to its last byte
    time_limit: float  # seconds for the whole run; turns not sent by then are errors
    system_prompt: str = SYSTEM_PROMPT


@dataclass
class Reply:
    """One request, as the client saw it."""

    text: str = ""
    ttft: float | None = None  # seconds from sending the request to the first text
    seconds: float = 0.0  # from sending the request to its end
    tokens: int = 0  # usage.completion_tokens, else the chunks that carried text
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cache: str | None = None  # what streamchat's cache holds after the turn: "used/capacity, evicted N"
    error: str | None = None

    @property
    def read_tokens(self) -> int | None:
        """Prompt tokens the server processed for this request; None when it reports no usage."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens - (self.cached_tokens or 0)

    @property
    def empty(self) -> bool:
        return self.error is None and not self.text


@dataclass(frozen=True)
class TurnRecord:
    conversation: int  # from 1
    turn: int  # from 1
    reply: Reply


def questions() -> list[str]:
    """The shipped user turns: generic questions, one a line."""
    text = resources.files("streamchat").joinpath("data").joinpath(QUESTIONS_FILE).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def user_turn(pool: Sequence[str], conversation: int, turn: int) -> str:
    """Conversation `conversation`'s message at `turn` (both from 1): the questions cycled from its own offset.

    The first message names its user, so that no two conversations say the same.
    """
    question = pool[((conversation - 1) * QUESTION_STRIDE + turn - 1) % len(pool)]
    return f"Hello, I am user {conversation}. {question}" if turn == 1 else question


@dataclass(frozen=True)
class ListedModel:
    """The first model GET /v1/models lists: what requests name, and its "meta" (streamchat's and llama-server's
    say more of it: streamchat's the KV cache's format, window and a token's bytes)."""

    name: str = "default"
    meta: dict[str, Any] = field(default_factory=dict)


def served_model(endpoint: Endpoint, timeout: float) -> ListedModel:
    """The first model GET /v1/models lists; named "default", with no meta, when it lists none."""
    connection = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
    try:
        connection.request("GET", "/v1/models")
        response = connection.getresponse()
        listed = json.loads(response.read(ERROR_BODY_BYTES)) if response.status == 200 else {}
    except (OSError, http.client.HTTPException, ValueError):
        listed = {}
    finally:
        connection.close()
    data = listed.get("data") if isinstance(listed, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    meta = first.get("meta")
    return ListedModel(str(first.get("id", "default")), meta if isinstance(meta, dict) else {})


def stream_chat(endpoint: Endpoint, body: dict[str, Any], timeout: float) -> Reply:
    """POST one streamed chat completion and read its server-sent events; errors are in the Reply."""
    reply = Reply()
    started = time.perf_counter()
    connection = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
    try:
        payload = json.dumps(body).encode("utf-8")
        connection.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        reply.cache = response.getheader(CACHE_HEADER)
        if response.status != 200:
            reply.error = f"HTTP {response.status}: {_error_message(response.read(ERROR_BODY_BYTES))}"
        else:
            _read_events(response, reply, started, timeout)
    except (OSError, http.client.HTTPException) as error:
        reply.error = _one_line(f"{type(error).__name__}: {error}")
    finally:
        connection.close()
        reply.seconds = time.perf_counter() - started
    return reply


def _read_events(response: http.client.HTTPResponse, reply: Reply, started: float, timeout: float) -> None:
    chunks = 0
    completion_tokens = None
    while raw := response.readline():
        if time.perf_counter() - started > timeout:
            reply.error = f"timed out after {timeout:g} s"
            return
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        try:
            event = json.loads(data)
        except ValueError:
            reply.error = _one_line(f"not JSON: {data}")
            return
        if "error" in event:
            reply.error = _error_message(data.encode("utf-8"))
            return
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                if reply.ttft is None:
                    reply.ttft = time.perf_counter() - started
                reply.text += content
                chunks += 1
        usage = event.get("usage")
        if usage:
            reply.prompt_tokens = usage.get("prompt_tokens")
            completion_tokens = usage.get("completion_tokens")
            reply.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    reply.tokens = completion_tokens if completion_tokens is not None else chunks


def _error_message(body: bytes) -> str:
    """The message of OpenAI's error body ({"error": {"message": ...}}), else the body's text, on one line."""
    text = body.decode("utf-8", errors="replace")
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        text = str(error["message"])
    elif isinstance(error, str):
        text = error
    return _one_line(text)


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= ERROR_CHARS else flat[: ERROR_CHARS - 3] + "..."


def run_conversations(
    endpoint: Endpoint, model: str, workload: Workload, stop: threading.Event
) -> tuple[list[TurnRecord], float]:
    """Every conversation's turns, side by side; the records in (conversation, turn) order and the wall seconds.

    A turn that fails is recorded and dropped from the history (the user asks the next
    question); a turn not sent before the time limit, or after `stop` is set, is recorded
    as an error.
    """
    pool = questions()
    records: list[TurnRecord] = []
    lock = threading.Lock()
    started = time.perf_counter()
    deadline = started + workload.time_limit

    def converse(conversation: int) -> None:
        messages: list[Message] = [{"role": "system", "content": workload.system_prompt}]
        for turn in range(1, workload.turns + 1):
            left = deadline - time.perf_counter()
            if stop.is_set() or left <= 0:
                reply = Reply(error="not sent: the run was stopped or passed its time limit")
            else:
                asked: Message = {"role": "user", "content": user_turn(pool, conversation, turn)}
                body = {
                    "model": model,
                    "messages": [*messages, asked],
                    "max_tokens": workload.max_tokens,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                reply = stream_chat(endpoint, body, min(workload.request_timeout, left))
                if reply.error is None:
                    messages += [asked, {"role": "assistant", "content": reply.text}]
            with lock:
                records.append(TurnRecord(conversation, turn, reply))

    threads = [
        threading.Thread(target=converse, args=(number,), name=f"conversation-{number}", daemon=True)
        for number in range(1, workload.conversations + 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        # Each request ends by its timeout, and no request starts past the deadline.
        thread.join(max(0.0, deadline - time.perf_counter()) + workload.request_timeout + 1)
    seconds = time.perf_counter() - started
    with lock:
        done = sorted(records, key=lambda record: (record.conversation, record.turn))
    return done, seconds
