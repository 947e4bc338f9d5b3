"""The ChatSession a run's configuration asks for, over a loaded model: the chat's, a server's, a --tp rank's."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamchat.conversation.session import ChatSession
    from streamchat.generation.decoder import StepChannel
    from streamchat.interface.config import RunConfig
    from streamchat.loading import LoadedModel


def session_for(config: RunConfig, loaded: LoadedModel, channel: StepChannel | None = None) -> ChatSession:
    """The session `config` asks for; `channel` keeps it in lockstep with other ranks (--tp)."""
    # Imported here, not above: the command line imports this module, and `streamchat --version` loads no torch.
    from streamchat.conversation.session import ChatSession, SessionOptions
    from streamchat.engine.compiled_step import compile_backend
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
    # Its own engine takes its steps (as the server's takes many conversations'), compiled where asked; under
    # --tp every rank's engine takes the step the leader's takes.
    return ChatSession(loaded.model, loaded.tokenizer, options)
