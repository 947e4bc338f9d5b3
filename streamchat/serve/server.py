"""The server process: bind, load the model once, serve through uvicorn until Ctrl-C or SIGTERM, save.

On a signal, every reply in flight stops within a step and is journaled, uvicorn lets the
streams end, then every live conversation's state is written beside its journal.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from streamchat.cache.quantized_kv import kv_format_of, model_token_bytes
from streamchat.engine.engine import Engine
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.errors import ConfigError
from streamchat.generation.driver import Driver
from streamchat.interface.config import RunConfig, load_options
from streamchat.interface.reporting import notify, stderr
from streamchat.interface.safe_text import safe_text
from streamchat.serve.connections import server_config
from streamchat.serve.http import HttpOptions, create_app
from streamchat.serve.pool import ConversationPool, Served
from streamchat.serve.worker import Worker
from streamchat.sessions.building import session_for
from streamchat.sessions.keeping import data_dir, state_key

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM


@dataclass(frozen=True)
class WaitingLine:
    """The line requests wait in for a live conversation: how many may, and for how long (None: no limit)."""

    requests: int
    seconds: float | None


def run_server(
    config: RunConfig,
    host: str,
    port: int,
    max_conversations: int,
    waiting: WaitingLine,
    options: HttpOptions,
    max_tokens_limit: int | None = None,
) -> int:
    """Bind, load, serve until a signal; the exit code. No reply is longer than `max_tokens_limit` tokens
    (None: the window)."""
    from streamchat.loading import load_model

    listener = _bind(host, port)  # first: a port in use is said at once, not after the model loads

    def prepare() -> ConversationPool:
        """On the worker's thread, the only one that runs torch (serve/worker.py says why)."""
        notify(f"loading {config.model} ...")
        loaded = load_model(load_options(config), notify=notify)
        shared_sinks = SharedSinks()
        served = Served(
            name=loaded.source.name,
            new_session=lambda: session_for(config, loaded, shared_sinks=shared_sinks, regenerates=False),
            key=state_key(config, loaded),
            sessions=data_dir() / "sessions",
            cache_layout={"keep": config.keep, "window": config.window},
            driver=Driver(Engine(loaded.model)),
            shared_sinks=shared_sinks,
            reply_tokens_limit=max_tokens_limit or config.window,
            meta=cache_meta(loaded.model, config.window),
        )
        pool = ConversationPool(served, max_conversations)
        pool.start()
        return pool

    worker = Worker(max_conversations + waiting.requests, waiting.seconds)
    try:
        pool = worker.start(prepare)
        server = StoppingServer(server_config(create_app(worker, pool, options)), worker)
        shown = f"[{host}]" if ":" in host else host
        stderr.print(safe_text(f"serving {pool.served.name} at http://{shown}:{port}/v1 (Ctrl-C stops)"))
        server.run(sockets=[listener])
    finally:
        worker.close()
        listener.close()
    stderr.print(safe_text(f"stopped; every conversation is saved in {pool.served.sessions}"))
    return TERMINATED_EXIT_CODE if server.received == signal.SIGTERM else 0


def cache_meta(model: PreTrainedModel, window: int) -> dict[str, str | int]:
    """What /v1/models says of the served model's caches: the KV format settled, the window, a token's bytes."""
    kv_format = kv_format_of(model)
    return {
        "kv_cache": kv_format,
        "window": window,
        "kv_token_bytes": model_token_bytes(model, kv_format),
    }


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    listener.listen(128)
    return listener


class StoppingServer(uvicorn.Server):
    """uvicorn's server, whose Ctrl-C and SIGTERM also stop every reply in flight, and are not raised again after."""

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker
        self.received: int | None = None

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, self.handle_exit) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.received = self.received or sig
        self.worker.stop_all()
        super().handle_exit(sig, frame)
