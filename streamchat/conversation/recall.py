"""Recall: the part of a conversation that has left the cache, searched again when a new message needs it.

    index = RecallIndex()
    index.add(2, "user", "My sister's name is Ilse.")        # message 2 was evicted
    found = index.search("What is my sister's name?")         # [Passage(...)], best first, above the bar
    # A session's search: the messages its cache forgot (a CacheView) indexed as they leave it.
    found = index.search_forgotten(transcript, view, recalled, "What is my sister's name?")
    note = recall_note(found, count_tokens, budget=96)         # RecalledNote, or None when nothing fits
    fed_text("What is my sister's name?", note)                # what the chat template renders for the turn

A passage is a turn-sized piece of one evicted message (the whole message, or a run of
its sentences when it is long). The search is BM25 over those passages, kept as an
inverted index that grows by one passage at a time: the evicted part of a conversation
only grows, and re-indexing all of it for every turn (what a static BM25 index such as
bm25s' asks for) would cost more with every turn than the search itself.

A passage is recalled when it holds enough of the query's word weight: the inverse document
frequencies of the query's words it contains, over those of all the query's words, must reach
RECALL_MIN_RELEVANCE (defaults.py; measured by scripts/recall_search_check.py on the bench's
facts and distractors). A query word no passage holds weighs the most (it is the most specific),
so a question about something never said ("What is my cat called?") holds little of what was
("My dog is called Biscuit." shares only "called"). A word found in a passage longer than the
average counts only BM25's length-normalised share of its weight (buried among more words);
in a shorter one, never more than all of it. The passages that clear the bar are ranked by
their BM25 score. The bar is not on that score itself: BM25 rewards a short passage beyond its
words' weight, so one shared common word in a short passage could clear it.

Recall brings back text the conversation already had; it is not a longer context. The note
is read through the cache as part of the user's turn, counts against the window and is
evicted like everything else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamchat import defaults
from streamchat.conversation.message import Message
from streamchat.conversation.state import RecalledNote
from streamchat.generation.events import Recalled

if TYPE_CHECKING:
    from streamchat.conversation.template import ChatFormat
    from streamchat.generation.cache_view import CacheView

# BM25's usual constants: term frequency saturation and length normalisation.
_K1 = 1.2
_B = 0.75
_WORD = re.compile(r"\w+")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
# Words that say nothing about what a passage is about.
_STOPWORD_TEXT = """a about above after again all am an and any are as at be been before being below
    between both but by can
    could did do does doing down during each few for from had has have having he her here hers herself him himself
    his how i if in into is it its itself just let me more most my myself no nor not now of off on once only or
    other our ours ourselves out over own same she should so some such than that the their theirs them themselves
    then there these they this those through to too under until up very was we were what when where which while who
    whom why will with would you your yours yourself yourselves tell told remember said say please know"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())

NOTE_HEADING = "Earlier in this conversation:"
_SPEAKERS = {"user": "I said", "assistant": "You said"}


@dataclass(frozen=True)
class Passage:
    """A turn-sized piece of an evicted message."""

    message: int  # its index in the transcript
    role: str  # "user" or "assistant"
    text: str
    relevance: float = 0.0  # in a search's answer: the share of the query's word weight (idf) it holds


def words(text: str) -> list[str]:
    """The words BM25 counts: lower case, stopwords and single letters left out, a plain ending cut off."""
    return [_stem(word) for word in _WORD.findall(text.lower()) if len(word) > 1 and word not in _STOPWORDS]


def _stem(word: str) -> str:
    """parked, parking, parks: park. Crude on purpose: the same cut for a word wherever it is written."""
    for ending in ("ing", "ed", "s"):
        if word.endswith(ending) and len(word) - len(ending) >= 3 and not word.endswith("ss"):
            return word[: -len(ending)]
    return word


def passages_of(text: str, most_words: int = defaults.RECALL_PASSAGE_WORDS) -> list[str]:
    """`text` cut into runs of whole sentences of at most `most_words` words (a longer sentence stands alone)."""
    pieces: list[str] = []
    current: list[str] = []
    count = 0
    for sentence in (part.strip() for part in _SENTENCE_END.split(text)):
        if not sentence:
            continue
        length = len(sentence.split())
        if current and count + length > most_words:
            pieces.append(" ".join(current))
            current, count = [], 0
        current.append(sentence)
        count += length
    if current:
        pieces.append(" ".join(current))
    return pieces


class RecallIndex:
    """BM25 over the passages of evicted messages, added one message at a time."""

    def __init__(self) -> None:
        self.passages: list[Passage] = []
        self.indexed_messages = 0  # messages 0..indexed_messages-1 are in the index
        self._postings: dict[str, dict[int, int]] = {}  # word -> {passage: occurrences}
        self._lengths: list[int] = []
        self._total_length = 0

    def add(self, message: int, role: str, text: str) -> None:
        """Index message `message` (messages come in order; one already indexed is ignored)."""
        if message < self.indexed_messages:
            return
        self.indexed_messages = message + 1
        for piece in passages_of(text):
            number = len(self.passages)
            counted = words(piece)
            self.passages.append(Passage(message, role, piece))
            self._lengths.append(len(counted))
            self._total_length += len(counted)
            for word in counted:
                postings = self._postings.setdefault(word, {})
                postings[number] = postings.get(number, 0) + 1

    def search_forgotten(
        self,
        transcript: list[Message],
        view: CacheView,
        recalled: dict[int, RecalledNote],
        query: str,
        bar: float = defaults.RECALL_MIN_RELEVANCE,
    ) -> list[Passage]:
        """The passages of the messages the cache forgot (`view`) relevant to `query`, best first; each message of
        `transcript` is indexed as it leaves the cache. What a note still in the window brought back (`recalled`,
        by the message it was read with) is left out: the model still sees it."""
        partly = view.partly_forgotten_message
        evicted = min(view.forgotten_messages if partly is None else partly + 1, len(transcript))
        for number in range(self.indexed_messages, evicted):
            self.add(number, transcript[number]["role"], transcript[number]["content"])
        in_view = {message for at, note in recalled.items() if at >= evicted for message in note.messages}
        return [found for found in self.search(query, bar) if found.message < evicted and found.message not in in_view]

    def kept_for(self, before: list[Message], after: list[Message]) -> RecallIndex:
        """This index for the conversation `after` when it begins with every message indexed of `before` (the same
        conversation again: a benchmark's probe taken back), else a new, empty one."""
        indexed = self.indexed_messages
        same = len(after) >= indexed and before[:indexed] == after[:indexed]
        return self if same else RecallIndex()

    def search(self, query: str, bar: float = defaults.RECALL_MIN_RELEVANCE) -> list[Passage]:
        """The passages relevant to `query`, best BM25 score first: those that hold at least `bar` of the query's
        word weight (the idf of the query's words they contain over that of all its words; a word found in a
        passage longer than the average counts BM25's share of it, never more than all of it)."""
        count = len(self.passages)
        terms = set(words(query))
        if not count or not terms:
            return []
        average = self._total_length / count or 1.0
        scores: dict[int, float] = {}
        covered: dict[int, float] = {}
        total_weight = 0.0
        for term in terms:
            postings = self._postings.get(term, {})
            # A word in no passage gets the highest idf there is: the query asks for something never said.
            idf = math.log(1.0 + (count - len(postings) + 0.5) / (len(postings) + 0.5))
            total_weight += idf
            for number, frequency in postings.items():
                norm = _K1 * (1.0 - _B + _B * self._lengths[number] / average)
                saturation = frequency * (_K1 + 1.0) / (frequency + norm)  # above 1 in a short passage
                scores[number] = scores.get(number, 0.0) + idf * saturation
                # A word counts its full weight at most: a short passage does not make it weigh more,
                # one buried in a long passage weighs less.
                covered[number] = covered.get(number, 0.0) + idf * min(1.0, saturation)
        ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
        found = []
        for number, _ in ranked:
            relevance = covered[number] / total_weight
            if relevance >= bar:
                passage = self.passages[number]
                found.append(Passage(passage.message, passage.role, passage.text, relevance))
        return found


def note_budget(window: int) -> int:
    """How many tokens a note may take in a cache of `window` tokens: a share of it, never above the budget."""
    return min(defaults.RECALL_TOKEN_BUDGET, int(window * defaults.RECALL_WINDOW_SHARE))


def recall_note(
    found: Iterable[Passage],
    count_tokens: Callable[[str], int],
    budget: int = defaults.RECALL_TOKEN_BUDGET,
    most: int = defaults.RECALL_MAX_PASSAGES,
) -> RecalledNote | None:
    """The note that brings back the best of `found` within `budget` tokens (at most `most` passages), in
    conversation order; None when none fits."""
    chosen: list[Passage] = []
    used = count_tokens(NOTE_HEADING)
    for passage in found:
        if len(chosen) == most:
            break
        cost = count_tokens(_line(passage))
        if used + cost <= budget:
            chosen.append(passage)
            used += cost
    if not chosen:
        return None
    chosen.sort(key=lambda passage: passage.message)
    text = "\n".join([NOTE_HEADING, *(_line(passage) for passage in chosen)])
    return RecalledNote(messages=tuple(passage.message for passage in chosen), text=text)


def fed_text(user_text: str, note: RecalledNote | None) -> str:
    """The user's turn as the chat template renders it: the note, when there is one, before the message."""
    return user_text if note is None else f"{note.text}\n\n{user_text}"


def fed_messages(messages: list[Message], recalled: dict[int, RecalledNote]) -> list[Message]:
    """The messages as the cache reads them: each user message with the note recall read before it."""
    return [
        {"role": "user", "content": fed_text(message["content"], recalled.get(index))}
        if message["role"] == "user"
        else message
        for index, message in enumerate(messages)
    ]


def fed_ids(chat_format: ChatFormat, messages: list[Message], recalled: dict[int, RecalledNote]) -> list[list[int]]:
    """Each message's tokens as the cache reads them in `chat_format`: each user message with its note."""
    return chat_format.conversation_ids(fed_messages(messages, recalled))


def recalled_event(chat_format: ChatFormat, user_text: str, note: RecalledNote) -> Recalled:
    """What the UI is told of `note`: how many messages it brings back, from which turns, how many tokens it adds
    to the user's turn."""
    with_note = chat_format.prompt_ids(fed_text(user_text, note), first_turn=False)
    tokens = len(with_note) - len(chat_format.prompt_ids(user_text, first_turn=False))
    return Recalled(len(note.messages), tuple(turn_numbers(note.messages)), tokens)


def turn_numbers(messages: Iterable[int]) -> list[int]:
    """The turns (1 = the first exchange) that transcript messages belong to, each once, in order."""
    return sorted({message // 2 + 1 for message in messages})


def _line(passage: Passage) -> str:
    return f"{_SPEAKERS.get(passage.role, passage.role)}: {passage.text}"
