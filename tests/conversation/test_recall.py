"""Recall: the BM25 index of evicted passages, its relevance bar, the note, and a session that reads it."""

import pytest

from streamchat.conversation.recall import (
    NOTE_HEADING,
    Passage,
    RecallIndex,
    fed_ids,
    fed_text,
    note_budget,
    passages_of,
    recall_note,
    recalled_event,
    turn_numbers,
    words,
)
from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.conversation.state import RecalledNote
from streamchat.conversation.template import chat_format_for
from streamchat.errors import ConfigError
from streamchat.generation.cache_view import CacheView
from streamchat.generation.events import Recalled, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer

GREEDY = GenerationSettings(max_new_tokens=6, temperature=0.0)
FACT = "My sister's name is Ilse."
FILLER = [
    "Write a short poem about a lighthouse on a stormy night.",
    "Explain how a rainbow forms, in words a child would understand.",
    "Suggest a simple weekly plan for someone who wants to start running.",
    "What are three good habits for staying focused while working from home?",
]


def filled_index() -> RecallIndex:
    index = RecallIndex()
    index.add(0, "user", FACT)
    index.add(1, "assistant", "Noted, I will remember that.")
    index.add(2, "user", "The door code is 4471.")
    index.add(3, "assistant", "Got it.")
    for number, text in enumerate(FILLER, start=4):
        index.add(number, "user" if number % 2 == 0 else "assistant", text)
    return index


def test_words_drop_stopwords_and_single_letters_and_cut_plain_endings():
    assert words("What is my sister's name?") == ["sister", "name"]
    assert words("I parked the cars; parking") == ["park", "car", "park"]
    assert words("The glass") == ["glass"]


def test_long_messages_are_cut_into_runs_of_whole_sentences():
    text = "One two three. Four five six seven. Eight nine."
    assert passages_of(text, most_words=7) == ["One two three. Four five six seven.", "Eight nine."]
    assert passages_of("a b c d e f g h", most_words=3) == ["a b c d e f g h"]  # a longer sentence stands alone


def test_search_finds_the_fact_above_the_bar_and_a_distractor_falls_below_it():
    index = filled_index()
    found = index.search("What is my sister's name?")
    assert [(passage.message, passage.text) for passage in found] == [(0, FACT)]
    assert found[0].relevance == 1.0  # it holds every word of the question
    assert [passage.message for passage in index.search("What is the door code?")] == [2]
    # "brother" was never said, so it weighs the most: the passage holds only "name", 38 % of the weight.
    assert index.search("What is my brother's name?") == []
    brother = index.search("What is my brother's name?", bar=0.0)
    assert [(p.message, round(p.relevance, 4)) for p in brother] == [(0, 0.3827)]
    assert index.search("What is my passport number?", bar=0.0) == []
    assert RecallIndex().search("anything") == [] and index.search("what is it?") == []


def test_a_shared_common_word_in_a_short_passage_does_not_recall_it():
    # The bench's distractor: BM25's score for "called" alone in this short passage cleared half of what
    # the question could score, and the made-up answer "Your cat is called Biscuit." became likelier.
    index = RecallIndex()
    for number, text in enumerate(
        [
            "My dog is called Biscuit.",
            "Biscuit is a lovely name for a dog.",
            "The door code is 4471.",
            "Got it.",
            "Write a short poem about a lighthouse on a stormy night.",
            "Here is a poem.",
        ]
    ):
        index.add(number, "user" if number % 2 == 0 else "assistant", text)
    assert index.search("What is my cat called?") == []
    # idf("call") = ln(1 + 5.5 / 1.5) = 1.5404; "cat", never said, ln(1 + 6.5 / 0.5) = 2.6391: 1.5404 / 4.1795.
    cat = index.search("What is my cat called?", bar=0.0)
    assert [(p.message, round(p.relevance, 4)) for p in cat] == [(0, 0.3686)]
    dog = index.search("What is my dog called?")
    assert [(p.message, p.text, round(p.relevance, 4)) for p in dog] == [(0, "My dog is called Biscuit.", 1.0)]


def test_a_message_already_indexed_is_not_indexed_again():
    index = filled_index()
    size = len(index.passages)
    index.add(0, "user", "something else entirely")
    assert len(index.passages) == size and index.indexed_messages == 8


def test_the_note_keeps_the_budget_and_the_conversation_order():
    found = [Passage(6, "user", "B b b."), Passage(0, "user", "A a."), Passage(3, "assistant", "C c c c c c.")]
    count = len  # one token per character
    note = recall_note(found, count, budget=len(NOTE_HEADING) + len("I said: B b b.") + len("I said: A a."))
    assert note == RecalledNote(messages=(0, 6), text=f"{NOTE_HEADING}\nI said: A a.\nI said: B b b.")
    assert recall_note(found, count, budget=len(NOTE_HEADING) + 3) is None
    two = recall_note(found, count, budget=1000, most=2)
    assert two is not None and two.messages == (0, 6)
    third = recall_note(found[2:], count, budget=1000)
    assert third is not None and third.text == f"{NOTE_HEADING}\nYou said: C c c c c c."
    assert fed_text("Q?", third) == f"{NOTE_HEADING}\nYou said: C c c c c c.\n\nQ?"
    assert fed_text("Q?", None) == "Q?"
    assert turn_numbers([0, 1, 6, 13]) == [1, 4, 7]


def forgotten(messages: int, partly: int | None = None) -> CacheView:
    """A view of a cache that forgot the first `messages` messages whole (and `partly` in part)."""
    return CacheView((), (), forgotten_tokens=1, forgotten_messages=messages, partly_forgotten_message=partly)


def test_the_forgotten_messages_are_indexed_as_they_leave_and_searched_but_not_those_a_note_brought_back():
    transcript = [
        {"role": "user", "content": FACT},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "The door code is 4471."},
        {"role": "assistant", "content": "Got it."},
    ]
    index = RecallIndex()
    assert index.search_forgotten(transcript, forgotten(0), {}, "What is the door code?") == []
    assert index.indexed_messages == 0  # nothing left the cache: nothing indexed
    # Message 2 partly evicted: it can be recalled, and is indexed; message 3 is still whole in the window.
    found = index.search_forgotten(transcript, forgotten(2, partly=2), {}, "What is the door code?")
    assert [passage.message for passage in found] == [2] and index.indexed_messages == 3
    # A note read with message 3, still in the window, holds message 0: the model sees it, it is not recalled again.
    note = RecalledNote(messages=(0,), text=f"{NOTE_HEADING}\nI said: {FACT}")
    assert index.search_forgotten(transcript, forgotten(3), {3: note}, "What is my sister's name?") == []
    assert [p.message for p in index.search_forgotten(transcript, forgotten(3), {}, "What is my sister's name?")] == [0]


def test_an_index_is_kept_only_for_a_conversation_that_begins_with_what_it_indexed():
    before = [{"role": "user", "content": FACT}, {"role": "assistant", "content": "Noted."}]
    index = RecallIndex()
    index.add(0, "user", FACT)
    assert index.kept_for(before, [*before, {"role": "user", "content": "More."}]) is index
    assert index.kept_for(before, before[:1]) is index
    other = index.kept_for(before, [{"role": "user", "content": "Something else."}])
    assert other is not index and other.indexed_messages == 0 and other.passages == []
    assert index.kept_for(before, []) is not index  # shorter than what it indexed


def test_a_note_takes_a_share_of_the_window_up_to_the_budget():
    assert note_budget(100) == 25
    assert note_budget(100_000) == 96


def test_the_cache_reads_each_user_message_with_its_note_and_the_event_counts_what_the_note_adds():
    chat_format = chat_format_for(byte_level_tokenizer(), None)
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    note = RecalledNote(messages=(0, 5), text=f"{NOTE_HEADING}\nI said: {FACT}")
    assert fed_ids(chat_format, messages, {}) == chat_format.conversation_ids(messages)
    with_note = [{"role": "user", "content": fed_text("Q?", note)}, messages[1]]
    assert fed_ids(chat_format, messages, {0: note}) == chat_format.conversation_ids(with_note)
    added = len(chat_format.prompt_ids(fed_text("Q?", note), first_turn=False))
    added -= len(chat_format.prompt_ids("Q?", first_turn=False))
    assert added > 0 and recalled_event(chat_format, "Q?", note) == Recalled(passages=2, turns=(1, 3), tokens=added)


# ---- a session that recalls -------------------------------------------------------------------


def make_session(recall: str, window: int = 256) -> ChatSession:
    model = tiny_model("llama", vocab_size=700)
    return session_under_test(
        model, byte_level_tokenizer(), SessionOptions(window=window, settings=GREEDY, recall=recall)
    )


def evict_the_fact(session: ChatSession) -> None:
    list(session.chat(FACT))
    turn = 0
    while session.cache_view().forgotten_messages < 2:
        list(session.chat(FILLER[turn % len(FILLER)]))
        turn += 1


def test_recall_off_feeds_exactly_what_a_session_without_recall_feeds():
    off, auto = make_session("off"), make_session("auto")
    evict_the_fact(off)
    evict_the_fact(auto)
    assert off.cache_view().token_ids == auto.cache_view().token_ids  # no message needed recall so far
    events = list(off.chat("What is my sister's name?"))
    assert not any(isinstance(event, Recalled) for event in events) and off.recalled == {}
    prompt = off.chat_format.prompt_ids("What is my sister's name?", first_turn=False)
    window = off.cache_view().token_ids
    assert any(window[start : start + len(prompt)] == prompt for start in range(len(window)))


def test_recall_on_reads_the_note_before_the_message_and_says_so():
    session = make_session("auto")
    evict_the_fact(session)
    question = "What is my sister's name?"
    before = len(session.cache_view().token_ids)
    events = list(session.chat(question))
    recalled = [event for event in events if isinstance(event, Recalled)]
    index = len(session.transcript) - 2
    note = RecalledNote(messages=(0,), text=f"{NOTE_HEADING}\nI said: {FACT}")
    assert session.recalled == {index: note}
    fed = session.chat_format.prompt_ids(fed_text(question, note), first_turn=False)
    plain = session.chat_format.prompt_ids(question, first_turn=False)
    assert recalled == [Recalled(passages=1, turns=(1,), tokens=len(fed) - len(plain))]
    assert isinstance(events[-1], TurnFinished) and events[-1].stats.prompt_tokens == len(fed)
    assert session.transcript[index] == {"role": "user", "content": question}  # the transcript holds what was typed
    assert before > 0 and session.snapshot().recalled == {index: note}
    # The note is in the window now: asked again, nothing is recalled again.
    again = list(session.chat(question))
    assert not any(isinstance(event, Recalled) for event in again)


def test_a_restored_or_replayed_conversation_reads_its_notes_again_exactly():
    session = make_session("auto")
    evict_the_fact(session)
    list(session.chat("What is my sister's name?"))
    state = session.snapshot()
    other = make_session("auto")
    list(other.restore(state))
    assert other.recalled == session.recalled and other.cache_view().token_ids == session.cache_view().token_ids
    replayed = make_session("auto")
    list(replayed.restore(session.snapshot(tensors=False)))
    assert replayed.recalled == session.recalled
    # The end of the conversation, notes included.
    assert replayed.cache_view().token_ids == session.cache_view().token_ids
    # The same reply, next, from each.
    replies = [list(s.chat("Thanks."))[-1].reply for s in (session, other)]
    assert replies[0] == replies[1]


def test_recall_modes_are_checked_and_set_as_options():
    with pytest.raises(ConfigError, match=r"^recall must be one of auto, off, got 'sometimes'$"):
        make_session("sometimes")
    session = make_session("auto")
    session.update_settings(recall="off")
    assert session.recall == "off"
