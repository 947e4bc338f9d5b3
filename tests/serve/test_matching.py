"""The index that tells which conversation a resent history continues."""

from __future__ import annotations

from streamchat.serve.matching import ConversationIndex, history_digest, is_session_id

TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def test_a_conversation_is_found_by_what_it_says_and_only_by_that() -> None:
    index = ConversationIndex()
    index.file("20250101-120000-3fa2c1", "Be brief.", TURN)
    assert index.find("Be brief.", TURN) == "20250101-120000-3fa2c1"
    assert index.find(None, TURN) is None  # another system prompt
    assert index.find("Be brief.", [TURN[0], {"role": "assistant", "content": "Hello. "}]) is None  # a trimmed reply
    assert index.find("Be brief.", TURN[:1]) is None


def test_a_conversation_that_moved_on_is_filed_under_its_new_history_only() -> None:
    index = ConversationIndex()
    index.file("a", None, TURN)
    longer = [*TURN, {"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure."}]
    index.file("a", None, longer)
    assert (index.find(None, TURN), index.find(None, longer)) == (None, "a")
    index.forget("a")
    assert index.find(None, longer) is None


def read(content: str) -> list[dict[str, str]]:
    return [TURN[0], {"role": "assistant", "content": content}]


def test_a_reply_cut_short_is_continued_from_any_start_of_it() -> None:
    index = ConversationIndex()
    index.file("a", None, TURN, cut_short=True)  # the client left mid-stream; it was sent "Hello."
    assert [index.find(None, read(content)) for content in ("Hello.", "Hel", "", "Hello!")] == ["a", "a", "a", None]
    assert index.find(None, TURN[:1]) == "a"  # none of it: the question asked again
    assert index.find(None, [{"role": "user", "content": "Ho"}, TURN[1]]) is None  # another question
    assert index.find(None, [{"role": "user", "content": "Ho"}]) is None
    index.file("a", None, [*TURN, {"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure."}])
    assert index.find(None, read("Hel")) is None  # it moved on: only its whole history continues it


def test_digests_tell_roles_and_contents_apart() -> None:
    swapped = [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hello."}]
    assert history_digest(None, TURN) != history_digest(None, swapped)
    assert history_digest("", TURN) != history_digest(None, TURN)


def test_session_ids() -> None:
    assert is_session_id("20250101-120000-3fa2c1")
    assert not any(map(is_session_id, ["20250101-120000-3FA2C1", "../20250101-120000-3fa2c1", "x", ""]))
