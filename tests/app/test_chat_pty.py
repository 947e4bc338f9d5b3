"""The installed console script in a real pseudo-terminal: type, watch the reply and the cache, use commands, Ctrl-C."""

import io
import json
import os
import re
import sys

import pexpect
import pytest

from streamchat.interface.safe_text import safe_plain
from streamchat.storage.session_file import read_session
from tests.support.gguf_files import write_tiny_gguf
from tests.support.model_dirs import HOSTILE_REPLY_PIECES
from tests.support.waiting import HANG_GUARD_SECONDS

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")


@pytest.fixture
def chat(tiny_chat_model, tmp_path):
    env = {**os.environ, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1", "STREAMCHAT_DATA_DIR": str(tmp_path)}
    arguments = ["-m", "streamchat", "run", "--model", str(tiny_chat_model)]
    arguments += ["--window", "40", "--max-new-tokens", "30", "--temperature", "0"]
    child = pexpect.spawn(
        sys.executable, arguments, env=env, dimensions=(30, 110), timeout=HANG_GUARD_SECONDS, encoding="utf-8"
    )
    child.expect_exact("streamchat 0.1.0")
    yield child
    child.close(force=True)


def send(child, text):
    """Type a line once the prompt is up (keys typed before it would be lost)."""
    child.expect_exact("›")
    child.send(text + "\r")


def test_a_conversation_with_evictions_commands_and_a_stopped_reply(chat, tmp_path):
    # A reply streams; the window of 40 fills and tokens are forgotten as the reply goes on.
    send(chat, "Hello there, tell me something.")
    chat.expect(r"forgot \d+ tokens?")
    chat.expect_exact("30 tokens ·")
    chat.expect(r"4 sinks \| 40/40 window \| 0 free")  # the toolbar's occupancy

    send(chat, "/cache")
    chat.expect_exact("capacity")
    chat.expect_exact("44 = 4 sinks + 40 window")
    chat.expect_exact("forgotten")

    send(chat, "/set temperature 0.5")
    chat.expect_exact("temperature = 0.5")
    send(chat, "/nope")
    chat.expect_exact("unknown command /nope")

    # Ctrl-C during a long reply stops it; the session goes on.
    send(chat, "/set max_new_tokens 100000")
    chat.expect_exact("max_new_tokens = 100000")
    send(chat, "Now talk for a long time.")
    chat.expect(r"forgot \d+ tokens?")
    chat.sendintr()
    chat.expect_exact("· stopped")
    send(chat, "/set max_new_tokens 5")
    send(chat, "Are you still there?")
    chat.expect_exact("5 tokens ·")

    send(chat, "/stats")
    chat.expect(r"turns(?:\x1b\[[0-9;]*m|\s)+3")  # the table's styles sit between the cells

    # Ctrl-D leaves with a one-line summary, and the conversation is saved.
    chat.expect_exact("›")
    chat.sendcontrol("d")
    chat.expect(r"3 turns · [\d,]+ tokens streamed · [\d,]+ evicted · saved to ")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0
    saved = list((tmp_path / "sessions").glob("*.jsonl"))
    assert len(saved) == 1 and len(read_session(saved[0]).messages) == 6


def test_ctrl_c_at_an_empty_prompt_leaves(chat):
    chat.expect_exact("›")
    chat.sendintr()
    chat.expect(r"0 turns · 0 tokens streamed · 0 evicted")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_help_lists_the_commands_and_a_block_message_spans_lines(chat):
    send(chat, "/help")
    for command in ("/reset", "/regen", "/system", "/set", "/save", "/load", "/stats", "/cache", "/quit"):
        chat.expect_exact(command)
    send(chat, '"""first line')
    chat.expect_exact("·")  # the continuation prompt
    chat.send('second line"""\r')
    chat.expect_exact("30 tokens ·")
    send(chat, "/quit")
    chat.expect(r"1 turn · ")
    chat.expect(pexpect.EOF)


def test_regen_system_save_load_and_reset(chat, tmp_path):
    send(chat, "Hello there.")
    chat.expect_exact("30 tokens ·")
    send(chat, "/regen")
    chat.expect_exact("30 tokens ·")  # greedy: the same reply again, from the same cache
    send(chat, "/system Be brief.")
    chat.expect(r"replaying the conversation: 0/[\d,]+ tokens")  # the replay reads more than one window
    chat.expect(r"replayed 2 messages \([\d,]+ tokens\)")
    send(chat, "/system")
    chat.expect_exact("system prompt: 'Be brief.'")
    saved = tmp_path / "kept.json"
    send(chat, f"/save {saved}")
    chat.expect_exact("saved 2 messages to")  # and the path, wrapped on a narrow screen
    send(chat, "/reset")
    chat.expect_exact("conversation and cache cleared")
    send(chat, "/stats")
    chat.expect(r"messages(?:\x1b\[[0-9;]*m|\s)+0")
    send(chat, f"/load {saved}")
    chat.expect(r"resumed 2 messages exactly")  # /save FILE wrote the cache state beside it
    send(chat, "/load /no/such/file.json")
    chat.expect_exact("no saved session at /no/such/file.json")
    send(chat, "/quit")
    chat.expect(pexpect.EOF)
    assert json.loads(saved.read_text())["system_prompt"] == "Be brief."


def test_text_with_square_brackets_is_shown_as_is(chat):
    send(chat, '/set stop "[/INST]" "[/]"')
    chat.expect_exact("stop = '[/INST]' '[/]'")
    send(chat, "/set")
    chat.expect_exact("[/INST]")
    chat.expect_exact("eviction")
    send(chat, "/quit")
    chat.expect(pexpect.EOF)
    chat.close()
    assert chat.exitstatus == 0


def test_ctrl_c_drops_an_unfinished_block_and_the_chat_goes_on(chat):
    send(chat, '"""a block I regret')
    chat.expect_exact("·")
    chat.sendintr()
    send(chat, "/stats")
    chat.expect(r"turns(?:\x1b\[[0-9;]*m|\s)+0")
    send(chat, "/quit")
    chat.expect(r"0 turns · ")
    chat.expect(pexpect.EOF)


def terminal_env(data_dir):
    """The environment of a terminal of the pty's own size (pytest-xdist workers set COLUMNS=80)."""
    inherited = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    return {**inherited, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1", "STREAMCHAT_DATA_DIR": str(data_dir)}


def test_control_sequences_in_a_reply_reach_the_screen_as_dimmed_markers(scripted_chat_model, tmp_path):
    env = terminal_env(tmp_path)  # the reply's line, whole on one screen line
    arguments = ["-m", "streamchat", "run", "--model", str(scripted_chat_model), "--temperature", "0"]
    child = pexpect.spawn(
        sys.executable, arguments, env=env, dimensions=(30, 200), timeout=HANG_GUARD_SECONDS, encoding="utf-8"
    )
    child.logfile_read = screen = io.StringIO()
    send(child, "Summarise the page I pasted.")
    child.expect(r"\d+ tokens · ")
    send(child, "/quit")
    child.expect(pexpect.EOF)
    output = screen.getvalue()
    reply = output[output.index("Summarise the page") :]
    for piece in HOSTILE_REPLY_PIECES:
        if not piece.isprintable():
            assert piece not in output, f"{piece!r} reached the terminal"
    assert "\x1b[2J" not in output and "\x1b]" not in output and "\u202e" not in output and "\x9b" not in output
    # Every sequence shows as its marker, dimmed: the line reads as the neutralised reply.
    assert "Look\x1b[2m␛[2J\x1b[0m csi\x1b[2m␛]52;c;aGk=␇\x1b[0m clip" in reply
    assert safe_plain("".join(HOSTILE_REPLY_PIECES)) in re.sub(r"\x1b\[[0-9;]*m", "", reply)


def test_keys_typed_while_the_model_loads_reach_the_first_prompt_whole_and_unechoed(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")  # its tokenizer read on first use: a load that takes a while
    env = {**os.environ, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1", "STREAMCHAT_DATA_DIR": str(tmp_path)}
    arguments = ["-m", "streamchat", "run", "--model", str(gguf), "--max-new-tokens", "3"]
    child = pexpect.spawn(
        sys.executable, arguments, env=env, dimensions=(30, 110), timeout=HANG_GUARD_SECONDS, encoding="utf-8"
    )
    child.expect_exact(f"loading {gguf} ...")  # on the screen before the model loads
    child.expect_exact("tokenizer and config once")
    # A paste longer than the 4095 characters a canonical-mode terminal keeps of an unfinished line.
    pasted = "x" * 4200 + " the end"
    child.send("//" + pasted)  # "//" sends it as a message starting with "/"
    child.expect_exact("streamchat 0.1.0")
    assert "xxxx" not in child.before  # not echoed into the output while loading
    child.expect_exact("›")
    child.send("\r")
    child.expect_exact("3 tokens ·")
    send(child, "/quit")
    child.expect(pexpect.EOF)
    (journal,) = (tmp_path / "sessions").glob("*.jsonl")
    assert read_session(journal).messages[0]["content"] == "/" + pasted


def test_a_long_message_read_whole_shows_its_progress_and_ctrl_c_stops_the_read(tiny_chat_model, tmp_path):
    arguments = ["-m", "streamchat", "run", "--model", str(tiny_chat_model), "--read-all", "--window", "40"]
    arguments += ["--max-new-tokens", "5", "--temperature", "0"]
    child = pexpect.spawn(
        sys.executable,
        arguments,
        env=terminal_env(tmp_path),
        dimensions=(30, 200),
        timeout=HANG_GUARD_SECONDS,
        encoding="utf-8",
    )
    send(child, "lorem ipsum dolor " * 1500)  # about 9,000 tokens, read 40 at a time
    child.expect(r"reading your message: [\d,]+/[\d,]+ tokens · [\d,]+ tok/s · (\d+ min )?\d+ s left · Ctrl-C stops")
    child.sendintr()
    child.expect(r"stopped reading your message after [\d,]+ of [\d,]+ tokens; the model saw only that part")
    child.expect_exact("0 tokens ·")
    send(child, "Are you still there?")
    child.expect_exact("5 tokens ·")
    send(child, "/quit")
    child.expect(r"2 turns · ")
    child.expect(pexpect.EOF)
