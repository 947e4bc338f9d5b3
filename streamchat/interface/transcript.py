"""Piped transcripts: user turns read from a file or stdin, and the conversation written to stdout.

Reading. `read_transcript` turns the lines of a transcript into a stream of items:

- `UserTurn`: a message to answer;
- `SystemPrompt`: use this system prompt from here on ("" removes it);
- `SkippedLine`: a malformed line, already skipped; its error says where and why.

Formats:

- text: one user turn per non-blank line; with turns="blank-line", a turn is a block
  of lines ended by a blank line (or the end of input), so a turn may span lines.
- jsonl: {"role": "user" | "system" | "assistant", "content": "..."} per line. A
  system line sets the system prompt. Assistant lines are ignored: the model answers
  every user turn itself, so a conversation saved with --output-format jsonl replays
  as its user turns. Other keys are ignored.
- mtbench: {"turns": ["...", ...], ...} per line; each string is a user turn, in order,
  and the questions follow each other in one endless conversation (no reset between).
- auto: jsonl/mtbench when the first non-blank line is a JSON object (then each line
  is read by its keys: "role" first, else "turns"), else text.

User text loses its surrounding whitespace. The input is read one line at a time, so a
huge file starts at once and a live pipe is answered as each turn arrives.

What stops and what continues:

- a malformed JSON line is yielded as a `SkippedLine` and reading goes on: the caller
  reports it on stderr, and ends the run with TranscriptError.exit_code;
- input that is not text (a NUL byte, invalid UTF-8) raises TranscriptError at once;
- a transcript without a single user turn raises TranscriptError("no turns found in
  NAME") once it is exhausted.

Writing. `transcript_writer` returns the writer for --output-format; see the writer
classes for their exact formats.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO, Literal, Protocol, TextIO, get_args

from streamchat.conversation.message import Role
from streamchat.errors import TranscriptError
from streamchat.interface.safe_text import safe_plain

TranscriptFormat = Literal["auto", "text", "jsonl", "mtbench"]
TurnSplit = Literal["line", "blank-line"]
OutputFormat = Literal["text", "jsonl", "markdown"]
TRANSCRIPT_FORMATS: tuple[TranscriptFormat, ...] = get_args(TranscriptFormat)
TURN_SPLITS: tuple[TurnSplit, ...] = get_args(TurnSplit)
OUTPUT_FORMATS: tuple[OutputFormat, ...] = get_args(OutputFormat)

# `--transcript example` reads the conversation shipped in streamchat/data.
EXAMPLE = "example"
EXAMPLE_FILE_NAME = "example_transcript.jsonl"

# The keys that decide how a JSON line is read, for each format that reads JSON.
_JSON_KEYS: dict[TranscriptFormat, tuple[str, ...]] = {
    "auto": ("role", "turns"),
    "jsonl": ("role",),
    "mtbench": ("turns",),
}


@dataclass(frozen=True)
class UserTurn:
    text: str
    line: int  # where the turn starts in the transcript, 1-based


@dataclass(frozen=True)
class SystemPrompt:
    text: str  # "" removes the system prompt
    line: int


@dataclass(frozen=True)
class SkippedLine:
    error: TranscriptError  # "NAME line N: what is wrong; line skipped"


TranscriptItem = UserTurn | SystemPrompt | SkippedLine


def example_transcript_path() -> Path:
    """The example conversation shipped with streamchat."""
    # Wheels install streamchat as plain files (the package is not zip-safe), so the
    # resource is a real file that can be opened and shown to the user.
    return Path(str(resources.files("streamchat") / "data" / EXAMPLE_FILE_NAME))


def transcript_path(value: str) -> Path:
    """What --transcript VALUE names: the word `example` is the shipped example, else a file."""
    # The word always wins, so that it works anywhere; a file named so is ./example.
    return example_transcript_path() if value == EXAMPLE else Path(value).expanduser()


def read_transcript_file(
    value: str, *, transcript_format: TranscriptFormat, turns: TurnSplit
) -> Iterator[TranscriptItem]:
    """Open --transcript VALUE now (so a missing file fails before the model loads); read it lazily."""
    try:
        stream = transcript_path(value).open("rb")
    except OSError as error:
        raise TranscriptError(f"cannot read transcript {value}: {error.strerror}") from None
    items = read_transcript(stream, value, transcript_format=transcript_format, turns=turns)
    return _closing_after(stream, items)


def read_transcript(
    stream: Iterable[bytes], name: str, *, transcript_format: TranscriptFormat, turns: TurnSplit
) -> Iterator[TranscriptItem]:
    """The items of a transcript, read line by line from a binary stream (e.g. sys.stdin.buffer).

    `name` ("<stdin>" or the file name) starts every error message.
    """
    lines = _decoded_lines(stream, name)
    if transcript_format == "auto":
        looks_like_json, lines = _sniff_json(lines)
        if not looks_like_json:
            transcript_format = "text"
    items: Iterator[TranscriptItem]
    if transcript_format == "text":
        items = _text_turns(lines, turns)
    else:
        items = _json_items(lines, name, _JSON_KEYS[transcript_format])
    found_turn = False
    for item in items:
        found_turn = found_turn or isinstance(item, UserTurn)
        yield item
    if not found_turn:
        raise TranscriptError(f"no turns found in {name}")


def _closing_after(stream: BinaryIO, items: Iterator[TranscriptItem]) -> Iterator[TranscriptItem]:
    with stream:
        yield from items


def _decoded_lines(stream: Iterable[bytes], name: str) -> Iterator[tuple[int, str]]:
    """(line number, text without its line ending); stops at the first sign of binary input."""
    # Decoding each line ourselves, rather than reading a text stream, makes invalid
    # UTF-8 an error with a line number whatever the locale, and never reads ahead.
    for number, raw in enumerate(stream, start=1):
        if b"\0" in raw:
            raise TranscriptError(
                f"{name} line {number}: contains a NUL byte; this looks like a binary file, not a UTF-8 text transcript"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise TranscriptError(
                f"{name} line {number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset "
                f"{error.start}); save the transcript as UTF-8"
            ) from None
        if number == 1:
            text = text.removeprefix("\ufeff")  # the byte-order mark some Windows editors write
        yield number, text.rstrip("\r\n")


def _sniff_json(lines: Iterator[tuple[int, str]]) -> tuple[bool, Iterator[tuple[int, str]]]:
    """Whether the first non-blank line is a JSON object, and the lines from that one on."""
    for number, text in lines:
        if text.strip():
            return _is_json_object(text), itertools.chain([(number, text)], lines)
    return False, iter(())


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _text_turns(lines: Iterator[tuple[int, str]], turns: TurnSplit) -> Iterator[UserTurn]:
    if turns == "line":
        return (UserTurn(text.strip(), number) for number, text in lines if text.strip())
    return _paragraph_turns(lines)


def _paragraph_turns(lines: Iterator[tuple[int, str]]) -> Iterator[UserTurn]:
    block: list[tuple[int, str]] = []
    for number, text in lines:
        if text.strip():
            block.append((number, text))
        elif block:
            yield _joined(block)
            block = []
    if block:
        yield _joined(block)


def _joined(block: list[tuple[int, str]]) -> UserTurn:
    return UserTurn("\n".join(text for _, text in block).strip(), block[0][0])


def _json_items(lines: Iterator[tuple[int, str]], name: str, keys: tuple[str, ...]) -> Iterator[TranscriptItem]:
    for number, text in lines:
        if not text.strip():
            continue
        try:
            items = _json_line(text, number, keys)
        except ValueError as problem:
            yield SkippedLine(TranscriptError(f"{name} line {number}: {problem}; line skipped"))
            continue
        yield from items


def _json_line(text: str, number: int, keys: tuple[str, ...]) -> list[UserTurn | SystemPrompt]:
    """The items of one JSON line; ValueError says what is wrong with it."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        # error.msg, not str(error): its "line 1" would contradict our line number.
        raise ValueError(f"not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    if "role" in keys and "role" in record:
        return _chat_message(record, number)
    if "turns" in keys and "turns" in record:
        return _mt_bench_turns(record["turns"], number)
    raise ValueError(f"expected a {' or '.join(repr(key) for key in keys)} key")


def _chat_message(record: Mapping[str, object], number: int) -> list[UserTurn | SystemPrompt]:
    role, content = record["role"], record.get("content")
    if role not in ("user", "system", "assistant"):
        raise ValueError(f"unknown role {role!r}; expected 'user', 'system' or 'assistant'")
    if role == "assistant":
        return []
    if not isinstance(content, str):
        raise ValueError("'content' must be a string")
    if role == "system":
        return [SystemPrompt(content.strip(), number)]
    if not content.strip():
        raise ValueError("empty user message")
    return [UserTurn(content.strip(), number)]


def _mt_bench_turns(turns: object, number: int) -> list[UserTurn | SystemPrompt]:
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError("'turns' must be a list of non-empty strings")
    return [UserTurn(turn.strip(), number) for turn in turns]


class TranscriptWriter(Protocol):
    """Writes the conversation to stdout as it happens."""

    def write_message(self, role: Role, content: str) -> None:
        """A complete message: the system prompt, a user turn."""

    def start_reply(self) -> None:
        """The assistant starts answering."""

    def write_delta(self, text: str) -> None:
        """The next piece of the reply, as the model produces it."""

    def end_reply(self, stats: Mapping[str, object] | None = None) -> None:
        """The reply is complete; `stats` (JSON-serialisable turn statistics) go to jsonl only."""


class _BlockWriter:
    r"""Text and Markdown: each message is its header, its content and a newline, with a blank
    line between messages. Reply deltas are flushed as they arrive. A user turn and its reply
    come out as

        text:      "USER: Hi there.\n\nASSISTANT: Hello!\n"
        markdown:  "### User\n\nHi there.\n\n### Assistant\n\nHello!\n"

    Content is terminal-safe (see streamchat.interface.safe_text): these transcripts end up on
    terminals (`cat`, `less -R`, the pipe itself), so control characters are written as
    their visible markers.
    """

    def __init__(self, stream: TextIO, headers: Mapping[Role, str]) -> None:
        self._stream = stream
        self._headers = headers
        self._empty = True

    def write_message(self, role: Role, content: str) -> None:
        self._open(role)
        self._stream.write(safe_plain(content))
        self._close()

    def start_reply(self) -> None:
        self._open("assistant")
        self._stream.flush()

    def write_delta(self, text: str) -> None:
        self._stream.write(safe_plain(text))
        self._stream.flush()

    def end_reply(self, stats: Mapping[str, object] | None = None) -> None:
        self._close()

    def _open(self, role: Role) -> None:
        # The separator goes before a message, not after, so the output ends with one newline.
        if not self._empty:
            self._stream.write("\n")
        self._empty = False
        self._stream.write(self._headers[role])

    def _close(self) -> None:
        self._stream.write("\n")
        self._stream.flush()


_TEXT_HEADERS: dict[Role, str] = {"system": "SYSTEM: ", "user": "USER: ", "assistant": "ASSISTANT: "}
_MARKDOWN_HEADERS: dict[Role, str] = {
    "system": "### System\n\n",
    "user": "### User\n\n",
    "assistant": "### Assistant\n\n",
}


# What json.dumps(ensure_ascii=False) leaves as it is, though a terminal would act on it.
_UNESCAPED_CONTROLS = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


class _JsonlWriter:
    """One JSON object per line and message: {"role": ..., "content": ...}, plus "stats" on a
    reply when given. A reply is written once complete, so every line is valid JSON, and the
    output reads back as a jsonl transcript. Content is exact, and every control character is
    JSON-escaped (json escapes C0 itself; DEL, C1 and bidi controls too here), so the lines are
    safe to show on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._reply: list[str] = []

    def write_message(self, role: Role, content: str, stats: Mapping[str, object] | None = None) -> None:
        record: dict[str, object] = {"role": role, "content": content}
        if stats is not None:
            record["stats"] = dict(stats)
        line = json.dumps(record, ensure_ascii=False)
        self._stream.write(_UNESCAPED_CONTROLS.sub(lambda match: f"\\u{ord(match[0]):04x}", line) + "\n")
        self._stream.flush()

    def start_reply(self) -> None:
        self._reply = []

    def write_delta(self, text: str) -> None:
        self._reply.append(text)

    def end_reply(self, stats: Mapping[str, object] | None = None) -> None:
        self.write_message("assistant", "".join(self._reply), stats)


def transcript_writer(output_format: OutputFormat, stream: TextIO) -> TranscriptWriter:
    """The writer for --output-format."""
    if output_format == "jsonl":
        return _JsonlWriter(stream)
    return _BlockWriter(stream, _MARKDOWN_HEADERS if output_format == "markdown" else _TEXT_HEADERS)
