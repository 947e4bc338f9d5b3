"""Child processes that receive signals as a terminal's foreground job does.

A shell starts the background jobs of a script with SIGINT ignored, and `nohup` ignores
SIGHUP; a child inherits an ignored signal through exec. A test suite started that way
would see a Ctrl-C or a hang-up it sends swallowed by the command under test, which
(rightly) keeps what it inherited. `in_foreground` restores the default dispositions
before the command starts, as for a command typed at a terminal.
"""

from __future__ import annotations

import sys

_RESET_SIGNALS = (
    "import os, signal, sys\n"
    "for name in ('SIGINT', 'SIGHUP', 'SIGTERM'):\n"
    "    if hasattr(signal, name):\n"
    "        signal.signal(getattr(signal, name), signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def in_foreground(command: list[str]) -> list[str]:
    """`command` (its first item a path to an executable), started with default signal dispositions."""
    return [sys.executable, "-c", _RESET_SIGNALS, *command]
