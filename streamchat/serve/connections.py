"""The HTTP connections' limits: how long a client may take to send its headers, how long one may idle.

uvicorn closes an idle keep-alive connection, and h11 bounds how large headers may grow, but
nothing bounds how long a client may take to send them: a connection that sends half a
header line and waits would be held open for ever. HeaderDeadlineProtocol closes it once
`SERVE_HEADER_SECONDS` pass with a request's headers incomplete. (The body's deadline is the
route's, which answers 408: streamchat.serve.http.) A request h11 finds malformed after its
headers is answered 400 by uvicorn, and its route told that the client went away.

    uvicorn.Server(server_config(app))
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from streamchat import defaults

# How long uvicorn waits for streams to end once the replies were told to stop, in seconds. They end within a
# step; on a loaded CPU a batched step of a few replies can take seconds, and a stream cut off by this deadline
# ends without its finish_reason (and uvicorn logs a traceback), so it is far past a step.
GRACEFUL_SHUTDOWN_SECONDS = 30


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not all in within the deadline."""

    header_seconds: float = defaults.SERVE_HEADER_SECONDS
    _header_deadline: asyncio.TimerHandle | None = None  # armed while a request's headers are awaited

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # the next request on this connection has the same time for its headers

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(msg)
        # h11 found the request malformed past its headers (a broken chunked body), after the route began:
        # the route hears that its client went away, and what it sends goes nowhere (not into a traceback).
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_seconds, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        deadline = self._header_deadline
        if deadline is not None:
            deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        waiting_for_headers = self.cycle is None or self.cycle.response_complete
        # Bytes of a next request arrived (uvicorn's idle timer is off) but not yet its whole header.
        if waiting_for_headers and not self.transport.is_closing():
            self.transport.close()


def server_config(app: Any, **settings: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` with streamchat's connection limits; `settings` add to it."""
    return uvicorn.Config(
        app,
        http=HeaderDeadlineProtocol,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=defaults.SERVE_KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        **settings,
    )
