"""Saved sessions on disk: a round trip, and every way a file can be unusable."""

import json

import pytest

from streamchat.conversation.state import ConversationState
from streamchat.errors import SessionFileError
from streamchat.storage.session_file import FORMAT, VERSION, SavedSession, read_session, save_session

CONVERSATION = [
    {"role": "user", "content": "Hello! 你好 👋"},
    {"role": "assistant", "content": "Hi."},
]


def write(tmp_path, **fields):
    path = tmp_path / "session.json"
    path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **fields}))
    return path


def test_a_saved_session_reads_back_the_same(tmp_path):
    saved = SavedSession(CONVERSATION, "Be kind.", {"temperature": "0.5"}, "turn", "smollm2-135m")
    path = tmp_path / "deep" / "session.json"
    save_session(path, saved.state(), saved.model)
    assert read_session(path) == saved
    assert not [p for p in path.parent.iterdir() if p.name != "session.json"]  # no temporary left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)  # conversations are private


def test_a_last_message_still_waiting_for_its_reply_is_not_saved(tmp_path):
    path = tmp_path / "session.json"
    state = ConversationState([*CONVERSATION, {"role": "user", "content": "And?"}], None, {"eviction": "turn"})
    save_session(path, state, None)
    assert read_session(path) == SavedSession(CONVERSATION, None, {}, "turn", None)


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
