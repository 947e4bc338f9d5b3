"""Going on with a saved conversation: which session file, its cache state, and its journal.

- `--continue` names the session written most recently, `--resume FILE|ID` one file;
  `/load FILE` does the same from within a chat.
- `--continue` and `--resume` take the cache layout (--keep, --window) the conversation
  was saved with, unless the run sets its own: a cache state fits only its own layout.
  (`/load` goes on in the chat's cache as it is.)
- The cache state beside a session file (streamchat.storage.cache_file) is restored when
  it fits this run; otherwise the conversation is replayed, and the engine says why.
- The state is written beside the journal when streamchat exits (however it exits, as
  long as the cache holds a whole conversation) and on `/save`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from streamchat.errors import ConfigError
from streamchat.interface.config import replaced
from streamchat.sessions.keeping import data_dir, state_to_restore
from streamchat.storage.cache_file import StateKey, saved_key, state_path
from streamchat.storage.journal import SUFFIX, Journal, claim_journal, release_journal
from streamchat.storage.session_file import JOURNAL_VERSION, SavedSession, read_session, saved_layout

if TYPE_CHECKING:
    from streamchat.conversation.calls import Conversation
    from streamchat.generation.events import Event
    from streamchat.interface.config import RunConfig


def session_to_resume(config: RunConfig, sessions: Path) -> Path | None:
    """The session file --continue or --resume names (in the `sessions` directory); None for neither,
    or for --continue when no session was saved yet. ConfigError for a --resume that names none."""
    if config.continue_ and config.resume is not None:
        raise ConfigError("--continue and --resume both name a session to go on with: give one of them")
    if config.resume is not None:
        given = Path(config.resume).expanduser()
        if given.is_file():
            return given
        by_id = sessions / f"{config.resume}{SUFFIX}"
        if "/" not in config.resume and by_id.is_file():
            return by_id
        raise ConfigError(
            f"--resume {config.resume}: no such session file, nor a session id in {sessions} "
            "(`streamchat sessions` lists them)"
        )
    if config.continue_:
        journals = [path for path in sessions.glob(f"*{SUFFIX}") if path.is_file()] if sessions.is_dir() else []
        return max(journals, key=lambda path: path.stat().st_mtime, default=None)
    return None


# The options that lay out a conversation's cache, by the names StateKey and the journal's header give them.
LAYOUT_OPTIONS = ("keep", "window")


def with_saved_layout(config: RunConfig, chosen: Collection[str]) -> RunConfig:
    """`config` with the cache layout of the conversation --continue or --resume goes on with, where
    `chosen` (the options the run sets itself: chosen_options) leaves it to the defaults.

    The layout of its cache state, else the one its journal's header records. A layout this
    streamchat cannot use leaves `config` as it is: the replay then says why.
    """
    path = session_to_resume(config, data_dir() / "sessions")
    if path is None:
        return config
    saved = saved_key(state_path(path)) or saved_layout(path)
    layout = {name: saved[name] for name in LAYOUT_OPTIONS if name in saved and name not in chosen}
    try:
        return replaced(config, layout, str(path))
    except ConfigError:
        return config


def load_session(
    session: Conversation, journal: Journal, path: Path, key: StateKey | None
) -> tuple[Iterator[Event], SavedSession]:
    """Replace the conversation with the one saved at `path`, to go on with it in that same file.

    Returns the events of restoring it (`session.restore`), to be consumed by the caller, and the
    session read. A journal another streamchat holds, or a file the session
    cannot use, changes nothing.
    """
    saved = read_session(path)
    current = journal.path
    is_current = current is not None and current.resolve() == path.resolve()
    # Claimed first: a file another streamchat is writing, or one the session cannot use, changes nothing.
    claimed = claim_journal(path) if saved.version == JOURNAL_VERSION and not is_current else None
    try:
        events = session.restore(*state_to_restore(saved, path, key, session.settings))
    except BaseException:
        if claimed is not None:
            release_journal(claimed)
        raise
    if claimed is not None:
        journal.resume(path, saved, claimed)
    elif saved.version != JOURNAL_VERSION:
        journal.new_conversation()  # an old JSON file: the conversation goes on in a new journal
    return events, saved
