"""The journal: a session file written as the conversation goes, read back by /load, safe against a kill."""

import json
import os
import sys
from pathlib import Path

import pytest

from streamchat.conversation.state import ConversationState, RecalledNote
from streamchat.errors import SessionFileError
from streamchat.generation.events import TextDelta
from streamchat.generation.settings import GenerationSettings
from streamchat.storage.journal import Journal
from streamchat.storage.session_file import JOURNAL_VERSION, list_sessions, read_session, save_session
from tests.conversation.test_session import make_session, run


def records(path):
    lines = path.read_text().splitlines()
    return json.loads(lines[0]), [json.loads(line) for line in lines[1:]]


def kinds(path):
    return [record["type"] for record in records(path)[1]]


@pytest.fixture
def journal(tmp_path):
    errors = []
    journal = Journal(tmp_path / "sessions", "tiny", {"sinks": 4, "window": 400}, errors.append)
    journal.errors = errors
    yield journal
    journal.close()


def chat(session, journal, text):
    journal.record_user(session.snapshot(tensors=False), text)
    finished = run(session.chat(text))[-1]
    journal.record(session.snapshot(tensors=False), finished.stats.stop_reason)
    return finished


def test_nothing_is_written_before_the_first_message(journal):
    session = make_session()
    journal.record(session.snapshot(tensors=False))
    session.update_settings(temperature=0.5)
    journal.record(session.snapshot(tensors=False))
    assert journal.path is None and not journal.directory.exists()


def test_a_message_is_on_disk_before_its_reply_and_the_reply_once_it_ends(journal):
    session = make_session(system_prompt="Be brief.")
    journal.record_user(session.snapshot(tensors=False), "Hello!")
    header, written = records(journal.path)
    assert header["format"] == "streamchat-session" and header["version"] == JOURNAL_VERSION
    assert header["model"] == "tiny" and header["cache"] == {"sinks": 4, "window": 400}
    assert journal.path.name == f"{header['id']}.jsonl"
    assert [record["type"] for record in written] == ["settings", "system", "user"]
    assert written[0]["values"]["temperature"] == "0.0" and written[0]["values"]["eviction"] == "token"
    assert (written[1]["content"], written[2]["content"]) == ("Be brief.", "Hello!")
    assert oct(journal.path.stat().st_mode & 0o777) == oct(0o600)

    finished = run(session.chat("Hello!"))[-1]
    journal.record(session.snapshot(tensors=False), finished.stats.stop_reason)
    reply = records(journal.path)[1][-1]
    assert (reply["type"], reply["content"], reply["stop_reason"]) == ("reply", finished.reply, "max_new_tokens")
    saved = read_session(journal.path)
    assert saved.messages == session.transcript and saved.system_prompt == "Be brief." and saved.model == "tiny"
    assert saved.unanswered is None and saved.version == JOURNAL_VERSION


def test_settings_system_prompt_and_regenerated_replies_are_recorded_as_changes(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    first_reply = session.transcript[-1]["content"]
    # Seeded: a draw left to the run's random state could repeat the greedy reply, and the journal would rightly
    # record no new reply.
    session.update_settings(top_k=5, temperature=1.5, seed=7)
    run(session.regenerate())
    journal.record(session.snapshot(tensors=False), "max_new_tokens")
    session.update_settings(eviction="turn")
    run(session.set_system_prompt("Be kind."))
    journal.record(session.snapshot(tensors=False))
    assert kinds(journal.path) == ["settings", "user", "reply", "settings", "rewind", "reply", "settings", "system"]
    changes = [record["values"] for record in records(journal.path)[1] if record["type"] == "settings"][1:]
    assert changes == [{"seed": "7", "temperature": "1.5", "top_k": "5"}, {"eviction": "turn"}]
    saved = read_session(journal.path)
    assert saved.messages == session.transcript and saved.messages[1]["content"] != first_reply
    assert saved.settings["top_k"] == "5" and saved.settings["temperature"] == "1.5" and saved.eviction == "turn"
    assert saved.system_prompt == "Be kind."


def test_a_message_without_its_reply_is_kept_apart_and_loading_replays_the_rest(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    journal.record_user(session.snapshot(tensors=False), "Are you there?")  # and the process dies here
    saved = read_session(journal.path)
    assert saved.unanswered == "Are you there?" and saved.messages == session.transcript

    restored = make_session()
    run(restored.restore(read_session(journal.path).state(restored.settings)))
    assert restored.transcript == session.transcript


def test_the_records_of_each_change_are_written_with_one_fsync(journal, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda descriptor: (synced.append(descriptor), real_fsync(descriptor))[1])
    session = make_session(system_prompt="Be brief.")
    journal.record_user(session.snapshot(tensors=False), "Hello!")
    assert kinds(journal.path) == ["settings", "system", "user"]
    assert len(synced) == 3  # the header alone, the directory, then the three records together
    session.update_settings(temperature=0.5)
    journal.record_user(session.snapshot(tensors=False), "Again.")  # the first never answered
    assert kinds(journal.path)[3:] == ["settings", "rewind", "user"] and len(synced) == 4


def test_a_last_reply_that_was_stopped_is_said_so(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    assert read_session(journal.path).last_reply_stopped is False
    journal.record_user(session.snapshot(tensors=False), "Go on.")
    said = []
    for event in session.chat("Go on."):
        said.append(event)
        if isinstance(event, TextDelta):
            session.stop()  # Ctrl-C, a client gone
    assert said[-1].stats.stop_reason == "interrupted"
    journal.record(session.snapshot(tensors=False), said[-1].stats.stop_reason)
    assert read_session(journal.path).last_reply_stopped is True
    journal.record_user(session.snapshot(tensors=False), "And?")  # a message after it, never answered
    assert read_session(journal.path).last_reply_stopped is False
    chat(session, journal, "And?")
    assert read_session(journal.path).last_reply_stopped is False


def test_a_line_cut_short_by_a_kill_is_ignored_and_cut_off_before_appending(journal, tmp_path):
    session = make_session()
    chat(session, journal, "Hello!")
    journal.close()
    with journal.path.open("a") as file:
        file.write('{"type": "user", "content": "half a rec')
    saved = read_session(journal.path)
    assert saved.messages == session.transcript and saved.unanswered is None

    resumed = Journal(journal.directory, "tiny", journal.cache, journal.errors.append)
    resumed.resume(journal.path, saved)
    chat(session, resumed, "Second turn")
    resumed.close()
    assert read_session(journal.path).messages == session.transcript
    assert journal.path.read_text().endswith("\n") and "half a rec" not in journal.path.read_text()


def test_a_damaged_line_inside_the_file_is_named(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    lines = journal.path.read_text().splitlines()
    lines[2] = "{garbage"
    journal.path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SessionFileError, match=r"line 3: not a valid record \(the file is damaged there\)"):
        read_session(journal.path)


def test_records_a_later_version_adds_are_skipped(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    with journal.path.open("a") as file:
        file.write('{"type": "cache-state", "file": "x.safetensors"}\n')
    assert read_session(journal.path).messages == session.transcript


def test_reset_starts_a_new_file_with_the_current_settings(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    first = journal.path
    session.reset()
    journal.new_conversation()
    session.update_settings(top_k=3)
    chat(session, journal, "A new topic")
    assert journal.path != first and journal.path.parent == first.parent
    assert read_session(first).messages[0]["content"] == "Hello!"
    assert read_session(journal.path).messages[0]["content"] == "A new topic"
    assert read_session(journal.path).settings["top_k"] == "3"


@pytest.mark.skipif(sys.platform == "win32", reason="advisory locks are POSIX")
def test_a_file_another_streamchat_is_writing_cannot_be_resumed(journal):
    session = make_session()
    chat(session, journal, "Hello!")
    other = Journal(journal.directory, "tiny", journal.cache, journal.errors.append)
    with pytest.raises(SessionFileError, match="is being written by another streamchat"):
        other.resume(journal.path, read_session(journal.path))


def test_a_write_that_fails_is_reported_once_and_the_chat_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    errors = []
    journal = Journal(blocker / "sessions", "tiny", {"sinks": 4, "window": 400}, errors.append)
    session = make_session()
    chat(session, journal, "Hello!")
    chat(session, journal, "Again")
    assert len(errors) == 1 and "the conversation is not being saved" in errors[0]
    assert journal.failure == errors[0]


def test_sessions_are_listed_newest_first_in_both_formats(journal, tmp_path):
    session = make_session()
    chat(session, journal, "The newest conversation")
    directory = journal.directory
    old = directory / "session-20240101-000000.json"
    old_conversation = [{"role": "user", "content": "Old one"}, {"role": "assistant", "content": "Hi"}]
    save_session(old, ConversationState(old_conversation, None), "smollm2-135m")
    os.utime(old, (1_700_000_000, 1_700_000_000))
    (directory / "broken.jsonl").write_text("not json\n")
    (directory / "notes.txt").write_text("ignored")
    summaries, problems = list_sessions(directory)
    assert [(s.path, s.model, s.turns, s.first_message) for s in summaries] == [
        (journal.path, "tiny", 1, "The newest conversation"),
        (old, "smollm2-135m", 1, "Old one"),
    ]
    assert len(problems) == 1 and "broken.jsonl" in problems[0]
    assert list_sessions(tmp_path / "nowhere") == ([], [])


# ---- recall notes -------------------------------------------------------------------------

NOTE = RecalledNote(messages=(0,), text="Earlier in this conversation:\nI said: My sister's name is Ilse.")
MESSAGES = [
    {"role": "user", "content": "My sister's name is Ilse."},
    {"role": "assistant", "content": "Noted."},
    {"role": "user", "content": "What is my sister's name?"},
    {"role": "assistant", "content": "Ilse."},
]


def test_a_note_is_journaled_after_its_message_and_read_back(tmp_path: Path):
    journal = Journal(tmp_path, "tiny", {"sinks": 4, "window": 64}, on_error=print)
    journal.record(ConversationState(MESSAGES[:2], None))
    journal.record_user(ConversationState(MESSAGES[:2], None), MESSAGES[2]["content"])
    journal.record(ConversationState(MESSAGES, None, recalled={2: NOTE}), "eos")
    assert journal.path is not None
    kinds = [line.split('"type": "')[1].split('"')[0] for line in journal.path.read_text().splitlines()[1:]]
    assert kinds == ["settings", "user", "reply", "user", "recall", "reply"]
    saved = read_session(journal.path)
    assert saved.messages == MESSAGES and saved.recalled == {2: NOTE}
    assert saved.state(GenerationSettings()).recalled == {2: NOTE}
    # A rewind past the message takes its note with it.
    journal.record(ConversationState(MESSAGES[:2], None, recalled={}))
    assert read_session(journal.path).recalled == {}
    journal.close()


def test_a_saved_json_session_keeps_its_notes(tmp_path: Path):
    path = tmp_path / "saved.json"
    save_session(path, ConversationState(MESSAGES, None, recalled={2: NOTE}), "tiny")
    assert read_session(path).recalled == {2: NOTE}
    save_session(path, ConversationState(MESSAGES, None), "tiny")
    assert "recalled" not in path.read_text() and read_session(path).recalled == {}
