"""Saved sessions on disk: a round trip, and every way a file can be unusable."""

import json

import pytest

from streamchat.conversation.state import ConversationState
from streamchat.errors import ConfigError, SessionFileError
from streamchat.generation.settings import GenerationSettings
from streamchat.storage.session_file import (
    FORMAT,
    JOURNAL_VERSION,
    VERSION,
    SavedSession,
    read_session,
    save_session,
)

CONVERSATION = [
    {"role": "user", "content": "Hello! 你好 👋"},
    {"role": "assistant", "content": "Hi."},
]


def write(tmp_path, **fields):
    path = tmp_path / "session.json"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **fields}))
    return path


def test_a_saved_session_reads_back_the_same(tmp_path):
    settings = GenerationSettings(temperature=0.5, seed=3, stop=("a b", "it's"))
    state = ConversationState(CONVERSATION, "Be kind.", settings, "turn")
    path = tmp_path / "deep" / "session.json"
    save_session(path, state, "smollm2-135m")
    saved = read_session(path)
    assert saved == SavedSession(CONVERSATION, "Be kind.", dict(settings.as_pairs()), "turn", "smollm2-135m")
    assert saved.settings["stop"] == "'a b' 'it'\"'\"'s'"  # the text /set takes, as the file always held it
    assert saved.state(GenerationSettings(top_k=5)) == state  # every setting saved: none left as it was
    assert not [p for p in path.parent.iterdir() if p.name != "session.json"]  # no temporary left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)  # conversations are private


def test_a_last_message_still_waiting_for_its_reply_is_not_saved(tmp_path):
    path = tmp_path / "session.json"
    state = ConversationState([*CONVERSATION, {"role": "user", "content": "And?"}], None, eviction="turn")
    save_session(path, state, None)
    assert read_session(path) == SavedSession(CONVERSATION, None, dict(GenerationSettings().as_pairs()), "turn", None)


def test_an_old_file_s_settings_are_read_from_its_text_over_the_settings_it_does_not_hold(tmp_path):
    # Written before min_p, the penalties and stop existed: what it does not say stays as the session has it.
    old = {"temperature": "0.5", "top_k": "7", "seed": "random"}
    path = write(tmp_path, messages=CONVERSATION, system_prompt=None, eviction="turn", settings=old)
    unsaid = GenerationSettings(min_p=0.1, stop=("END",), seed=4)
    state = read_session(path).state(unsaid)
    assert state.settings == GenerationSettings(temperature=0.5, top_k=7, min_p=0.1, stop=("END",), seed=None)
    assert state.eviction == "turn" and state.messages == CONVERSATION


def test_a_journal_s_settings_records_are_read_as_typed_settings(tmp_path):
    header = {"format": FORMAT, "version": JOURNAL_VERSION, "model": "tiny", "cache": {"sinks": 4, "window": 64}}
    records = [
        {"type": "settings", "values": {"temperature": "0.7", "stop": "'two words' end", "eviction": "token"}},
        {"type": "user", "content": "Hello! 你好 👋"},
        {"type": "reply", "content": "Hi.", "stop_reason": "eos"},
        {"type": "settings", "values": {"temperature": "0", "eviction": "turn"}},
    ]
    path = tmp_path / "20250101-120000-3fa2c1.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in [header, *records]))
    state = read_session(path).state(GenerationSettings())
    assert state.settings == GenerationSettings(temperature=0.0, stop=("two words", "end"))
    assert state.eviction == "turn" and state.messages == CONVERSATION


def test_a_setting_this_streamchat_does_not_take_is_named_when_the_file_is_used(tmp_path):
    saved = read_session(write(tmp_path, messages=CONVERSATION, settings={"temperature": "hot"}))
    with pytest.raises(ConfigError, match="temperature must be a number"):
        saved.state(GenerationSettings())


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "assistant", "content": "Hi."}], "message 1 is from the assistant, expected the user"),
        ([CONVERSATION[0], CONVERSATION[0]], "message 2 is from the user, expected the assistant"),
        ([*CONVERSATION, CONVERSATION[0]], "the last message, 3, has no reply"),
        ([{"role": "robot", "content": "beep"}], "message 1 needs a role"),
        ({"role": "user"}, "'messages' must be a list"),
    ],
)
def test_messages_must_alternate_from_the_user_to_a_reply(tmp_path, messages, message):
    with pytest.raises(SessionFileError, match=message):
        read_session(write(tmp_path, messages=messages))


def test_files_that_are_not_sessions_are_named(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text("[1, 2")
    with pytest.raises(SessionFileError, match=r"notes.json is not a saved session \(invalid JSON at line 1\)"):
        read_session(path)
    path.write_text('{"format": "something else"}')
    with pytest.raises(SessionFileError, match="is not a streamchat session file"):
        read_session(path)
    with pytest.raises(SessionFileError, match="format version 99; expected 1"):
        read_session(write(tmp_path, version=99, messages=[]))


def test_saving_where_a_folder_cannot_be_made_is_a_domain_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SessionFileError, match="cannot save the session to"):
        save_session(blocker / "session.json", ConversationState([], None), None)
