"""CacheView: the cache's record read as transcript messages (labels count up along the stream)."""

from __future__ import annotations

from streamchat.cache.ledger import NO_LABEL
from streamchat.cache.record import HeldTokens
from streamchat.generation.cache_view import CacheView


def test_nothing_forgotten():
    view = CacheView.of(HeldTokens((1, 2), (0, 0), (3, 4), (0, 1), forgotten=0, last_forgotten_label=NO_LABEL))
    assert view == CacheView((1, 2), (3, 4), forgotten_tokens=0, forgotten_messages=0, partly_forgotten_message=None)
    assert view.token_ids == [1, 2, 3, 4]


def test_the_window_starts_inside_a_message_whose_beginning_left():
    view = CacheView.of(HeldTokens((1,), (0,), (7, 8, 9), (2, 2, 3), forgotten=5, last_forgotten_label=2))
    assert view == CacheView((1,), (7, 8, 9), forgotten_tokens=5, forgotten_messages=2, partly_forgotten_message=2)


def test_the_window_starts_at_a_whole_message():
    view = CacheView.of(HeldTokens((1,), (0,), (7, 8), (3, 3), forgotten=5, last_forgotten_label=2))
    assert (view.forgotten_messages, view.partly_forgotten_message) == (3, None)


def test_an_empty_window_after_a_skip_counts_the_skipped_message_as_partly_forgotten():
    # A long prompt's middle skipped before anything of its tail entered the window.
    view = CacheView.of(HeldTokens((1, 2), (0, 0), (), (), forgotten=40, last_forgotten_label=1))
    assert (view.forgotten_messages, view.partly_forgotten_message) == (2, None)
