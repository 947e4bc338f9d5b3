"""Transcript mode through the real console script: turns from stdin or a file, the conversation on stdout."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamchat.conversation.session import SessionOptions
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.safe_text import safe_plain
from streamchat.storage.session_file import read_session
from tests.support.model_dirs import HOSTILE_REPLY_PIECES
from tests.support.processes import in_foreground
from tests.support.sessions import session_under_test
from tests.support.waiting import HANG_GUARD_SECONDS, read_at_least

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"
# float32 and unquantized, like the in-process session the transcripts are compared with
OPTIONS = ["--max-new-tokens", "6", "--temperature", "0.8", "--seed", "7", "--window", "40"]
OPTIONS += ["--dtype", "float32", "--quantize", "none"]


def streamchat(model_dir, *args, stdin: bytes = b"", env=None):
    return subprocess.run(
        [sys.executable, "-m", "streamchat", "run", "--model", str(model_dir), *OPTIONS, *args],
        input=stdin,
        capture_output=True,
        timeout=HANG_GUARD_SECONDS,
        env=env,
    )


def expected_replies(model_dir, turns, system=None):
    """The same conversation run in-process: what the command must print, byte for byte."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    settings = GenerationSettings(max_new_tokens=6, temperature=0.8, seed=7)
    session = session_under_test(
        model,
        AutoTokenizer.from_pretrained(model_dir),
        SessionOptions(window=40, settings=settings, system_prompt=system),
    )
    return [next(e for e in session.chat(turn) if isinstance(e, TurnFinished)).reply for turn in turns]


def text_transcript(turns, replies):
    pairs = zip(turns, replies, strict=True)
    return "\n".join(f"USER: {safe_plain(turn)}\n\nASSISTANT: {safe_plain(reply)}\n" for turn, reply in pairs)


def test_plain_lines_give_a_byte_exact_transcript(tiny_chat_model):
    turns = ["Hello there", "How are you?", "Tell me a story."]
    result = streamchat(tiny_chat_model, stdin="\n".join(turns).encode() + b"\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == text_transcript(turns, expected_replies(tiny_chat_model, turns))
    assert result.stderr == b""  # stderr is not a terminal: no live display


def test_stop_strings_from_the_command_line_cut_the_reply(tiny_chat_model):
    turns = ["Hello there"]
    reply = expected_replies(tiny_chat_model, turns)[0]
    stop = reply[len(reply) // 2 :][:3]
    assert stop.strip(), "the seeded reply should have text to stop on"
    result = streamchat(tiny_chat_model, "--stop", stop, "--stop", "never appears", stdin=b"Hello there\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == text_transcript(turns, [reply[: reply.index(stop)]])


def test_blank_line_separated_turns_can_span_lines(tiny_chat_model):
    turns = ["Hello there,\nfriend", "How are you?"]
    result = streamchat(tiny_chat_model, "--turns", "blank-line", stdin=b"Hello there,\nfriend\n\nHow are you?\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == text_transcript(turns, expected_replies(tiny_chat_model, turns))


def test_jsonl_chat_lines_with_a_system_prompt_and_jsonl_output(tiny_chat_model):
    lines = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "ignored"},
        {"role": "user", "content": "How are you?"},
    ]
    stdin = "".join(json.dumps(line) + "\n" for line in lines).encode()
    result = streamchat(tiny_chat_model, "--output-format", "jsonl", stdin=stdin)
    assert result.returncode == 0, result.stderr.decode()
    written = [json.loads(line) for line in result.stdout.decode().splitlines()]
    replies = expected_replies(tiny_chat_model, ["Hello there", "How are you?"], system="Be brief.")
    assert [(m["role"], m["content"]) for m in written] == [
        ("system", "Be brief."),
        ("user", "Hello there"),
        ("assistant", replies[0]),
        ("user", "How are you?"),
        ("assistant", replies[1]),
    ]
    assert written[2]["stats"] == {
        "prompt_tokens": written[2]["stats"]["prompt_tokens"],
        "generated_tokens": 6,
        "stop_reason": "max_new_tokens",
    }


def test_with_a_json_schema_each_turn_is_one_document_of_it(tiny_chat_model, tmp_path):
    schema = {
        "type": "object",
        "properties": {"mood": {"enum": ["good", "bad"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["mood", "score"],
        "additionalProperties": False,
    }
    (tmp_path / "mood.json").write_text(json.dumps(schema))
    given = ["--json-schema", str(tmp_path / "mood.json"), "--max-new-tokens", "40", "--output-format", "jsonl"]
    result = streamchat(tiny_chat_model, *given, stdin=b"How are you?\nAnd now?\n")
    assert result.returncode == 0, result.stderr.decode()
    replies = [json.loads(line) for line in result.stdout.decode().splitlines() if '"assistant"' in line]
    assert len(replies) == 2
    for reply in replies:
        value = json.loads(reply["content"])
        assert set(value) == {"mood", "score"} and value["mood"] in ("good", "bad") and 0 <= value["score"] <= 9
        assert reply["stats"]["stop_reason"] == "eos"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it (No such file or directory)"),
        ("[1", "not a JSON file (Expecting ',' delimiter: line 1 column 3 (char 2))"),
        ("[1]", 'a JSON schema is an object, as {"type": "object"}'),
        ('{"type": "strin"}', "the JSON schema cannot constrain a reply: Invalid type: strin"),
    ],
)
def test_a_json_schema_file_that_cannot_hold_replies_fails_before_the_model_loads(tmp_path, content, message):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    result = streamchat(tmp_path / "no-model-here", "--json-schema", str(path), stdin=b"Hello\n")
    assert result.returncode == 2
    assert result.stderr.decode() == f"error: --json-schema {path}: {message}\n"


@pytest.mark.skipif(not (SHARED / "mt_bench.jsonl").exists(), reason="shared data is not present")
def test_mt_bench_questions_as_markdown(tiny_chat_model, tmp_path):
    questions = (SHARED / "mt_bench.jsonl").read_text().splitlines()[:2]
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(questions) + "\n")
    turns = [turn for line in questions for turn in json.loads(line)["turns"]]
    result = streamchat(tiny_chat_model, "--transcript", str(path), "--output-format", "markdown")
    assert result.returncode == 0, result.stderr.decode()
    replies = expected_replies(tiny_chat_model, turns)
    pairs = zip(turns, replies, strict=True)
    expected = "\n".join(f"### User\n\n{safe_plain(t)}\n\n### Assistant\n\n{safe_plain(r)}\n" for t, r in pairs)
    assert result.stdout.decode() == expected


def test_the_shipped_example_plays(tiny_chat_model):
    # Its system turn (54 tokens here) stays in the cache: it needs a window at least that long.
    result = streamchat(tiny_chat_model, "--transcript", "example", "--window", "80")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().count("ASSISTANT: ") >= 6


def test_a_malformed_line_is_named_skipped_and_fails_the_run_at_the_end(tiny_chat_model):
    stdin = b'{"role": "user", "content": "Hello"}\n{"role": "user", "content": \n{"role": "user", "content": "Bye"}\n'
    result = streamchat(tiny_chat_model, stdin=stdin)
    assert result.returncode == 7
    assert result.stdout.decode().count("ASSISTANT: ") == 2
    assert result.stderr.decode().strip() == (
        "warning: <stdin> line 2: not valid JSON (Expecting value at column 29); line skipped"
    )


@pytest.mark.parametrize(
    ("stdin", "message"),
    [
        (b"", "error: no turns found in <stdin>"),
        (b"\n\n  \n", "error: no turns found in <stdin>"),
        (b"hello\x00\xff\xfe binary", "error: <stdin> line 1:"),
    ],
)
def test_unusable_input_is_one_line_and_exit_code_7_before_the_model_loads(tmp_path, stdin, message):
    result = streamchat(tmp_path / "no-such-model", stdin=stdin)  # reading it would fail differently
    assert result.returncode == 7
    lines = result.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)
    assert "Traceback" not in result.stderr.decode()


def test_a_missing_transcript_file_fails_before_loading_the_model(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "streamchat", "run", "--transcript", str(tmp_path / "nope.txt")],
        capture_output=True,
        timeout=HANG_GUARD_SECONDS,
    )
    assert result.returncode == 7
    assert "nope.txt" in result.stderr.decode() and "Traceback" not in result.stderr.decode()


def test_a_closed_pipe_ends_the_run_quietly(tiny_chat_model):
    turns = "\n".join(f"Turn {n}" for n in range(30)) + "\n"
    command = f"{sys.executable} -m streamchat run --model {tiny_chat_model} {' '.join(OPTIONS)} | head -3"
    result = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command}"],
        input=turns.encode(),
        capture_output=True,
        timeout=HANG_GUARD_SECONDS,
    )
    assert result.stdout.decode().splitlines()[0] == "USER: Turn 0"
    assert len(result.stdout.decode().splitlines()) == 3
    assert result.stderr == b"" and result.returncode == 0


def test_ctrl_c_while_waiting_for_the_next_turn_ends_the_run_with_130(tiny_chat_model):
    pexpect = pytest.importorskip("pexpect")
    arguments = ["-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS, "--transcript", "/dev/stdin"]
    child = pexpect.spawn(sys.executable, arguments, timeout=HANG_GUARD_SECONDS, encoding="utf-8")
    child.sendline("Hello there")
    child.expect_exact("ASSISTANT: ")
    child.expect_exact("\r\n")  # the reply is written; the run waits for the next line
    child.sendintr()
    child.sendline("This turn must not run")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    assert "ASSISTANT" not in child.before


def test_control_sequences_reach_text_output_as_markers_and_jsonl_exactly(scripted_chat_model):
    reply = "".join(HOSTILE_REPLY_PIECES)
    stdin = b"Summarise \x1b]0;this\x07 page\n"
    text = streamchat(scripted_chat_model, "--temperature", "0", "--max-new-tokens", "100", stdin=stdin)
    assert text.returncode == 0, text.stderr.decode()
    assert text.stdout.decode() == f"USER: Summarise ␛]0;this␇ page\n\nASSISTANT: {safe_plain(reply)}\n"
    jsonl = streamchat(
        scripted_chat_model, "--temperature", "0", "--max-new-tokens", "100", "--output-format", "jsonl", stdin=stdin
    )
    written = [json.loads(line) for line in jsonl.stdout.decode().splitlines()]
    assert [(line["role"], line["content"]) for line in written] == [
        ("user", "Summarise \x1b]0;this\x07 page"),
        ("assistant", reply),
    ]
    assert "\x1b" not in jsonl.stdout.decode() and "\u202e" not in jsonl.stdout.decode()


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_hangup_and_terminate_end_the_transcript_on_a_whole_turn(tiny_chat_model, tmp_path, signum, code):
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS]
    command += ["--max-new-tokens", "100000"]
    env = {**os.environ, "STREAMCHAT_DATA_DIR": str(tmp_path)}
    process = subprocess.Popen(
        in_foreground(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    process.stdin.write(b"Tell me a very long story\nThis turn must not run\n")
    process.stdin.flush()
    header = b"USER: Tell me a very long story\n\nASSISTANT: "
    streaming = read_at_least(process, len(header) + 20)  # the reply is streaming
    assert streaming.startswith(header)
    process.send_signal(signum)
    rest, errors = process.communicate(timeout=HANG_GUARD_SECONDS)
    assert process.returncode == code
    assert errors.decode() == f"stopped by {signum.name}\n"
    # The reply ends its turn with its newline, no other turn starts, and the session file has it all.
    (journal,) = (tmp_path / "sessions").glob("*.jsonl")
    saved = read_session(journal)
    assert [message["role"] for message in saved.messages] == ["user", "assistant"]
    assert (streaming + rest).decode() == header.decode() + safe_plain(saved.messages[1]["content"]) + "\n"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
def test_hangup_and_terminate_while_waiting_for_the_next_turn_end_the_run_at_once(tiny_chat_model, signum, code):
    command = [sys.executable, "-m", "streamchat", "run", "--model", str(tiny_chat_model), *OPTIONS]
    process = subprocess.Popen(
        in_foreground(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdin.write(b"Hello there\n")
    process.stdin.flush()
    written = read_at_least(process, len(b"USER: Hello there\n\nASSISTANT: "))
    while not written.endswith(b"\n"):
        written += read_at_least(process, 1)
    process.send_signal(signum)  # stdin stays open: the run is waiting for a line that never comes
    rest, errors = process.communicate(timeout=HANG_GUARD_SECONDS)
    assert (process.returncode, rest, errors.decode()) == (code, b"", f"stopped by {signum.name}\n")
    assert written.startswith(b"USER: Hello there\n\nASSISTANT: ")


def test_a_prompt_longer_than_the_cache_is_read_from_its_tail_with_a_warning(tiny_chat_model):
    line = "lorem ipsum dolor " * 2000  # one line, about 12,000 tokens: 150 windows of 40
    result = streamchat(tiny_chat_model, "--output-format", "jsonl", stdin=line.encode() + b"\n")
    assert result.returncode == 0, result.stderr.decode()
    reply = [json.loads(record) for record in result.stdout.decode().splitlines()][1]
    # Read: the 4 sinks and the last two windows of 40, and nothing of the middle.
    assert reply["stats"]["prompt_tokens"] == 4 + 2 * 40
    warning = result.stderr.decode()
    assert warning.startswith("warning: read the last 84 of ") and warning.endswith(
        " prompt tokens; the model could not have seen the rest; --read-all streams all of it\n"
    )
    read_all = streamchat(tiny_chat_model, "--read-all", "--output-format", "jsonl", stdin=line[:2000].encode())
    assert read_all.returncode == 0 and read_all.stderr == b""
    assert [json.loads(record) for record in read_all.stdout.decode().splitlines()][1]["stats"]["prompt_tokens"] > 84
