"""The cache state file beside a session file: a conversation's exact cache, to go on without a replay.

    sessions/20250101-120000-3fa2c1.jsonl               the journal (journal.py)
    sessions/20250101-120000-3fa2c1.cache.safetensors   its state, written at exit, on SIGHUP/SIGTERM, on /save

A safetensors file: a conversation's tensors (streamchat.conversation.state), and a
header of strings that says what they are valid for (`StateKey`: the model, the exact weights, dtype, device,
quantization, keep, window, the KV cache's format), which conversation they hold (a digest of its messages,
system prompt and seed, and its message count), the seed drawn with, and the format.

A state is used only when all of it matches this run and the conversation read from
the session file; otherwise `read_state` says why in one line, and the conversation is
replayed. A state from before the conversation's last turn (streamchat killed without
a chance to write it) holds another conversation, so its digest tells it apart whatever
the files' times say. Written durably (streamchat.storage.durable): a kill leaves the
previous state or the new one, never a torn file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

from streamchat import __version__
from streamchat.conversation.message import Message
from streamchat.conversation.state import ConversationState, TensorState
from streamchat.errors import SessionFileError
from streamchat.generation.settings import RANDOM_SEED
from streamchat.storage.durable import write_durably
from streamchat.storage.session_file import SavedSession, settings_text

FORMAT = "streamchat-cache"
VERSION = 1
SUFFIX = ".cache.safetensors"


@dataclass(frozen=True)
class StateKey:
    """What a cache state is valid for: a run uses one only when every field matches."""

    model: str  # the model's path, or its hub id
    weights: str  # a digest of the model's config, its weights' index and the layout loaded (loading.identity)
    dtype: str
    device: str  # the device type: devices round differently and keep their random state differently
    quantization: str  # "none" when the weights are not quantized
    keep: str  # "system" or a number of first tokens
    window: int
    kv_cache: str = "full"  # how the cache stores its window's keys and values (--kv-cache as settled)

    def metadata(self) -> dict[str, str]:
        return {name: str(value) for name, value in asdict(self).items()}


# How a field is named in "its cache state was saved for --window 2000, this run has 256".
_FIELD_WORDS = {
    "model": "model",
    "dtype": "dtype",
    "device": "device",
    "quantization": "quantization",
    "keep": "--keep",
    "window": "--window",
    "kv_cache": "--kv-cache",
}


# What a state saved before a field was recorded holds: the window was full before --kv-cache.
_BEFORE_FIELD = {"kv_cache": "full"}


def state_path(session_path: Path) -> Path:
    """Where the cache state of the session file at `session_path` lives: beside it, under the same name."""
    return session_path.with_suffix(SUFFIX)


def conversation_digest(messages: list[Message], system_prompt: str | None, seed: str) -> str:
    """What the state's conversation is: its messages, system prompt and seed setting (as /set writes it)."""
    text = json.dumps([messages, system_prompt, seed], ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_state(path: Path, state: ConversationState, key: StateKey) -> int:
    """Write the tensors of `state` durably, for its conversation and `key`; the file's size in bytes.

    SessionFileError when it cannot be written (or `state` carries no tensors).
    """
    from safetensors.torch import save_file

    if state.tensors is None:
        raise SessionFileError("no cache state to save: the conversation was not taken between two turns")
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        **key.metadata(),
        "conversation": conversation_digest(state.messages, state.system_prompt, settings_text(state)["seed"]),
        "messages": str(len(state.messages)),
        "seed": str(state.tensors.seed),
        "streamchat": __version__,
        "saved": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tensors = state.tensors.tensors
    try:
        return write_durably(path, lambda temporary: save_file(tensors, temporary, metadata))
    except OSError as error:
        raise SessionFileError(f"cannot save the cache state to {path}: {error.strerror or error}") from error


def read_state(path: Path, key: StateKey, saved: SavedSession) -> TensorState | str:
    """The state at `path` when it fits `key` and the conversation `saved`, else why not (one line)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        return "no cache state was saved beside it (streamchat writes one when it exits, and on /save)"
    try:
        with safe_open(str(path), framework="pt") as opened:
            metadata = opened.metadata() or {}
    except (OSError, SafetensorError) as error:
        return f"its cache state cannot be read ({error})"
    problem = _mismatch(metadata, key, saved)
    if problem is not None:
        return problem
    try:
        return TensorState(load_file(str(path)), int(metadata["seed"]))
    except (OSError, SafetensorError, ValueError, KeyError) as error:
        return f"its cache state cannot be read ({error})"


def saved_key(path: Path) -> dict[str, str]:
    """What the state at `path` was saved for (StateKey's fields, as text); empty when there is no state
    there, or none this streamchat reads."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as opened:
            metadata = opened.metadata() or {}
    except (OSError, SafetensorError):
        return {}
    if metadata.get("format") != FORMAT or metadata.get("version") != str(VERSION):
        return {}
    return {field.name: metadata[field.name] for field in fields(StateKey) if field.name in metadata}


def _mismatch(metadata: dict[str, str], key: StateKey, saved: SavedSession) -> str | None:
    """Why a state with this header cannot serve `key` and `saved`; None when it can."""
    if metadata.get("format") != FORMAT:
        return "its cache state file is not one streamchat wrote"
    if metadata.get("version") != str(VERSION):
        return f"its cache state is format version {metadata.get('version')}; this streamchat reads version {VERSION}"
    for field in fields(StateKey):
        was, now = metadata.get(field.name, _BEFORE_FIELD.get(field.name)), str(getattr(key, field.name))
        if was != now and field.name == "weights":
            return "its cache state was saved for other weights of this model (its files changed since)"
        if was != now:
            return f"its cache state was saved for {_FIELD_WORDS[field.name]} {was}, this run has {now}"
    seed = saved.settings.get("seed", RANDOM_SEED)
    if metadata.get("conversation") != conversation_digest(saved.messages, saved.system_prompt, seed):
        messages = metadata.get("messages", "?")
        if messages != str(len(saved.messages)):
            return (
                f"its cache state holds {messages} messages of the {len(saved.messages)} in the session: "
                "it is older than the conversation's last turn"
            )
        return "its cache state holds another version of the conversation (changed after the state was saved)"
    return None
