"""The ChatSession a run's configuration asks for, over a loaded model: the chat's, a server's, a --tp rank's."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from streamchat.conversation.session import ChatSession
    from streamchat.generation.decoder import StepChannel
    from streamchat.interface.config import RunConfig
    from streamchat.loading import LoadedModel


def session_for(config: RunConfig, loaded: LoadedModel, channel: StepChannel | None = None) -> ChatSession:
    """The session `config` asks for; `channel` keeps it in lockstep with other ranks (--tp)."""
    # Imported here, not above: the command line imports this module, and `streamchat --version` loads no torch.
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
    session = ChatSession(loaded.model, loaded.tokenizer, options)
    if steps_in_engine(options.compile_backend, loaded.device):
        from streamchat.engine.engine import Engine

        # The chat's steps are the server's: one conversation, one row (under --tp, every rank's engine takes
        # the step the leader's takes).
        session.run_in(Engine(loaded.model), drives=True)
    return session


def steps_in_engine(compile_backend: str | None, device: torch.device) -> bool:
    """Whether a chat takes its steps in an engine (its own): on a CPU, uncompiled. Not for a compiled step or on
    an accelerator, where the decoder's own step (one graph, the token read back a step late) is the faster."""
    return compile_backend is None and device.type == "cpu"
