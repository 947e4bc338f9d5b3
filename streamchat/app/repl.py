"""The prompt: prompt_toolkit line editing, history, slash-command completion, a cache toolbar.

Keys: Enter sends; Esc then Enter (or Alt+Enter) starts a new line; a message that
starts with three double quotes runs until a line that ends with them. Ctrl-C clears
the line, drops an unfinished block, or exits at an empty prompt; Ctrl-D exits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.history import FileHistory, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

from streamchat.app.slash_commands import complete
from streamchat.cache.ledger import CacheStats
from streamchat.interface.status import BAR_CHARACTERS, bar_segments, fit_status

BLOCK_QUOTE = '"""'
PROMPT = "› "
CONTINUATION = "· "


class _SlashCompleter(Completer):
    def __init__(self, setting_keys: Callable[[], Iterable[str]]) -> None:
        self.setting_keys = setting_keys

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/"):
            return
        word = document.get_word_before_cursor(WORD=True)
        for candidate in complete(text, self.setting_keys()):
            yield Completion(candidate, start_position=-len(word))


def _key_bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("c-c")
    def _clear_or_interrupt(event: KeyPressEvent) -> None:
        if event.current_buffer.text:
            event.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt)

    @bindings.add("escape", "enter")
    def _new_line(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    return bindings


class Prompter:
    """Reads one message (or command) at a time; None means the user wants to leave."""

    def __init__(
        self,
        history_file: Path | None,
        setting_keys: Callable[[], Iterable[str]],
        toolbar: Callable[[], StyleAndTextTuples],
    ) -> None:
        history = InMemoryHistory() if history_file is None else _file_history(history_file)
        self._session: PromptSession[str] = PromptSession(
            history=history,
            completer=_SlashCompleter(setting_keys),
            complete_while_typing=True,
            key_bindings=_key_bindings(),
            bottom_toolbar=toolbar,
            prompt_continuation=CONTINUATION,
        )

    def read(self) -> str | None:
        """The next message; None when the user leaves (Ctrl-D, or Ctrl-C at an empty prompt)."""
        try:
            first = self._session.prompt(PROMPT)
        except (EOFError, KeyboardInterrupt):
            return None
        if not first.lstrip().startswith(BLOCK_QUOTE):
            return first
        return self._read_block(first.lstrip()[len(BLOCK_QUOTE) :])

    def _read_block(self, first: str) -> str | None:
        """Lines up to the closing quotes, which are not part of the message; Ctrl-C drops the block."""
        lines = [first]
        while not lines[-1].rstrip().endswith(BLOCK_QUOTE):
            try:
                lines.append(self._session.prompt(CONTINUATION))
            except EOFError:
                return None
            except KeyboardInterrupt:
                return ""
        lines[-1] = lines[-1].rstrip()[: -len(BLOCK_QUOTE)]
        return "\n".join(lines).strip("\n")


def _file_history(path: Path) -> FileHistory | InMemoryHistory:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8"):  # writable, and a file (not a folder)
            pass
    except OSError:
        return InMemoryHistory()  # a read-only home must not stop the chat
    return FileHistory(str(path))


TOOLBAR_STYLES = {"sinks": "fg:ansimagenta", "window": "fg:ansicyan", "free": "fg:ansibrightblack"}


def toolbar_text(stats: CacheStats | None, columns: int) -> StyleAndTextTuples:
    """The occupancy bar and figures, for the bottom toolbar (nothing before the first message)."""
    if stats is None:
        return [("", " /help for commands · Esc Enter for a new line · Ctrl-D to leave")]
    bar_width, figures = fit_status(stats, 0.0, columns - 2)
    parts: StyleAndTextTuples = [("", " ")]
    parts += [(TOOLBAR_STYLES[name], BAR_CHARACTERS[name] * cells) for name, cells in bar_segments(stats, bar_width)]
    parts.append(("", "  " + " · ".join(figures)))
    return parts
