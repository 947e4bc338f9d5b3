"""The interactive chat in-process: scripted lines in, the screen and the session files out.

ChatApp runs over a real ChatSession on a tiny model, a real ChatDisplay recording into a
string (fixed width, no colour) and a real Journal in a temporary directory. Only the
terminal's prompt is a stand-in: it hands over the scripted lines, then None (Ctrl-D).
The scripted model answers every message with SCRIPT, then its end of turn, so the
screen and the files can be compared whole; timings alone are steadied.
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from streamchat.app.chat import ChatApp
from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.display import ChatDisplay
from streamchat.storage.cache_file import StateKey, state_path
from streamchat.storage.journal import Journal
from streamchat.storage.session_file import SavedSession, read_session
from tests.support.model_dirs import VOCAB, scripted_model_and_tokenizer
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer

SCRIPT = ("Sure", ":", " the", " answer", " is", " 42", ".")
REPLY = "Sure: the answer is 42."
MODEL_NAME = "scripted"
WINDOW = 24
SETTINGS = GenerationSettings(max_new_tokens=20, temperature=0.0, seed=7)
SETTING_VALUES = {
    "max_new_tokens": "20",
    "temperature": "0.0",
    "top_p": "0.9",
    "top_k": "0",
    "min_p": "0.0",
    "repetition_penalty": "1.0",
    "frequency_penalty": "0.0",
    "presence_penalty": "0.0",
    "seed": "7",
    "stop": "none",
    "eviction": "token",
}
WIDTH = 1000  # no line of these chats wraps, however long the temporary paths in it
TIMINGS = re.compile(r"[\d,]+(\.\d+)? tok/s|first token \d+\.\d+ s")


@pytest.fixture(autouse=True)
def no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever pytest's stdin is (a pipe under -s), the chat finds no terminal to hold keys on."""
    monkeypatch.setattr(sys, "stdin", io.StringIO())


@pytest.fixture(scope="module")
def scripted():
    return scripted_model_and_tokenizer(SCRIPT)


def scripted_session(scripted, settings: GenerationSettings = SETTINGS, **options: Any) -> ChatSession:
    model, tokenizer = scripted
    return session_under_test(model, tokenizer, SessionOptions(window=WINDOW, settings=settings, **options))


def sampled_session() -> ChatSession:
    """A random tiny model that samples, seeded: its replies differ from one draw to the next, reproducibly."""
    settings = GenerationSettings(max_new_tokens=6, temperature=0.8, seed=7)
    return session_under_test(
        tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), SessionOptions(settings=settings)
    )


class ScriptedPrompter:
    """The prompt's stand-in: each read() gives the next line, then None, as Ctrl-D does."""

    def __init__(self, lines: Iterable[str], on_read: Callable[[], None] | None = None) -> None:
        self.unread = list(lines)
        self.on_read = on_read

    def read(self) -> str | None:
        if self.on_read is not None:
            self.on_read()
        return self.unread.pop(0) if self.unread else None


@dataclass
class Chat:
    exit_code: int
    screen: str  # what the console showed, timings steadied
    unread: list[str]  # lines the chat never asked for


def chat(
    session: ChatSession,
    lines: Iterable[str],
    data_dir: Path,
    *,
    resume: Path | None = None,
    on_read: Callable[[], None] | None = None,
) -> Chat:
    """Run the chat app over `session` on `lines` until they run out (or /quit), with its session files
    in `data_dir`/sessions. The one place the app is built: as streamchat.app.launch builds it."""
    console = Console(file=io.StringIO(), width=WIDTH, color_system=None, highlight=False, emoji=False)
    display = ChatDisplay(console)
    journal = Journal(
        data_dir / "sessions", MODEL_NAME, {"keep": str(session.keep), "window": session.window}, display.error
    )
    key = StateKey(MODEL_NAME, "tiny", "float32", "cpu", "none", str(session.keep), session.window)
    prompter = ScriptedPrompter(lines, on_read)
    exit_code = ChatApp(session, display, prompter, MODEL_NAME, journal, key).run(resume)
    return Chat(exit_code, steady(console.file.getvalue()), prompter.unread)


def steady(screen: str) -> str:
    """The screen with its timings as "…" and no trailing spaces (a table's widest cell may be a timing)."""
    text = TIMINGS.sub(lambda match: "first token … s" if match[0].startswith("first") else "… tok/s", screen)
    return "\n".join(line.rstrip() for line in text.split("\n"))


def turn_line(generated: int, prompt: int, ending: str = "") -> str:
    return f"{generated} tokens · … tok/s · prompt {prompt} at … tok/s · first token … s{ending}"


def cache_table(window: str, forgotten: str) -> list[str]:
    """/cache in a scripted chat without a system prompt: its sinks are the first 4 tokens of "Hello there."."""
    return [
        "cache",
        "capacity       28 = 4 sinks + 24 window",
        "kept           --keep system: the first 4 tokens (through the system turn, at least 4), for ever",
        "sinks          '<|im_start|>user\\nHell'",
        f"window starts  {window}",
        f"window ends    {window}",
        f"forgotten      {forgotten}",
    ]


def session_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "sessions").glob("*.jsonl"))


def journal_records(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A journal's header and its records, without their times."""
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    return header, [{key: value for key, value in record.items() if key != "at"} for record in lines]


def goodbye(turns: int, streamed: int, evicted: int = 0, journal: Path | None = None) -> str:
    line = f"{turns} turn{'' if turns == 1 else 's'} · {streamed} tokens streamed · {evicted} evicted"
    return line + (f" · saved to {journal} (streamchat run --continue goes on with it)" if journal else "")


def test_a_message_shows_its_reply_and_its_figures_and_the_goodbye_says_where_it_is_saved(scripted, tmp_path):
    result = chat(scripted_session(scripted), ["Hello there."], tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.exit_code == 0
    assert result.screen == "\n".join([REPLY, turn_line(7, 14), goodbye(1, 23, journal=journal), ""])


def test_the_session_file_is_written_as_the_conversation_goes(scripted, tmp_path):
    seen: list[list[dict[str, Any]]] = []

    def look() -> None:
        files = session_files(tmp_path)
        seen.append(journal_records(files[0])[1] if files else [])

    chat(scripted_session(scripted), ["/set top_k 5", "Hello there.", "/set top_k 7", "Again?"], tmp_path, on_read=look)
    (journal,) = session_files(tmp_path)
    settings = {"type": "settings", "values": {**SETTING_VALUES, "top_k": "5"}}
    first = [
        settings,
        {"type": "user", "content": "Hello there."},
        {"type": "reply", "content": REPLY, "stop_reason": "eos"},
    ]
    changed = [*first, {"type": "settings", "values": {"top_k": "7"}}]
    second = [{"type": "user", "content": "Again?"}, {"type": "reply", "content": REPLY, "stop_reason": "eos"}]
    # Nothing before the first message: the settings changed before it open its file.
    assert seen == [[], [], first, changed, changed + second]
    header, records = journal_records(journal)
    assert records == changed + second
    assert (header["format"], header["version"], header["model"]) == ("streamchat-session", 2, MODEL_NAME)
    assert header["cache"] == {"keep": "system", "window": WINDOW} and journal.name == f"{header['id']}.jsonl"
    # The cache state is written beside it as the chat ends: the next run goes on exactly.
    assert state_path(journal).is_file()


def test_set_changes_one_setting_and_set_alone_lists_them_all(scripted, tmp_path):
    session = scripted_session(scripted, GenerationSettings(max_new_tokens=20, temperature=0.7, seed=7))
    lines = ["/set temperature 0", "/set frequency_penalty 0.5", "/set", "/set temperature -1"]
    result = chat(session, [*lines, "/set presence_penalty 3", "/set seed"], tmp_path)
    values = {**SETTING_VALUES, "frequency_penalty": "0.5"}
    listing = [f"{key:<18}  {value}" for key, value in values.items()]
    assert result.screen == "\n".join(
        [
            "temperature = 0.0",
            "frequency_penalty = 0.5",
            "settings",
            *listing,
            "error: temperature must be a number of at least 0 (0 = greedy), got -1.0.",
            "error: presence_penalty must be a number from -2 to 2 (0 = off), got 3.0.",
            "error: /set seed needs a value; usage: /set [KEY VALUE]",
            goodbye(0, 0),  # no message, so no session file
            "",
        ]
    )
    assert session_files(tmp_path) == []


def test_set_changes_how_the_session_evicts_and_recalls(scripted, tmp_path):
    session = scripted_session(scripted)
    result = chat(session, ["/set eviction turn", "/set recall off", '/set stop "two words" "it\'s"'], tmp_path)
    assert result.screen.split("\n")[:3] == ["eviction = turn", "recall = off", "stop = 'two words' 'it'\"'\"'s'"]
    assert (session.eviction, session.recall, session.settings.stop) == ("turn", "off", ("two words", "it's"))


def test_system_replays_the_conversation_behind_the_new_prompt(scripted, tmp_path):
    lines = ["/system", "Hello there.", "/system Be brief.", "/system"]
    result = chat(scripted_session(scripted), lines, tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.screen == "\n".join(
        [
            "no system prompt",
            REPLY,
            turn_line(7, 14),
            "replayed 2 messages (36 tokens)",  # the system turn's 13 tokens, then the 23 of the conversation
            "system prompt set; the conversation was replayed behind it",
            "system prompt: 'Be brief.'",
            goodbye(1, 36, journal=journal),
            "",
        ]
    )
    assert journal_records(journal)[1][-1] == {"type": "system", "content": "Be brief."}
    saved = read_session(journal)
    assert saved.system_prompt == "Be brief." and [m["content"] for m in saved.messages] == ["Hello there.", REPLY]


def test_reset_clears_the_conversation_and_the_next_message_starts_a_new_session_file(scripted, tmp_path):
    result = chat(scripted_session(scripted), ["Hello there.", "/reset", "/stats", "Again?"], tmp_path)
    by_first_message = {read_session(path).messages[0]["content"]: path for path in session_files(tmp_path)}
    assert sorted(by_first_message) == ["Again?", "Hello there."]
    second = by_first_message["Again?"]
    assert result.screen == "\n".join(
        [
            REPLY,
            turn_line(7, 14),
            "conversation and cache cleared",
            "session",
            f"model       {MODEL_NAME}",
            "turns       1",
            "messages    0",
            "tokens      0 streamed, 0 evicted",
            "cache       0 sinks | 0/24 window | 28 free",
            "seed        7",
            f"last reply  {turn_line(7, 14)}",
            REPLY,
            turn_line(7, 13),
            goodbye(2, 22, journal=second),
            "",
        ]
    )
    assert read_session(by_first_message["Hello there."]).messages[1]["content"] == REPLY
    assert [record["type"] for record in journal_records(second)[1]] == ["settings", "user", "reply"]


def test_regen_answers_the_same_message_again(scripted, tmp_path):
    lines = ["/regen", "Hello there.", "/regen", "/set max_new_tokens 3", "/regen"]
    result = chat(scripted_session(scripted), lines, tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.screen == "\n".join(
        [
            "error: there is no reply to regenerate yet",
            REPLY,
            turn_line(7, 14),
            REPLY,  # greedy: the same reply, from the cache as it stood after the message
            turn_line(7, 0),
            "max_new_tokens = 3",
            "Sure: the",
            turn_line(3, 0, " · length limit"),
            goodbye(3, 19, journal=journal),
            "",
        ]
    )
    # The same reply again changes nothing in the file; a different one takes the first back.
    assert journal_records(journal)[1] == [
        {"type": "settings", "values": SETTING_VALUES},
        {"type": "user", "content": "Hello there."},
        {"type": "reply", "content": REPLY, "stop_reason": "eos"},
        {"type": "settings", "values": {"max_new_tokens": "3"}},
        {"type": "rewind", "messages": 1},
        {"type": "reply", "content": "Sure: the", "stop_reason": "max_new_tokens"},
    ]


def test_regen_draws_a_new_sampled_reply_that_a_seed_makes_reproducible(tmp_path):
    twin = sampled_session()
    expected = [
        next(event for event in events if isinstance(event, TurnFinished)).reply
        for events in (list(twin.chat("Hello there.")), list(twin.regenerate()))
    ]
    assert expected[0] != expected[1]
    result = chat(sampled_session(), ["Hello there.", "/regen"], tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.screen == "\n".join(
        [
            expected[0],
            turn_line(6, 14, " · length limit"),
            expected[1],
            turn_line(6, 0, " · length limit"),
            goodbye(2, 22, journal=journal),
            "",
        ]
    )
    assert [(record["type"], record.get("content")) for record in journal_records(journal)[1][1:]] == [
        ("user", "Hello there."),
        ("reply", expected[0]),
        ("rewind", None),
        ("reply", expected[1]),
    ]


def test_stats_and_cache_describe_the_session_and_what_the_cache_forgot(scripted, tmp_path):
    result = chat(scripted_session(scripted), ["Hello there.", "What now?", "/stats", "/cache"], tmp_path)
    (journal,) = session_files(tmp_path)
    # 23 tokens, then 15 + 7 + 2 more through a cache of 28: the oldest 19 after the sinks are forgotten.
    forgot = "o there.<|im_end|> <|im_start|>assistant Sure: the answer is 42.<|im_end|>"
    window = "<|im_start|>user What now?<|im_end|> <|im_start|>assistant Sure: the answer is 42.<|im_end|>"
    assert result.screen == "\n".join(
        [
            REPLY,
            turn_line(7, 14),
            REPLY,
            f"⟲ forgot 19 tokens (#4–#22)  {forgot}",
            turn_line(7, 15),
            "session",
            f"model       {MODEL_NAME}",
            "turns       2",
            "messages    4",
            "tokens      47 streamed, 19 evicted",
            "cache       4 sinks | 24/24 window | 0 free",
            "seed        7",
            f"last reply  {turn_line(7, 15)}",
            *cache_table(window, "19 tokens; messages 1-2 entirely"),
            goodbye(2, 47, 19, journal=journal),
            "",
        ]
    )


def test_help_lists_every_command(scripted, tmp_path):
    result = chat(scripted_session(scripted), ["/help"], tmp_path)
    assert result.screen == "\n".join(
        [
            "commands",
            "/help             show these commands",
            "/reset            start a new conversation (empties the cache)",
            "/regen            answer the last message again",
            "/system [TEXT]    set the system prompt, or show it",
            "/set [KEY VALUE]  change a setting, or show them all",
            "/save [FILE]      say where it is saved, or save a copy as JSON",
            "/load FILE        load a saved conversation",
            "/stats            show speed and token counts",
            "/cache            show what the cache holds",
            "/quit             leave streamchat (also /exit)",
            'Esc then Enter starts a new line; """ starts a block that """ ends.',
            goodbye(0, 0),
            "",
        ]
    )


def test_save_writes_a_copy_and_load_replaces_the_conversation_with_it(scripted, tmp_path):
    copy, again = tmp_path / "kept.json", tmp_path / "again.json"
    lines = ["/save", "Hello there.", "/system Be brief.", "/save", f"/save {copy}", "Something else.", f"/load {copy}"]
    result = chat(scripted_session(scripted), [*lines, f"/save {again}"], tmp_path)
    # The copy is no journal: the conversation loaded from it goes on in a session file of its own.
    first, loaded = sorted(session_files(tmp_path), key=lambda path: len(read_session(path).messages), reverse=True)
    assert result.screen == "\n".join(
        [
            "nothing to save yet",
            REPLY,
            turn_line(7, 14),
            "replayed 2 messages (36 tokens)",
            "system prompt set; the conversation was replayed behind it",
            f"the conversation is saved as it goes, in {first}, with its cache state (0.0 MiB) beside it",
            f"saved 2 messages to {copy}, with its cache state (0.0 MiB) beside it",
            REPLY,
            # Behind the 13 tokens of the system turn, all but the start of the new message is forgotten.
            "⟲ forgot 30 tokens (#13–#42)  <|im_start|>user Hello there.<|im_end|> <|im_start|>assistant "
            f"{REPLY}<|im_end|> <|im_start|>user Some",
            turn_line(7, 22),
            "resumed 2 messages exactly where they stopped (36 tokens in the cache)",
            f"saved 2 messages to {again}, with its cache state (0.0 MiB) beside it",
            goodbye(2, 36, journal=loaded),
            "",
        ]
    )
    settings = {key: value for key, value in SETTING_VALUES.items() if key != "eviction"}
    messages = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": REPLY}]
    saved = read_session(copy)
    assert saved == SavedSession(messages, "Be brief.", settings, "token", MODEL_NAME)
    assert state_path(copy).is_file()
    # Loaded, the conversation is the one saved, and only that.
    assert read_session(again) == saved
    assert (read_session(loaded).messages, read_session(loaded).system_prompt) == (messages, "Be brief.")
    assert read_session(first).messages == [
        *messages,
        {"role": "user", "content": "Something else."},
        {"role": "assistant", "content": REPLY},
    ]


def test_a_session_file_loaded_or_resumed_goes_on_in_that_same_file(scripted, tmp_path):
    chat(scripted_session(scripted), ["Hello there."], tmp_path)
    (journal,) = session_files(tmp_path)
    state_path(journal).unlink()  # without its cache state, the conversation is replayed

    result = chat(scripted_session(scripted), [f"/load {journal}", "/cache", "Again?"], tmp_path)
    assert result.screen == "\n".join(
        [
            "not resumed exactly, replayed: no cache state was saved beside it "
            "(streamchat writes one when it exits, and on /save)",
            "replayed 2 messages (23 tokens)",
            *cache_table(f"o there.<|im_end|> <|im_start|>assistant {REPLY}<|im_end|>", "nothing yet"),
            REPLY,
            "⟲ forgot 17 tokens (#4–#20)  o there.<|im_end|> <|im_start|>assistant Sure: the answer is 42.",
            turn_line(7, 13),
            goodbye(1, 45, 17, journal=journal),
            "",
        ]
    )
    # --continue: ChatApp.run(resume=...) goes on exactly where the last run stopped, in the same file.
    result = chat(scripted_session(scripted), ["/cache", "And now?"], tmp_path, resume=journal)
    assert result.screen.split("\n")[:8] == [
        "resumed 4 messages exactly where they stopped (28 tokens in the cache)",
        *cache_table(
            f"<|im_end|> <|im_start|>user Again?<|im_end|> <|im_start|>assistant {REPLY}<|im_end|>",
            "17 tokens; message 1 entirely; the start of message 2",
        ),
    ]
    assert result.screen.endswith(f"\n{goodbye(1, 70, 42, journal=journal)}\n")
    assert session_files(tmp_path) == [journal]
    contents = [message["content"] for message in read_session(journal).messages]
    assert contents == ["Hello there.", REPLY, "Again?", REPLY, "And now?", REPLY]


def test_a_file_that_cannot_be_loaded_changes_nothing(scripted, tmp_path):
    missing = tmp_path / "no" / "such.json"
    result = chat(scripted_session(scripted), ["Hello there.", f"/load {missing}", "/stats"], tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.screen == "\n".join(
        [
            REPLY,
            turn_line(7, 14),
            f"error: no saved session at {missing}",
            "session",
            f"model       {MODEL_NAME}",
            "turns       1",
            "messages    2",
            "tokens      23 streamed, 0 evicted",
            "cache       4 sinks | 19/24 window | 5 free",
            "seed        7",
            f"last reply  {turn_line(7, 14)}",
            goodbye(1, 23, journal=journal),
            "",
        ]
    )
    assert [record["type"] for record in journal_records(journal)[1]] == ["settings", "user", "reply"]


def test_an_unknown_command_is_one_line_and_the_chat_goes_on(scripted, tmp_path):
    result = chat(scripted_session(scripted), ["/nope", "/sytem Be brief.", "Hello there."], tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.screen == "\n".join(
        [
            "error: unknown command /nope; type /help to list the commands "
            "(start a message with // to send it as text)",
            "error: unknown command /sytem; did you mean /system? (start a message with // to send it as text)",
            REPLY,
            turn_line(7, 14),
            goodbye(1, 23, journal=journal),
            "",
        ]
    )


@pytest.mark.parametrize("command", ["/quit", "/exit"])
def test_quit_leaves_at_once(scripted, tmp_path, command):
    result = chat(scripted_session(scripted), ["Hello there.", command, "Never sent."], tmp_path)
    (journal,) = session_files(tmp_path)
    assert result.exit_code == 0 and result.unread == ["Never sent."]
    assert result.screen == "\n".join([REPLY, turn_line(7, 14), goodbye(1, 23, journal=journal), ""])
    assert [message["content"] for message in read_session(journal).messages] == ["Hello there.", REPLY]


def test_a_session_file_that_cannot_be_written_is_said_once_and_the_chat_goes_on(scripted, tmp_path):
    (tmp_path / "sessions").write_text("")  # a file where the sessions' folder should be
    result = chat(scripted_session(scripted), ["Hello there.", "Again?", "/save"], tmp_path)
    error, *lines = result.screen.split("\n")
    failure = error.removeprefix("error: ")
    # The wording of the reason is the operating system's.
    assert failure.startswith(f"cannot write the session file in {tmp_path / 'sessions'}: ")
    assert failure.endswith("; the conversation is not being saved")
    assert lines == [
        REPLY,
        turn_line(7, 14),
        REPLY,
        "⟲ forgot 17 tokens (#4–#20)  o there.<|im_end|> <|im_start|>assistant Sure: the answer is 42.",
        turn_line(7, 13),
        "nothing to save yet",
        f"2 turns · 45 tokens streamed · 17 evicted · {failure}",
        "",
    ]


def test_under_tp_an_interrupt_between_turns_does_nothing_and_the_handler_is_put_back():
    import os
    import signal

    from streamchat.app.chat import _interrupts_ignored

    before = signal.getsignal(signal.SIGINT)
    with _interrupts_ignored():
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: nothing happens
        handled_here = True
    assert handled_here and signal.getsignal(signal.SIGINT) is before
