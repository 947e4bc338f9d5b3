"""Where a run's conversations are kept, and their cache states saved beside them and brought back.

data_dir()                    prompt history and saved sessions ($STREAMCHAT_DATA_DIR, else the user data dir)
state_key(config, loaded)     what a cache state saved by this run is valid for
state_to_restore(saved, ...) what makes a conversation the saved one: its cache state where it fits, else why not
save_state(session, path, key) the cache state written beside the session file
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import platformdirs

from streamchat import defaults
from streamchat.conversation.state import ConversationState, TensorState
from streamchat.storage.cache_file import StateKey, read_state, state_path, write_state
from streamchat.storage.session_file import SavedSession

if TYPE_CHECKING:
    from streamchat.generation.settings import GenerationSettings
    from streamchat.interface.config import RunConfig
    from streamchat.loading import LoadedModel


def data_dir() -> Path:
    """Prompt history and saved sessions: $STREAMCHAT_DATA_DIR, else the user data dir."""
    configured = os.environ.get(defaults.DATA_DIR_ENV)
    return (
        Path(configured).expanduser()
        if configured
        else Path(platformdirs.user_data_dir(defaults.APP_NAME, appauthor=False))
    )


def state_key(config: RunConfig, loaded: LoadedModel) -> StateKey:
    """What a cache state saved by this run is valid for."""
    from streamchat.loading.identity import quantization_of, weights_fingerprint

    return StateKey(
        model=loaded.source.location,
        weights=weights_fingerprint(loaded.directory, loaded.model),
        dtype=str(loaded.dtype).removeprefix("torch."),
        device=loaded.device.type,
        quantization=quantization_of(loaded.model),
        keep=str(config.keep),
        window=config.window,
        kv_cache=loaded.kv_cache,
    )


def state_to_restore(
    saved: SavedSession, path: Path, key: StateKey | None, settings: GenerationSettings
) -> tuple[ConversationState, str | None]:
    """What makes a session the conversation `saved` (read from `path`; `settings`: the session's, for a file that
    names none), for its restore(): the state, with the cache state beside the file when it fits `key` and the
    conversation (restored exactly); else without, and why (replayed, and its events say so)."""
    found = read_state(state_path(path), key, saved) if key is not None else None
    tensors = found if isinstance(found, TensorState) else None
    return saved.state(settings, tensors), found if isinstance(found, str) else None


class Snapshotted(Protocol):
    """What save_state reads of a session: its snapshot (a Conversation's, or a ChatSession's between its moves)."""

    def snapshot(self, tensors: bool = True) -> ConversationState: ...


def save_state(session: Snapshotted, session_path: Path | None, key: StateKey | None) -> int | None:
    """Write the cache state beside the session file at `session_path`; its size, None when nothing was written
    (no file, no key, or no whole conversation in the cache: a turn torn off half way).

    SessionFileError when it cannot be written.
    """
    if session_path is None or key is None:
        return None
    state = session.snapshot()
    if state.tensors is None:
        return None
    return write_state(state_path(session_path), state, key)
