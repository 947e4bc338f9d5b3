"""What a chat session starts with (its cache's shape, how it reads and evicts, its generation settings), and
what `/set` may change of it later, typed: `SessionChanges`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from streamchat import defaults
from streamchat.conversation.kept_prefix import Keep, parse_keep
from streamchat.errors import ConfigError
from streamchat.generation.settings import GenerationChanges, GenerationSettings, parse_setting

if TYPE_CHECKING:
    from streamchat.engine.shared_sinks import SharedSinks
    from streamchat.generation.constraint import ReplyFormat
    from streamchat.generation.decoder import LockstepChannel


@dataclass(frozen=True)
class SessionOptions:
    # What the cache keeps forever as its sinks: "system" (through the system turn) or a number of first tokens.
    keep: Keep = defaults.KEEP
    window: int = defaults.WINDOW
    eviction: str = defaults.EVICTION_POLICY
    # "auto": what left the cache is searched for each new message, the relevant part read again before it.
    recall: str = defaults.RECALL
    system_prompt: str | None = None
    prefill_chunk: int = defaults.PREFILL_CHUNK
    # None: streamchat's defaults overridden by the model's generation config.
    settings: GenerationSettings | None = None
    # A prompt longer than the cache: False reads its start and last two windows, True every token.
    read_all: bool = defaults.READ_ALL
    # Under tensor parallelism, how the ranks agree on each token and stop; None in one process.
    channel: LockstepChannel | None = None
    # Where the conversations over one engine that begin alike share their sinks (a server's); None: not shared.
    shared_sinks: SharedSinks | None = None
    # What every reply is held to (`--json-schema`: one JSON value of a schema); a server sets it per request (a
    # schema, a tool call). None: free text.
    reply_format: ReplyFormat | None = None
    # False: no copy of the cache is kept after each prompt for /regen (a server's: no client can ask for one).
    regenerates: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", parse_keep(self.keep))
        eviction_policy(self.eviction)
        recall_mode(self.recall)
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")


def eviction_policy(value: str) -> str:
    """`value` when it names an eviction policy; ConfigError otherwise."""
    if value not in defaults.EVICTION_POLICIES:
        raise ConfigError(f"eviction must be one of {', '.join(defaults.EVICTION_POLICIES)}, got {value!r}")
    return value


def recall_mode(value: str) -> str:
    """`value` when it names a recall mode; ConfigError otherwise."""
    if value not in defaults.RECALL_MODES:
        raise ConfigError(f"recall must be one of {', '.join(defaults.RECALL_MODES)}, got {value!r}")
    return value


class SessionChanges(GenerationChanges, total=False):
    """What one `/set` (or a request, or a benchmark) changes of a session: generation settings, eviction, recall."""

    eviction: str
    recall: str


# The settings a session keeps itself, beside its GenerationSettings.
SESSION_SETTINGS = ("eviction", "recall")


def parse_option(key: str, text: str) -> SessionChanges:
    """The change `/set KEY TEXT` asks for, typed; ConfigError for an unknown key or a value it does not take."""
    if key == "eviction":
        return SessionChanges(eviction=eviction_policy(text))
    if key == "recall":
        return SessionChanges(recall=recall_mode(text))
    return SessionChanges(**parse_setting(key, text))


def generation_changes(changes: SessionChanges) -> GenerationChanges:
    """The part of `changes` that is generation settings."""
    return cast(GenerationChanges, {key: value for key, value in changes.items() if key not in SESSION_SETTINGS})
