"""A real `streamchat serve` in-process: uvicorn on a free 127.0.0.1 port, over tiny models in memory.

`start_server(...)` builds the server `run_server` builds (pool, worker, Starlette app) around
a model given in memory, runs uvicorn in a thread, waits for /health, and stops it all (the
worker parks every live conversation) when the test ends, or at `server.stop()`. Clients talk to
127.0.0.1 only (openai's, anthropic's and an httpx client), ignoring any proxy in the environment.
"""

from __future__ import annotations

import copy
import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx2 as httpx
import openai
import pytest
import torch
import uvicorn

from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.engine.engine import Engine
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.generation.driver import Driver
from streamchat.generation.settings import GenerationSettings
from streamchat.serve.apis.request import Limits
from streamchat.serve.connections import server_config
from streamchat.serve.http import HttpOptions, create_app
from streamchat.serve.pool import ConversationPool, Served
from streamchat.serve.worker import Worker
from streamchat.storage.cache_file import StateKey
from tests.support.model_dirs import VOCAB, scripted_model_and_tokenizer
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer
from tests.support.waiting import HANG_GUARD_SECONDS, wait_until

SCRIPT = ("Sure", ":", " the", " answer", " is", " 42", ".")
REPLY = "Sure: the answer is 42."
KEY = StateKey("tiny", "weights", "float32", "cpu", "none", "4", 64)
SETTINGS = GenerationSettings(max_new_tokens=8, temperature=0.0, seed=7)
HELLO_BODY = {"messages": [{"role": "user", "content": "Hello!"}]}


@dataclass
class RunningServer:
    url: str
    pool: ConversationPool
    worker: Worker
    sessions: Path
    client: openai.OpenAI
    http: httpx.Client
    anthropic: anthropic.Anthropic
    stop: Callable[[], None]  # the server stopped, its conversations parked (again at the test's end: nothing)

    def post(self, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        return self.http.post(f"{self.url}/v1/chat/completions", json=body, headers=headers)


@pytest.fixture(scope="session")
def scripted() -> tuple[Any, Any]:
    return scripted_model_and_tokenizer(SCRIPT)


@pytest.fixture(scope="session")
def endless() -> tuple[Any, Any]:
    """A random llama whose replies never end by themselves, and stream text at every token.

    Its output rows are zeroed for the special tokens and for every token that is not whole
    ASCII text by itself: among hundreds of random logits, a logit of 0 is never the largest, so
    replies run to the length limit and each token is a text delta (none is held back waiting
    for the rest of a character).
    """
    tokenizer = byte_level_tokenizer()
    model = copy.deepcopy(tiny_model("llama", vocab_size=VOCAB))
    special = set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    silent = [
        token
        for token in range(VOCAB)
        if token in special or not (text := tokenizer.decode([token])) or not text.isascii() or not text.isprintable()
    ]
    with torch.no_grad():
        model.get_output_embeddings().weight[silent] = 0
    return model, tokenizer


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    stops: list[Callable[[], None]] = []

    def start(
        model_and_tokenizer: tuple[Any, Any],
        *,
        window: int = 64,
        keep: Any = 4,
        system: str | None = None,
        max_conversations: int = 4,
        max_waiting: int = 8,
        max_wait_seconds: float | None = None,
        api_key: str | None = None,
        limits: Limits | None = None,
        sessions: Path | None = None,
        cors: tuple[str, ...] = (),
        shares_sinks: bool = True,
        reply_tokens_limit: int | None = None,
        body_seconds: float | None = None,
    ) -> RunningServer:
        model, tokenizer = model_and_tokenizer
        sessions = sessions or tmp_path / f"sessions-{len(stops)}"
        shared_sinks = SharedSinks()
        session_options = SessionOptions(
            keep=keep,
            window=window,
            settings=SETTINGS,
            system_prompt=system,
            shared_sinks=shared_sinks if shares_sinks else None,
            regenerates=False,  # as the server's (sessions.building.session_for)
        )
        served = Served(
            name="tiny",
            new_session=lambda: ChatSession(model, tokenizer, session_options),
            key=KEY,
            sessions=sessions,
            cache_layout={"keep": keep, "window": window},
            driver=Driver(Engine(model)),
            shared_sinks=shared_sinks,
            reply_tokens_limit=reply_tokens_limit,
        )

        def prepare() -> ConversationPool:
            pool = ConversationPool(served, max_conversations)
            pool.start()
            return pool

        worker = Worker(max_conversations + max_waiting, max_wait_seconds)
        pool = worker.start(prepare)
        options = HttpOptions(api_key=api_key, cors=cors, limits=limits or Limits())
        if body_seconds is not None:
            options = dataclasses.replace(options, body_seconds=body_seconds)
        app = create_app(worker, pool, options)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        server = uvicorn.Server(server_config(app))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(trust_env=False, timeout=HANG_GUARD_SECONDS)

        def healthy() -> bool:
            try:
                return http.get(f"{url}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, f"{url}/health to answer 200")
        client = openai.OpenAI(
            base_url=f"{url}/v1",
            api_key=api_key or "none",
            max_retries=0,
            http_client=httpx.Client(trust_env=False, timeout=HANG_GUARD_SECONDS),
        )

        claude = anthropic.Anthropic(
            base_url=url,
            api_key=api_key or "none",
            max_retries=0,
            http_client=httpx.Client(trust_env=False, timeout=HANG_GUARD_SECONDS),
        )

        def stop() -> None:
            if server.should_exit:
                return
            server.should_exit = True
            worker.stop_all()
            thread.join(HANG_GUARD_SECONDS)
            worker.close()
            listener.close()
            http.close()

        stops.append(stop)
        return RunningServer(url, pool, worker, sessions, client, http, claude, stop)

    yield start
    for stop in reversed(stops):
        stop()


def raw_exchange(server: RunningServer, data: bytes) -> bytes:
    """Send `data` on a new connection, then read until the server closes it (the guard only ends a hang)."""
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=HANG_GUARD_SECONDS) as sock:
        sock.sendall(data)
        received = b""
        while piece := sock.recv(65536):
            received += piece
        return received


def raw_request(body: bytes, *headers: str) -> bytes:
    """A chat completion request as bytes, with `headers` (Content-Length added unless one is given)."""
    head = ["POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1", "Connection: close", *headers]
    if not any(header.lower().startswith(("content-length", "transfer-encoding")) for header in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def wait_idle(server: RunningServer) -> None:
    """Until no conversation is being answered (a stopped reply journals itself a step later)."""

    def idle() -> bool:
        return not any(conversation.busy for conversation in list(server.pool.conversations.values()))

    wait_until(idle, "every conversation to be idle")
