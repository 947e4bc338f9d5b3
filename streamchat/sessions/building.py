"""The ChatSession a run's configuration asks for, over a loaded model (the chat's, a server's, a --tp rank's), and
the driver that runs the process's steps (streamchat.generation.driver)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from streamchat.errors import ConfigError

if TYPE_CHECKING:
    from streamchat.conversation.driven import DrivenSession
    from streamchat.conversation.session import ChatSession
    from streamchat.engine.shared_sinks import SharedSinks
    from streamchat.generation.constraint import JsonFormat
    from streamchat.generation.decoder import LockstepChannel
    from streamchat.generation.driver import Driver
    from streamchat.interface.config import RunConfig
    from streamchat.loading import LoadedModel


def session_for(
    config: RunConfig,
    loaded: LoadedModel,
    channel: LockstepChannel | None = None,
    shared_sinks: SharedSinks | None = None,
    regenerates: bool = True,
) -> ChatSession:
    """The session `config` asks for; `channel` keeps it in lockstep with other ranks (--tp); with `shared_sinks`,
    conversations that begin alike share their sinks (a server's); `regenerates`: /regen can go back a reply."""
    # Imported here, not above: the command line imports this module, and `streamchat --version` loads no torch.
    from streamchat.conversation.session import ChatSession, SessionOptions
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
        channel=channel,
        shared_sinks=shared_sinks,
        regenerates=regenerates,
        reply_format=None if config.json_schema is None else json_format_file(config.json_schema),
    )
    return ChatSession(loaded.model, loaded.tokenizer, options)


def json_format_file(path: str) -> JsonFormat:
    """The JSON every reply must be, from a JSON schema file; ConfigError says what is wrong with it."""
    from streamchat.generation.constraint import JsonFormat

    try:
        schema = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"--json-schema {path}: cannot read it ({error.strerror or error})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"--json-schema {path}: not a JSON file ({error})") from None
    if not isinstance(schema, dict):
        raise ConfigError(f'--json-schema {path}: a JSON schema is an object, as {{"type": "object"}}')
    try:
        return JsonFormat(schema, Path(path).stem)
    except ConfigError as error:
        raise ConfigError(f"--json-schema {path}: {error}") from None


def driver_for(config: RunConfig, loaded: LoadedModel) -> Driver:
    """The driver of the process's steps over the model loaded: its engine's step compiled where `config` asks
    (one conversation a step: the chat's); under --tp every rank's engine takes the step the leader's takes."""
    from streamchat.engine.compiled_decode import compile_backend
    from streamchat.engine.engine import Engine
    from streamchat.generation.driver import Driver

    backend = compile_backend(config.compile, loaded.device)
    if backend is not None:
        from streamchat.loading.conversion import use_compile_cache

        use_compile_cache()
    return Driver(Engine(loaded.model, compile_backend=backend))


def driven_session_for(config: RunConfig, loaded: LoadedModel, channel: LockstepChannel | None = None) -> DrivenSession:
    """The session `config` asks for, with the process's driver: the conversation a chat or a piped run drives."""
    from streamchat.conversation.driven import DrivenSession

    return DrivenSession(session_for(config, loaded, channel), driver_for(config, loaded))
