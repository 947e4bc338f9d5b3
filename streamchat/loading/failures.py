"""Turning what huggingface_hub, transformers and torch raise into one-line domain errors."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager

from streamchat.errors import (
    ModelAccessError,
    ModelNotFoundError,
    UnsupportedModelError,
    out_of_memory_as,
)


@contextmanager
def model_errors(name: str) -> Iterator[None]:
    """Report failures while reading, converting or loading the model `name` as domain errors."""
    out_of_memory = f"out of memory while loading {name}; try --dtype bfloat16 or float16, or a smaller model"
    try:
        with out_of_memory_as(out_of_memory):
            yield
    except ValueError as error:
        # Unknown model types, GGUF files transformers cannot convert, custom code not trusted.
        hint = " Pass --trust-remote-code if you trust its code." if "trust_remote_code" in str(error) else ""
        raise UnsupportedModelError(f"{_about(name, error)}{hint}") from error
    except OSError as error:
        # transformers reports missing or unreadable model files as OSError.
        raise ModelNotFoundError(f"{name} is not a usable model: {_first_line(error)}") from error
    except pickle.UnpicklingError as error:
        # torch.load with weights_only, on a garbled .bin or one holding more than tensors.
        raise ModelAccessError(
            f"{name}: its pickled weights (pytorch_model*.bin) cannot be read: they are corrupt, or hold "
            "objects other than tensors, which streamchat does not unpickle; download the model again, "
            "or use a copy with safetensors weights"
        ) from error


def _about(name: str, error: BaseException) -> str:
    """The error's first line, prefixed with the model's name unless it already says it."""
    message = _first_line(error)
    return message if name in message else f"{name}: {message}"


def _first_line(error: BaseException) -> str:
    """A library's error message cut to its first line: ours are one line each."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
