"""Keys typed while streamchat is busy (loading the model, streaming a reply) wait for the next prompt.

A terminal in its usual (canonical) mode echoes such keys into the output and keeps at
most 4095 characters of an unfinished line, silently dropping the rest of a paste. With
canonical mode and echo off, the terminal keeps every key, unechoed, until prompt_toolkit
reads them at the prompt; Ctrl-C still interrupts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def keys_held() -> Iterator[None]:
    """Within the block, keys typed at the terminal are neither echoed nor limited; no-op off a terminal."""
    try:
        import termios
    except ImportError:  # not POSIX
        yield
        return
    try:
        descriptor = sys.stdin.fileno()
        saved = termios.tcgetattr(descriptor)
    except (OSError, ValueError, termios.error):  # not a terminal (termios.error is no OSError)
        yield
        return
    held = list(saved)
    held[3] &= ~(termios.ICANON | termios.ECHO)
    # TCSANOW, not TCSAFLUSH: flushing would discard exactly the keys this is here to keep.
    termios.tcsetattr(descriptor, termios.TCSANOW, held)
    try:
        yield
    finally:
        termios.tcsetattr(descriptor, termios.TCSANOW, saved)
