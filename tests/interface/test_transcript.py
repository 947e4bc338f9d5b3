from __future__ import annotations

import io
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamchat.errors import TranscriptError
from streamchat.interface.transcript import (
    EXAMPLE,
    SkippedLine,
    SystemPrompt,
    TranscriptFormat,
    TranscriptItem,
    TurnSplit,
    UserTurn,
    example_transcript_path,
    read_transcript,
    read_transcript_file,
    transcript_path,
    transcript_writer,
)
from tests.support.waiting import HANG_GUARD_SECONDS

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def stream_of(
    data: bytes, transcript_format: TranscriptFormat = "auto", turns: TurnSplit = "line"
) -> Iterator[TranscriptItem]:
    return read_transcript(io.BytesIO(data), "<stdin>", transcript_format=transcript_format, turns=turns)


def read(data: bytes, transcript_format: TranscriptFormat = "auto", turns: TurnSplit = "line") -> list:
    return list(stream_of(data, transcript_format, turns))


def messages(items: list[TranscriptItem]) -> list[str]:
    return [str(item.error) for item in items if isinstance(item, SkippedLine)]


# --- plain text ---------------------------------------------------------------


def test_text_gives_one_turn_per_non_blank_line_with_its_line_number() -> None:
    data = b"Hello there.\n\n   \n  What is 2 + 2?  \r\nThanks"
    assert read(data) == [
        UserTurn("Hello there.", 1),
        UserTurn("What is 2 + 2?", 4),
        UserTurn("Thanks", 5),
    ]


def test_blank_line_turns_span_lines_and_keep_inner_indentation() -> None:
    data = b"\n\nWrite a poem\nabout the sea.\n\n\n\nNow fix this code:\n    x = 1\n  \nThanks\n"
    assert read(data, turns="blank-line") == [
        UserTurn("Write a poem\nabout the sea.", 3),
        UserTurn("Now fix this code:\n    x = 1", 8),
        UserTurn("Thanks", 11),
    ]


def test_text_lines_are_never_parsed_as_json() -> None:
    data = b'Hi\n{"role": "user", "content": "not a message"}\n'
    assert read(data) == [UserTurn("Hi", 1), UserTurn('{"role": "user", "content": "not a message"}', 2)]
    assert read(b'{"turns": ["a"]}\n', transcript_format="text") == [UserTurn('{"turns": ["a"]}', 1)]


def test_a_json_array_first_line_means_text() -> None:
    assert read(b'["a", "b"]\n') == [UserTurn('["a", "b"]', 1)]


def test_a_utf8_byte_order_mark_is_dropped() -> None:
    assert read("\ufeffBonjour\n".encode()) == [UserTurn("Bonjour", 1)]


# --- JSONL and MT-bench -------------------------------------------------------


def test_chat_lines_give_user_turns_and_system_prompts_and_skip_assistant_lines() -> None:
    data = b"""
{"role": "system", "content": "  Be brief.  "}
{"role": "user", "content": " Hi, I am Ann. "}
{"role": "assistant", "content": "Hello Ann!", "stats": {"tokens": 3}}

{"role": "user", "content": "What is my name?", "name": "ignored"}
{"role": "system", "content": ""}
"""
    assert read(data) == [
        SystemPrompt("Be brief.", 2),
        UserTurn("Hi, I am Ann.", 3),
        UserTurn("What is my name?", 6),
        SystemPrompt("", 7),
    ]


def test_mt_bench_lines_give_each_turn_in_order() -> None:
    data = (
        b'{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now a limerick."]}\n'
        b'{"question_id": 82, "turns": ["Name a prime."]}\n'
    )
    assert read(data) == [
        UserTurn("Write a haiku.", 1),
        UserTurn("Now a limerick.", 1),
        UserTurn("Name a prime.", 2),
    ]


def test_auto_reads_chat_and_mt_bench_lines_in_one_file() -> None:
    data = b'{"turns": ["One", "Two"]}\n{"role": "user", "content": "Three"}\n'
    assert read(data) == [UserTurn("One", 1), UserTurn("Two", 1), UserTurn("Three", 2)]


@pytest.mark.skipif(not (SHARED_DATA / "mt_bench.jsonl").exists(), reason="shared MT-bench data not present")
def test_the_mt_bench_file_gives_two_turns_per_question() -> None:
    path = SHARED_DATA / "mt_bench.jsonl"
    questions = [json.loads(line)["turns"] for line in path.read_text().splitlines()]
    items = list(read_transcript_file(str(path), transcript_format="mtbench", turns="line"))
    assert items == [UserTurn(turn.strip(), n) for n, turns in enumerate(questions, start=1) for turn in turns]
    assert len(items) == 160


# --- malformed lines: reported, skipped, reading continues ---------------------


def test_malformed_json_lines_are_skipped_with_their_line_numbers() -> None:
    data = b"""{"role": "user", "content": "first"}
{"role": "user", "content": "oops"
[1, 2]
{"role": "bot", "content": "hi"}
{"role": "user", "content": 42}
{"role": "user", "content": "   "}
{"turns": []}
{"turns": ["fine", 3]}
{"question": "no known key"}
plain words
{"role": "user", "content": "last"}
"""
    items = read(data)
    assert [item for item in items if not isinstance(item, SkippedLine)] == [
        UserTurn("first", 1),
        UserTurn("last", 11),
    ]
    assert messages(items) == [
        "<stdin> line 2: not valid JSON (Expecting ',' delimiter at column 35); line skipped",
        "<stdin> line 3: expected a JSON object; line skipped",
        "<stdin> line 4: unknown role 'bot'; expected 'user', 'system' or 'assistant'; line skipped",
        "<stdin> line 5: 'content' must be a string; line skipped",
        "<stdin> line 6: empty user message; line skipped",
        "<stdin> line 7: 'turns' must be a list of non-empty strings; line skipped",
        "<stdin> line 8: 'turns' must be a list of non-empty strings; line skipped",
        "<stdin> line 9: expected a 'role' or 'turns' key; line skipped",
        "<stdin> line 10: not valid JSON (Expecting value at column 1); line skipped",
    ]


def test_an_explicit_format_accepts_only_its_own_lines() -> None:
    data = b'{"turns": ["a"]}\n{"role": "user", "content": "b"}\n'
    jsonl = read(data, transcript_format="jsonl")
    assert jsonl[1:] == [UserTurn("b", 2)]
    assert messages(jsonl) == ["<stdin> line 1: expected a 'role' key; line skipped"]
    mtbench = read(data, transcript_format="mtbench")
    assert mtbench[0] == UserTurn("a", 1)
    assert messages(mtbench) == ["<stdin> line 2: expected a 'turns' key; line skipped"]


def test_an_explicit_json_format_reads_a_file_whose_first_line_is_text() -> None:
    items = read(b'hello\n{"role": "user", "content": "b"}\n', transcript_format="jsonl")
    assert items[1:] == [UserTurn("b", 2)]
    assert messages(items) == ["<stdin> line 1: not valid JSON (Expecting value at column 1); line skipped"]


# --- fatal problems -------------------------------------------------------------


def test_a_nul_byte_stops_reading_at_its_line() -> None:
    items = read_transcript(io.BytesIO(b"fine\nbad\x00line\n"), "dump.bin", transcript_format="auto", turns="line")
    assert next(items) == UserTurn("fine", 1)
    with pytest.raises(TranscriptError) as raised:
        next(items)
    assert str(raised.value) == (
        "dump.bin line 2: contains a NUL byte; this looks like a binary file, not a UTF-8 text transcript"
    )


def test_invalid_utf8_stops_reading_with_the_byte_and_line() -> None:
    with pytest.raises(TranscriptError) as raised:
        read("ok\ncaf\u00e9\n".encode("latin-1"))
    assert str(raised.value) == ("<stdin> line 2: not UTF-8 text (byte 0xe9 at offset 3); save the transcript as UTF-8")


@pytest.mark.parametrize(
    "data",
    [b"", b"\n  \n\n", b'{"role": "assistant", "content": "hi"}\n{"role": "system", "content": "x"}\n'],
)
def test_a_transcript_without_user_turns_is_an_error(data: bytes) -> None:
    with pytest.raises(TranscriptError, match=r"^no turns found in <stdin>$"):
        read(data)


def test_only_malformed_lines_are_reported_before_the_no_turns_error() -> None:
    items = stream_of(b'{"role": "user"}\n')
    assert messages([next(items)]) == ["<stdin> line 1: 'content' must be a string; line skipped"]
    with pytest.raises(TranscriptError, match="no turns found in <stdin>"):
        next(items)


# --- streaming ------------------------------------------------------------------


def test_reading_pulls_only_the_lines_it_needs() -> None:
    for data in ([b"\n", b"one\n", b"two\n", b"three\n"], [b'{"turns": ["one"]}\n', b"two\n", b"three\n"]):
        source = iter(data)
        items = read_transcript(source, "<stdin>", transcript_format="auto", turns="line")
        assert next(items).text == "one"
        assert next(source) == b"two\n"  # the reader has not looked past the first turn


def test_a_live_pipe_is_answered_before_it_closes() -> None:
    read_end, write_end = os.pipe()
    with open(read_end, "rb") as pipe_out, open(write_end, "wb", buffering=0) as pipe_in:
        items = read_transcript(pipe_out, "<stdin>", transcript_format="auto", turns="line")
        pipe_in.write(b"first question\n")
        received: list[object] = []
        reader = threading.Thread(target=lambda: received.append(next(items)), daemon=True)
        reader.start()
        reader.join(timeout=HANG_GUARD_SECONDS)  # a reader that waits for the pipe to close never returns
        assert received == [UserTurn("first question", 1)]
        pipe_in.write(b"second question\n")
        pipe_in.close()
        assert list(items) == [UserTurn("second question", 2)]


# --- files and the shipped example ---------------------------------------------


def test_a_missing_transcript_file_fails_when_opened(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(TranscriptError) as raised:
        read_transcript_file(missing, transcript_format="auto", turns="line")
    assert str(raised.value) == f"cannot read transcript {missing}: No such file or directory"


def test_a_transcript_file_is_named_in_messages_and_closed_after_reading(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text('{"role": "user", "content": "hi"}\n{oops}\n')
    items = list(read_transcript_file(str(path), transcript_format="auto", turns="line"))
    assert items[0] == UserTurn("hi", 1)
    assert messages(items) == [
        f"{path} line 2: not valid JSON (Expecting property name enclosed in double quotes at column 2); line skipped"
    ]


def test_the_word_example_names_the_shipped_example() -> None:
    assert transcript_path(EXAMPLE) == example_transcript_path()
    assert transcript_path("example.txt") == Path("example.txt")
    assert transcript_path("~/chat.txt") == Path.home() / "chat.txt"


def test_the_shipped_example_is_a_clean_multi_turn_conversation() -> None:
    items = list(read_transcript_file(EXAMPLE, transcript_format="auto", turns="line"))
    assert isinstance(items[0], SystemPrompt)
    turns = items[1:]
    assert all(isinstance(item, UserTurn) for item in turns)
    assert 6 <= len(turns) <= 10
    # It tests memory: a late turn asks about what an early one said.
    assert "Priya" in turns[0].text and "my name" in turns[-2].text


# --- writers ----------------------------------------------------------------------


class FlushRecorder(io.StringIO):
    """Records what has been written each time the writer flushes."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []

    def flush(self) -> None:
        self.flushed.append(self.getvalue())


def write_conversation(output_format: str) -> FlushRecorder:
    stream = FlushRecorder()
    writer = transcript_writer(output_format, stream)  # type: ignore[arg-type]
    writer.write_message("system", "Be brief.")
    writer.write_message("user", "Hi, I am Ann.")
    writer.start_reply()
    for delta in ("Hello", ", Ann", "!"):
        writer.write_delta(delta)
    writer.end_reply({"new_tokens": 4, "evicted": 0})
    writer.write_message("user", "Write two lines.")
    writer.start_reply()
    writer.write_delta("One.\nTwo.")
    writer.end_reply()
    return stream


def test_text_output_is_exact_and_flushed_per_delta() -> None:
    stream = write_conversation("text")
    assert stream.getvalue() == (
        "SYSTEM: Be brief.\n"
        "\n"
        "USER: Hi, I am Ann.\n"
        "\n"
        "ASSISTANT: Hello, Ann!\n"
        "\n"
        "USER: Write two lines.\n"
        "\n"
        "ASSISTANT: One.\nTwo.\n"
    )
    start = "SYSTEM: Be brief.\n\nUSER: Hi, I am Ann.\n\nASSISTANT: "
    assert stream.flushed[2:6] == [start, start + "Hello", start + "Hello, Ann", start + "Hello, Ann!"]


def test_markdown_output_is_exact_and_flushed_per_delta() -> None:
    stream = write_conversation("markdown")
    assert stream.getvalue() == (
        "### System\n\nBe brief.\n"
        "\n"
        "### User\n\nHi, I am Ann.\n"
        "\n"
        "### Assistant\n\nHello, Ann!\n"
        "\n"
        "### User\n\nWrite two lines.\n"
        "\n"
        "### Assistant\n\nOne.\nTwo.\n"
    )
    assert stream.flushed[3].endswith("### Assistant\n\nHello")


def test_jsonl_output_writes_each_message_once_complete() -> None:
    stream = write_conversation("jsonl")
    assert stream.getvalue() == (
        '{"role": "system", "content": "Be brief."}\n'
        '{"role": "user", "content": "Hi, I am Ann."}\n'
        '{"role": "assistant", "content": "Hello, Ann!", "stats": {"new_tokens": 4, "evicted": 0}}\n'
        '{"role": "user", "content": "Write two lines."}\n'
        '{"role": "assistant", "content": "One.\\nTwo."}\n'
    )
    assert all(flushed.endswith("\n") for flushed in stream.flushed)  # never half a line


def test_jsonl_output_keeps_non_ascii_text_readable() -> None:
    stream = io.StringIO()
    transcript_writer("jsonl", stream).write_message("user", "Grüße, 世界")
    assert stream.getvalue() == '{"role": "user", "content": "Grüße, 世界"}\n'


def test_jsonl_output_replays_as_a_transcript() -> None:
    saved = write_conversation("jsonl").getvalue().encode()
    assert read(saved) == [
        SystemPrompt("Be brief.", 1),
        UserTurn("Hi, I am Ann.", 2),
        UserTurn("Write two lines.", 4),
    ]


HOSTILE = "a\x1b[2J\x1b]52;c;aGk=\x07\u202eb\x9b1m\x7f"


def write_hostile(output_format: str) -> str:
    stream = io.StringIO()
    writer = transcript_writer(output_format, stream)  # type: ignore[arg-type]
    writer.write_message("user", HOSTILE)
    writer.start_reply()
    for delta in ("x\x1b", "]0;title", "\x07y"):  # a sequence split across deltas
        writer.write_delta(delta)
    writer.end_reply()
    return stream.getvalue()


@pytest.mark.parametrize("output_format", ["text", "markdown"])
def test_text_and_markdown_output_show_control_characters_as_visible_markers(output_format: str) -> None:
    written = write_hostile(output_format)
    assert "a␛[2J␛]52;c;aGk=␇⟨RLO⟩b␛[1m␡" in written and "x␛]0;title␇y" in written
    assert not set(written) & {"\x1b", "\x07", "\x9b", "\u202e", "\x7f"}


def test_jsonl_output_keeps_the_exact_text_with_every_control_character_escaped() -> None:
    written = write_hostile("jsonl")
    assert [json.loads(line)["content"] for line in written.splitlines()] == [HOSTILE, "x\x1b]0;title\x07y"]
    assert r"\u001b[2J" in written and r"\u202e" in written and r"\u009b" in written and r"\u007f" in written
    assert not set(written) & {"\x1b", "\x07", "\x9b", "\u202e", "\x7f"}
