"""A session as the tests drive it: its moves run by a driver of its own engine, everything else read from it."""

from __future__ import annotations

from typing import Any

from streamchat.conversation.driven import DrivenSession, driven_session
from streamchat.conversation.session_options import SessionOptions


class SessionUnderTest(DrivenSession):
    """DrivenSession, whose session's own attributes (its token loop, chat format, transcript, ...) read and set
    through it, as the tests of a session look inside it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["session"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("session", "driver") or "session" not in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.session, name, value)


def session_under_test(model: Any, tokenizer: Any, options: SessionOptions | None = None) -> SessionUnderTest:
    """A new session over `model` with a driver of its own engine, as a test drives it."""
    driven = driven_session(model, tokenizer, options)
    return SessionUnderTest(driven.session, driven.driver)
