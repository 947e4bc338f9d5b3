"""The installed console script, killed, hung up and terminated in a real pty: the conversation survives.

Signals go to the process as they would from a closed terminal window (SIGHUP), a
shutdown or `tmux kill-session` (SIGTERM), or the OOM killer (SIGKILL).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from streamchat.storage.cache_file import state_path
from streamchat.storage.session_file import read_session
from tests.support.processes import in_foreground
from tests.support.waiting import HANG_GUARD_SECONDS

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")


def console_script() -> list[str]:
    script = shutil.which("streamchat", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "streamchat"]


def spawn(model: Path, data_dir: Path, *options: str) -> pexpect.spawn:
    # A terminal of the pty's own width, so that a session file's path stays on one line (pytest-xdist
    # workers set COLUMNS=80, which a child would take over the pty's size).
    inherited = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    env = {**inherited, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1", "STREAMCHAT_DATA_DIR": str(data_dir)}
    command = in_foreground([*console_script(), "run", "--model", str(model), "--temperature", "0", *options])
    child = pexpect.spawn(
        command[0], command[1:], env=env, dimensions=(30, 200), timeout=HANG_GUARD_SECONDS, encoding="utf-8"
    )
    child.expect_exact("streamchat 0.1.0")
    return child


def send(child: pexpect.spawn, text: str) -> None:
    child.expect_exact("›")
    child.send(text + "\r")


def journal_of(data_dir: Path) -> Path:
    (path,) = (data_dir / "sessions").glob("*.jsonl")
    return path


def test_kill_9_between_turns_and_during_a_reply_loses_only_the_reply_in_flight(tiny_chat_model, tmp_path):
    child = spawn(tiny_chat_model, tmp_path, "--max-new-tokens", "5")
    send(child, "Hello there.")
    child.expect_exact("5 tokens ·")
    send(child, "A second question.")
    child.expect_exact("5 tokens ·")
    child.expect_exact("›")
    child.kill(signal.SIGKILL)  # between two turns
    child.expect(pexpect.EOF)
    path = journal_of(tmp_path)
    first = read_session(path)
    assert [message["content"] for message in first.messages[::2]] == ["Hello there.", "A second question."]

    # The journal resumes where it stopped; a third turn is killed halfway through its reply.
    child = spawn(tiny_chat_model, tmp_path, "--max-new-tokens", "100000")
    send(child, f"/load {path}")
    child.expect_exact("replayed 4 messages")
    send(child, "/set max_new_tokens 100000")  # the session file brought its own 5
    send(child, "Talk for a long time.")
    child.expect(r"\d+ streamed")
    time.sleep(0.5)
    child.kill(signal.SIGKILL)
    child.expect(pexpect.EOF)
    assert list((tmp_path / "sessions").glob("*.jsonl")) == [path]
    second = read_session(path)
    assert second.messages == first.messages and second.unanswered == "Talk for a long time."

    child = spawn(tiny_chat_model, tmp_path, "--max-new-tokens", "5")
    send(child, f"/load {path}")
    child.expect_exact("replayed 4 messages")
    child.expect_exact("never got its reply")
    child.expect_exact("Talk for a long time.")
    send(child, "/set max_new_tokens 5")
    send(child, "And now?")
    child.expect_exact("5 tokens ·")
    send(child, "/quit")
    child.expect_exact(f"saved to {path}")
    child.expect(pexpect.EOF)
    final = read_session(path)
    assert [message["content"] for message in final.messages[::2]] == ["Hello there.", "A second question.", "And now?"]

    listed = subprocess.run(
        [*console_script(), "sessions"],
        capture_output=True,
        text=True,
        env={**os.environ, "STREAMCHAT_DATA_DIR": str(tmp_path)},
        timeout=HANG_GUARD_SECONDS,
    )
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[1].split()[2:5] == [str(tiny_chat_model), "3", "Hello"]


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGHUP, 129), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("moment", ["at the prompt", "during a reply"])
def test_hangup_and_terminate_stop_the_reply_save_it_and_exit_with_128_plus_the_signal(
    tiny_chat_model, tmp_path, signum, code, moment
):
    child = spawn(tiny_chat_model, tmp_path, "--max-new-tokens", "100000" if moment == "during a reply" else "5")
    send(child, "Hello there.")
    if moment == "during a reply":
        child.expect(r"\d+ streamed")
        time.sleep(0.5)
    else:
        child.expect_exact("5 tokens ·")
        child.expect_exact("›")
    child.kill(signum)
    child.expect(pexpect.EOF)
    child.close()
    assert (child.exitstatus, child.signalstatus) == (code, None)
    assert "Traceback" not in child.before
    assert f"stopped by {signum.name}" in child.before
    path = journal_of(tmp_path)
    assert f"saved to {path}" in child.before.replace("\r\n", "")
    saved = read_session(path)
    assert saved.messages[0]["content"] == "Hello there." and saved.messages[1]["content"]
    last = path.read_text().splitlines()[-1]
    assert ('"stop_reason": "interrupted"' in last) == (moment == "during a reply")
    assert state_path(path).is_file()  # the cache state too: the next run goes on exactly
