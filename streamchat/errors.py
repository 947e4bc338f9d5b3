"""The domain errors. Only the CLI turns them into one-line messages and exit codes.

This module imports only the standard library, so every layer (the cache included) can
raise these without pulling in UI or loading code. Each message names the bad value and says
what to do about it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class StreamchatError(Exception):
    """Base class: a problem the user can fix, reported in one line without a traceback."""

    exit_code = 1


class ConfigError(StreamchatError):
    """An option, config-file entry or environment variable has a bad value."""

    exit_code = 2


class CacheConfigError(ConfigError):
    """The sink cache was asked for an impossible shape (sizes, step length)."""


class ModelNotFoundError(StreamchatError):
    """The --model value names no alias, local directory, GGUF file or hub repository."""

    exit_code = 3


class ModelAccessError(StreamchatError):
    """The model exists but cannot be fetched or read: offline hub, gated repository, missing token, damaged files."""

    exit_code = 4


class UnsupportedModelError(StreamchatError):
    """The model's architecture cannot use a sink cache, or has not been verified with it."""

    exit_code = 5


class ChatTemplateError(UnsupportedModelError):
    """The model's chat template refuses the conversation, or cannot be fed one turn at a time."""


class OutOfMemoryError(StreamchatError):
    """The model or the cache does not fit on the chosen device."""

    exit_code = 6


class TranscriptError(StreamchatError):
    """A piped transcript or its file cannot be read."""

    exit_code = 7


class SessionFileError(StreamchatError):
    """A saved session cannot be written or loaded."""

    exit_code = 8


class CacheStateError(StreamchatError):
    """The sink cache was driven out of order (an interrupted forward pass, a foreign caller)."""


class CommandError(StreamchatError):
    """A slash command typed at the chat prompt is unknown or misses its argument; the chat goes on."""


# How torch words allocation failures: "CUDA out of memory", "MPS backend out of memory",
# and on CPU "DefaultCPUAllocator: can't allocate memory".
_OUT_OF_MEMORY_WORDING = ("out of memory", "can't allocate memory", "not enough memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether a library's exception means an allocation failed (torch raises RuntimeErrors)."""
    torch = sys.modules.get("torch")  # loaded by whoever allocated; this module imports nothing heavy
    if isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_WORDING)


@contextmanager
def out_of_memory_as(message: str) -> Iterator[None]:
    """Within the block, an allocation failure on any device becomes OutOfMemoryError(message)."""
    try:
        yield
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        raise OutOfMemoryError(message) from error


class RankLostError(StreamchatError):
    """Under tensor parallelism, another rank died, hung or failed: the ranks can no longer run in lockstep."""

    exit_code = 9


class PeerLostError(RankLostError):
    """This rank is fine, but another one died or stopped answering (the other rank's failure is the news)."""
