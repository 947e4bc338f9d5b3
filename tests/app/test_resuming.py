"""Going on with a saved conversation: --continue and --resume through the real console script, and /load."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest
from typer.testing import CliRunner

from streamchat.app.resuming import session_to_resume
from streamchat.cli import app
from streamchat.errors import ConfigError
from streamchat.interface.config import RunConfig
from streamchat.storage.cache_file import saved_key, state_path
from streamchat.storage.session_file import read_session, saved_layout
from tests.app.test_journal_pty import send, spawn
from tests.support.waiting import HANG_GUARD_SECONDS

OPTIONS = ["--max-new-tokens", "8", "--temperature", "0.8", "--seed", "7", "--window", "40"]
TURNS = ["Hello there", "How are you?", "Tell me a story.", "And then?", "Why?", "Goodbye."]


def streamchat(model_dir, data_dir, *args, stdin: str):
    return subprocess.run(
        [sys.executable, "-m", "streamchat", "run", "--model", str(model_dir), *OPTIONS, *args],
        input=stdin.encode(),
        capture_output=True,
        timeout=HANG_GUARD_SECONDS,
        env={**os.environ, "STREAMCHAT_DATA_DIR": str(data_dir)},
    )


def turns_of(stdout: bytes) -> list[str]:
    return [turn.strip() for turn in stdout.decode().split("USER: ")[1:]]


def test_three_turns_then_continue_with_three_give_the_six_turns_of_one_run(tiny_chat_model, tmp_path):
    whole = streamchat(tiny_chat_model, tmp_path / "a", stdin="\n".join(TURNS) + "\n")
    assert whole.returncode == 0, whole.stderr.decode()

    first = streamchat(tiny_chat_model, tmp_path / "b", stdin="\n".join(TURNS[:3]) + "\n")
    assert first.returncode == 0, first.stderr.decode()
    (journal,) = (tmp_path / "b" / "sessions").glob("*.jsonl")
    assert state_path(journal).is_file()
    second = streamchat(tiny_chat_model, tmp_path / "b", "--continue", stdin="\n".join(TURNS[3:]) + "\n")
    assert second.returncode == 0, second.stderr.decode()
    assert second.stderr == b""  # resumed exactly: nothing to warn about

    assert turns_of(first.stdout) + turns_of(second.stdout) == turns_of(whole.stdout)
    assert len(read_session(journal).messages) == 12  # the same session file goes on
    assert list((tmp_path / "b" / "sessions").glob("*.jsonl")) == [journal]


def test_a_state_that_does_not_fit_is_replayed_with_a_one_line_warning(tiny_chat_model, tmp_path):
    first = streamchat(tiny_chat_model, tmp_path, stdin="Hello there\n")
    assert first.returncode == 0, first.stderr.decode()
    session_id = next((tmp_path / "sessions").glob("*.jsonl")).stem
    again = streamchat(tiny_chat_model, tmp_path, "--resume", session_id, "--keep", "4", stdin="And now?\n")
    assert again.returncode == 0, again.stderr.decode()
    assert again.stderr.decode() == (
        "warning: not resumed exactly, replayed: its cache state was saved for --keep system, this run has 4\n"
    )


def run_in_process(model_dir, data_dir, *args: str, stdin: str, **env: str):
    """`streamchat run` in this process (a pipe: the transcript on stdout, messages on stderr, mixed here)."""
    arguments = ["run", "--model", str(model_dir), "--max-new-tokens", "6", "--temperature", "0", "--compile", "off"]
    environment = {"STREAMCHAT_DATA_DIR": str(data_dir), **env}
    result = CliRunner().invoke(app, [*arguments, *args], input=stdin, env=environment, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


LAYOUT = ["--keep", "4", "--window", "40"]  # not the defaults (system, 2000)


def test_continue_takes_the_cache_layout_the_conversation_was_saved_with(tiny_chat_model, tmp_path):
    whole = run_in_process(tiny_chat_model, tmp_path / "a", *LAYOUT, stdin="Hello there\nHow are you?\n")
    first = run_in_process(tiny_chat_model, tmp_path / "b", *LAYOUT, stdin="Hello there\n")
    (journal,) = (tmp_path / "b" / "sessions").glob("*.jsonl")
    assert saved_layout(journal) == {"keep": "4", "window": "40"}
    assert {name: saved_key(state_path(journal))[name] for name in ("keep", "window")} == {"keep": "4", "window": "40"}

    second = run_in_process(tiny_chat_model, tmp_path / "b", "--continue", stdin="How are you?\n")
    # Resumed exactly, in the saved layout: no replay line, and the turn the one run gave.
    assert first + "\n" + second == whole
    assert second.startswith("USER: How are you?\n\nASSISTANT: ")
    assert len(read_session(journal).messages) == 4
    assert {name: saved_key(state_path(journal))[name] for name in ("keep", "window")} == {"keep": "4", "window": "40"}


@pytest.mark.parametrize(
    ("given", "env", "reason"),
    [
        (["--window", "48"], {}, "--window 40, this run has 48"),
        ([], {"STREAMCHAT_KEEP": "system"}, "--keep 4, this run has system"),
    ],
    ids=["command line", "environment"],
)
def test_a_layout_the_run_sets_itself_wins_and_the_replay_says_why(tiny_chat_model, tmp_path, given, env, reason):
    run_in_process(tiny_chat_model, tmp_path, *LAYOUT, stdin="Hello there\n")
    session_id = next((tmp_path / "sessions").glob("*.jsonl")).stem
    again = run_in_process(tiny_chat_model, tmp_path, "--resume", session_id, *given, stdin="And now?\n", **env)
    assert again.startswith(f"warning: not resumed exactly, replayed: its cache state was saved for {reason}\n")


def test_a_journal_without_a_state_lends_its_layout_and_one_from_before_keep_too(tmp_path):
    header = '{"format": "streamchat-session", "version": 2, "id": "x", "model": "m", "cache": %s}\n'
    journal, older, document = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.json"
    journal.write_text(header % '{"keep": "system", "window": 160}')
    older.write_text(header % '{"sinks": 4, "window": 2000}')
    document.write_text('{"format": "streamchat-session", "version": 1, "messages": []}\n')
    assert saved_layout(journal) == {"keep": "system", "window": "160"}
    assert saved_layout(older) == {"keep": "4", "window": "2000"}
    assert saved_layout(document) == {} and saved_layout(tmp_path / "missing.jsonl") == {}
    assert saved_key(state_path(journal)) == {}


def test_continue_without_a_saved_session_starts_a_new_one(tiny_chat_model, tmp_path):
    result = streamchat(tiny_chat_model, tmp_path, "--continue", stdin="Hello there\n")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr.decode() == "no saved session to continue: this is a new one\n"


def test_continue_picks_the_session_written_last_and_resume_takes_a_file_or_an_id(tmp_path):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    older, newer = sessions / "20250101-120000-aaaaaa.jsonl", sessions / "20250102-120000-bbbbbb.jsonl"
    for path in (newer, older):  # written in this order: the older name was written last
        path.write_text("{}\n")
        time.sleep(0.01)
    (sessions / "20250103-120000-cccccc.cache.safetensors").write_bytes(b"")  # a state is no session
    assert session_to_resume(RunConfig(continue_=True), sessions) == older
    assert session_to_resume(RunConfig(resume="20250102-120000-bbbbbb"), sessions) == newer
    assert session_to_resume(RunConfig(resume=str(newer)), sessions) == newer
    assert session_to_resume(RunConfig(), sessions) is None
    assert session_to_resume(RunConfig(continue_=True), tmp_path / "none") is None
    with pytest.raises(ConfigError, match=r"^--resume 2025: no such session file, nor a session id in "):
        session_to_resume(RunConfig(resume="2025"), sessions)
    with pytest.raises(ConfigError, match=r"^--continue and --resume both name a session"):
        session_to_resume(RunConfig(continue_=True, resume="2025"), sessions)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_an_interactive_chat_left_and_continued_goes_on_exactly(tiny_chat_model, tmp_path):
    child = spawn(tiny_chat_model, tmp_path, "--max-new-tokens", "5")
    send(child, "Hello there.")
    child.expect_exact("5 tokens ·")
    send(child, "/save")
    child.expect(r"with its cache state \([\d.]+ MiB\) beside it")
    send(child, "A second question.")
    child.expect_exact("5 tokens ·")
    child.expect_exact("›")
    child.sendcontrol("d")
    child.expect_exact("streamchat run --continue goes on")
    child.expect(pexpect.EOF)
    (journal,) = (Path(tmp_path) / "sessions").glob("*.jsonl")
    assert state_path(journal).is_file()

    child = spawn(tiny_chat_model, tmp_path, "--max-new-tokens", "5", "--continue")
    child.expect_exact("resumed 4 messages exactly where they stopped")
    send(child, "/cache")
    child.expect_exact("kept")
    child.expect_exact("--keep system: the first 4 tokens")
    send(child, "/quit")
    child.expect(pexpect.EOF)
    assert len(read_session(journal).messages) == 4
