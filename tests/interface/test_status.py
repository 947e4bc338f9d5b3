import pytest

from streamchat.generation.events import CacheStats
from streamchat.interface.status import (
    BAR_CHARACTERS,
    bar_segments,
    first_words,
    fit_status,
    last_words,
    status_figures,
)


def bar_text(stats, width):
    return "".join(BAR_CHARACTERS[name] * cells for name, cells in bar_segments(stats, width))


def stats(sinks=4, window_used=0, window=2000, seen=0, evicted=0):
    return CacheStats(sinks, 4, window_used, window, seen, evicted)


def test_segments_are_proportional_and_fill_the_width():
    assert bar_segments(stats(window_used=1000), 40) == [("sinks", 1), ("window", 19), ("free", 20)]
    assert bar_segments(stats(window_used=2000), 40) == [("sinks", 1), ("window", 39)]


def test_an_empty_cache_is_all_free_and_sinks_always_show():
    assert bar_segments(stats(sinks=0), 10) == [("free", 10)]
    assert bar_text(stats(sinks=2, window_used=0), 10) == "▓░░░░░░░░░"


def test_figures_read_like_the_issue_says():
    figures = status_figures(stats(window_used=1873, seen=18342, evicted=16465), 17.34)
    assert figures.occupancy == "4 sinks | 1,873/2,000 window | 127 free"
    assert (figures.streamed, figures.evicted, figures.speed) == ("18,342 streamed", "16,465 evicted", "17.3 tok/s")
    assert status_figures(stats()).speed == ""


@pytest.mark.parametrize(
    ("columns", "kept"),
    [(160, 4), (110, 4), (90, 3), (70, 1), (40, 0)],
)
def test_narrow_terminals_drop_figures_before_the_bar(columns, kept):
    width, figures = fit_status(stats(window_used=1873, seen=18342, evicted=16465), 17.3, columns)
    assert len(figures) == kept
    assert 10 <= width <= 40
    assert width + sum(len(f) + 3 for f in figures) <= max(columns, 10 + 1)


def test_previews_cut_at_a_word_boundary_when_there_is_one():
    assert first_words("the old house at the end", 12) == "the old"
    assert first_words("the old house", 13) == "the old house"
    assert last_words("the old house at the end", 12) == "at the end"
    assert first_words("長い長い文章", 3) == "長い長"
