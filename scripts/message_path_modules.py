"""The modules a message crosses from input to output: a REPL message, a served request.

    python scripts/message_path_modules.py [--model NAME] [--api chat|messages|responses]

A module counts when one of its functions is on the call stack (of any thread) at a moment
the message's data meets the kernels (streamchat.placement.native), the cache
(streamchat.cache.sink_cache), the screen (streamchat.interface.display), the journal
(streamchat.storage.journal) or JSON text (a request's body, the streamed chunks, the
history's digest). Traced with sys.setprofile over the second message of a conversation (the
first warms every path up): the REPL's through ChatApp with a real ChatDisplay and Journal,
its lines scripted; a served one through the server's app in this process (uvicorn on
127.0.0.1, a free port), its client resending the history with one new message, streamed.
The forward pass's modules (streamchat.placement: the model's own code) are counted apart.
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from rich.console import Console

from streamchat.app.chat import ChatApp
from streamchat.conversation.driven import driven_session
from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.engine.engine import Engine
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.generation.driver import Driver
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.display import ChatDisplay
from streamchat.serve.connections import server_config
from streamchat.serve.http import HttpOptions, create_app
from streamchat.serve.pool import ConversationPool, Served
from streamchat.serve.worker import Worker
from streamchat.storage.cache_file import StateKey
from streamchat.storage.journal import Journal

MEETINGS = (
    "streamchat.placement.native",
    "streamchat.cache.sink_cache",
    "streamchat.interface.display",
    "streamchat.storage.journal",
)
FORWARD_PASS = "placement."  # the forward pass's modules, as the trace names them (streamchat. left off)
SETTINGS = GenerationSettings(max_new_tokens=8, temperature=0.0, seed=1)
WINDOW = 256
FIRST, SECOND = "Hello there.", "And again?"
START_CHECKS = 6000  # a hundredth of a second each: the server starts within a minute or the count fails


class PathTrace:
    """The streamchat modules on the stack whenever the traced data meets a boundary, while `recording`."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.recording = False

    def profile(self, frame: FrameType, event: str, _: object) -> None:
        if event != "call" or not self.recording:
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith(MEETINGS) or module == "json":
            caller: FrameType | None = frame
            while caller is not None:
                if (name := caller.f_globals.get("__name__", "")).startswith("streamchat."):
                    self.modules.add(name.removeprefix("streamchat."))
                caller = caller.f_back

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Every call of this thread, and of the threads started meanwhile, seen (recorded only when asked)."""
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def repl_path(model: Any, tokenizer: Any) -> set[str]:
    """The modules the REPL's second message crosses, from the line read to the screen and the journal."""
    trace = PathTrace()
    conversation = driven_session(model, tokenizer, SessionOptions(window=WINDOW, settings=SETTINGS))
    display = ChatDisplay(Console(file=io.StringIO(), width=100, color_system=None))
    lines = [FIRST, SECOND]

    class Prompter:
        def read(self) -> str | None:
            trace.recording = len(lines) == 1  # from the second line handed over to the next read
            return lines.pop(0) if lines else None

    with tempfile.TemporaryDirectory() as directory, trace.installed():
        journal = Journal(Path(directory), "traced", {"keep": "system", "window": WINDOW}, display.error)
        key = StateKey("traced", "weights", "float32", "cpu", "none", "system", WINDOW)
        ChatApp(conversation, display, Prompter(), "traced", journal, key).run(None)
    return trace.modules


def served_path(model: Any, tokenizer: Any, api: str = "chat") -> set[str]:
    """The modules a served request crosses, continuing a conversation: from its body to its streamed reply."""
    trace = PathTrace()
    shared = SharedSinks()
    options = SessionOptions(window=WINDOW, settings=SETTINGS, shared_sinks=shared, regenerates=False)
    with tempfile.TemporaryDirectory() as directory, trace.installed():
        served = Served(
            name="traced",
            new_session=lambda: ChatSession(model, tokenizer, options),
            key=None,
            sessions=Path(directory),
            cache_layout={"keep": "system", "window": WINDOW},
            driver=Driver(Engine(model)),
            shared_sinks=shared,
        )
        worker = Worker(4)

        def prepare() -> ConversationPool:
            pool = ConversationPool(served, 2)
            pool.start()
            return pool

        pool = worker.start(prepare)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        server = uvicorn.Server(server_config(create_app(worker, pool, HttpOptions())))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
        thread.start()
        try:
            post = _poster(f"http://127.0.0.1:{listener.getsockname()[1]}", server)
            first = post(*_request(api, FIRST, None), False)
            trace.recording = True
            post(*_request(api, SECOND, _said(api, first)), True)
        finally:
            trace.recording = False
            server.should_exit = True
            worker.stop_all()
            thread.join(60)
            worker.close()
            listener.close()
    return trace.modules


def _poster(url: str, server: uvicorn.Server) -> Callable[[str, dict[str, Any], bool], Any]:
    """POST a body to the server at `url` (once it started), on loopback only: the reply's JSON, or its text
    when streamed."""
    for _ in range(START_CHECKS):
        if server.started:
            break
        threading.Event().wait(0.01)
    else:
        raise RuntimeError(f"the server at {url} did not start within {START_CHECKS / 100:g} s")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def post(path: str, body: dict[str, Any], stream: bool) -> Any:
        data = json.dumps({**body, "stream": stream}).encode()
        request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
        with opener.open(request, timeout=120) as response:
            text = response.read().decode()
        return text if stream else json.loads(text)

    return post


def _request(api: str, text: str, said: str | None) -> tuple[str, dict[str, Any]]:
    """The path and body of a request saying `text` after the first exchange (`said`: its reply, or its id)."""
    if api == "responses":
        return "/v1/responses", {"input": text, **({} if said is None else {"previous_response_id": said})}
    history = [] if said is None else [{"role": "user", "content": FIRST}, {"role": "assistant", "content": said}]
    messages = [*history, {"role": "user", "content": text}]
    if api == "messages":
        return "/v1/messages", {"model": "traced", "max_tokens": 8, "messages": messages}
    return "/v1/chat/completions", {"messages": messages}


def _said(api: str, reply: dict[str, Any]) -> str:
    """What the next request refers to of `reply`: its text (resent with the history), or its id."""
    if api == "responses":
        return str(reply["id"])
    if api == "messages":
        return str(reply["content"][0]["text"])
    return str(reply["choices"][0]["message"]["content"])


def outside_forward_pass(modules: set[str]) -> set[str]:
    """`modules` but the forward pass's: the model's own code, counted apart."""
    return {name for name in modules if not name.startswith(FORWARD_PASS)}


def report(title: str, modules: set[str]) -> list[str]:
    """Lines: how many modules, how many of them the forward pass's, then each."""
    rest = sorted(outside_forward_pass(modules))
    forward = sorted(modules - set(rest))
    head = f"{title}: {len(modules)} modules, {len(rest)} outside the forward pass and {len(forward)} in it"
    return [head, "  " + " ".join(rest), "  forward pass: " + " ".join(forward)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as `streamchat run --model` (default: the built-in one)")
    parser.add_argument("--api", default="chat", choices=["chat", "messages", "responses"])
    arguments = parser.parse_args()
    from streamchat.interface.config import load_options, load_run_config
    from streamchat.loading import load_model

    loaded = load_model(load_options(load_run_config({"model": arguments.model})))
    for line in report("REPL message", repl_path(loaded.model, loaded.tokenizer)):
        print(line)
    for line in report(f"served request ({arguments.api})", served_path(loaded.model, loaded.tokenizer, arguments.api)):
        print(line)


if __name__ == "__main__":
    main()
