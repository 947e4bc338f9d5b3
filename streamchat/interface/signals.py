"""How streamchat ends on a signal: Ctrl-C (SIGINT), a closed terminal (SIGHUP), a shutdown (SIGTERM).

`install()`, called once by the console script, turns each signal into an exception:
SIGINT into `Interrupted` (a KeyboardInterrupt), SIGHUP and SIGTERM into `Terminated`.
They unwind the stack like any exception, so every `finally` runs (a conversion in
progress is removed, the terminal is restored) and the CLI exits with 128 + the signal
number: 130, 129, 143. A signal that whoever started streamchat ignored (`nohup`, a
background job of a script) stays ignored.

While a reply streams, unwinding would tear it: `termination_deferred` makes SIGHUP and
SIGTERM stop the reply instead, and raises `Terminated` once the turn is closed, so the
session file and a piped transcript end on a whole turn.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from prompt_toolkit.application import get_app_or_none

Handler = Callable[[int, FrameType | None], None]

# The signals that end streamchat, besides SIGINT; SIGHUP does not exist on Windows.
TERMINATING = tuple(
    signum for signum in (getattr(signal, "SIGHUP", None), signal.SIGTERM) if isinstance(signum, signal.Signals)
)

# The terminating signals streamchat handles: those not ignored when it started.
_handled: list[signal.Signals] = []


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, raised by streamchat's own SIGINT handler.

    CPython remembers a bare KeyboardInterrupt raised inside code that exec() compiled
    (dataclasses and namedtuples build their methods that way, and a model's loading
    imports modules lazily) as unhandled, even after it was caught, and then ends the
    process by SIGINT instead of with its exit code. It checks for KeyboardInterrupt
    exactly: a subclass keeps the exit code.
    """


class Terminated(BaseException):
    """SIGHUP or SIGTERM arrived: leave now, with exit code 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def install() -> None:
    """SIGINT raises Interrupted; SIGHUP and SIGTERM raise Terminated, unless they were ignored at start."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, raise_interrupted)
    for signum in TERMINATING:
        if signal.getsignal(signum) is not signal.SIG_IGN and signum not in _handled:
            signal.signal(signum, raise_terminated)
            _handled.append(signum)


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    # At the prompt, an exception raised inside one of prompt_toolkit's event-loop callbacks
    # would be caught by its handler ("Press ENTER to continue..."): end the prompt with it instead.
    app = get_app_or_none()
    if app is not None and app.is_running and not app.is_done:
        app.exit(exception=Terminated(signum))
        return
    raise Terminated(signum)


@contextmanager
def interrupts_handled(handler: Handler) -> Iterator[None]:
    """Within the block, SIGINT calls `handler`; the handler before it is back when the block ends."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def termination_deferred(stop: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGHUP and SIGTERM call `stop()` (end the reply after this token);
    Terminated is raised when the block ends, whether it ends normally or not."""
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        stop()

    previous = {signum: signal.signal(signum, on_signal) for signum in _handled}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            raise Terminated(received[0])  # leaving wins over whatever else ended the turn
