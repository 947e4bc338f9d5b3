"""What a run's conversations are built from and kept in, for every face that holds them (the chat, a server).

data_dir()                   prompt history and saved sessions ($STREAMCHAT_DATA_DIR, else the user data dir)
session_for(config, loaded)  the ChatSession a RunConfig asks for, over a loaded model
state_key(config, loaded)    what a cache state saved by this run is valid for
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from streamchat import defaults
from streamchat.conversation.state import TensorState
from streamchat.storage.cache_file import StateKey, read_state, state_path, write_state
from streamchat.storage.session_file import SavedSession

if TYPE_CHECKING:
    from streamchat.conversation.calls import Conversation
    from streamchat.conversation.session import ChatSession
    from streamchat.generation.decoder import StepChannel
    from streamchat.generation.events import Event
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


def session_for(config: RunConfig, loaded: LoadedModel, channel: StepChannel | None = None) -> ChatSession:
    """The session `config` asks for; `channel` keeps it in lockstep with other ranks (--tp)."""
    from streamchat.conversation.session import ChatSession, SessionOptions
    from streamchat.generation.decoder import compile_backend
    from streamchat.generation.settings import GenerationSettings

    settings = GenerationSettings.from_generation_config(getattr(loaded.model, "generation_config", None))
    given = {option.name: getattr(config, option.name) for option in dataclasses.fields(GenerationSettings)}
    overrides = {name: value for name, value in given.items() if value is not None}
    options = SessionOptions(
        keep=config.keep,
        window=config.window,
        eviction=config.eviction,
        recall=config.recall,
        read_all=config.read_all,
        system_prompt=config.system,
        settings=dataclasses.replace(settings, **overrides),
        compile_backend=compile_backend(config.compile, loaded.device),
        channel=channel,
    )
    if options.compile_backend is not None:
        from streamchat.loading.conversion import use_compile_cache

        use_compile_cache()
    return ChatSession(loaded.model, loaded.tokenizer, options)


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
    )


def restored(session: Conversation, saved: SavedSession, path: Path, key: StateKey | None) -> Iterator[Event]:
    """The events of making `session` the conversation `saved` (read from `path`): exactly, with the cache
    state beside the file when it fits `key` and the conversation; else replayed, and the events say why."""
    found = read_state(state_path(path), key, saved) if key is not None else None
    tensors = found if isinstance(found, TensorState) else None
    return session.restore(saved.state(tensors), found if isinstance(found, str) else None)


def save_state(session: Conversation, session_path: Path | None, key: StateKey | None) -> int | None:
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
