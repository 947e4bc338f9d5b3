"""Terminal-safe text: every control character and escape sequence made visible and harmless."""

import io
import re

import pytest
from rich.console import Console

from streamchat.interface.safe_text import safe_plain, safe_text, terminal_safe

# Each class of hostile sequence, and what the user sees in its place.
HOSTILE = [
    ("CSI clear screen", "\x1b[2J", "␛[2J"),
    ("CSI with parameters", "\x1b[38;5;196m", "␛[38;5;196m"),
    ("OSC 52 clipboard, BEL", "\x1b]52;c;aGVsbG8=\x07", "␛]52;c;aGVsbG8=␇"),
    ("OSC 0 window title, ST", "\x1b]0;pwned\x1b\\", "␛]0;pwned␛\\"),
    ("OSC 8 hidden link", "\x1b]8;;http://evil.example\x1b\\", "␛]8;;http://evil.example␛\\"),
    ("DCS", "\x1bP1$r\x1b\\", "␛P1$r␛\\"),
    ("SOS", "\x1bXsos\x1b\\", "␛Xsos␛\\"),
    ("PM", "\x1b^pm\x1b\\", "␛^pm␛\\"),
    ("APC", "\x1b_apc\x1b\\", "␛_apc␛\\"),
    ("plain ESC x (reset)", "\x1bc", "␛c"),
    ("ESC with intermediate (charset)", "\x1b(0", "␛(0"),
    ("C1 CSI", "\x9b2J", "␛[2J"),
    ("C1 OSC ended by C1 ST", "\x9d0;t\x9c", "␛]0;t␛\\"),
    ("C0 controls", "\x00\x07\x08\r\x0b\x0c", "␀␇␈␍␋␌"),
    ("DEL", "\x7f", "␡"),
    ("bidi override", "\u202e", "⟨RLO⟩"),
    ("bidi isolates", "\u2066\u2067\u2068\u2069", "⟨LRI⟩⟨RLI⟩⟨FSI⟩⟨PDI⟩"),
    ("bidi embeddings", "\u202a\u202b\u202c\u202d", "⟨LRE⟩⟨RLE⟩⟨PDF⟩⟨LRO⟩"),
]


@pytest.mark.parametrize(("name", "sequence", "shown"), HOSTILE, ids=[name for name, _, _ in HOSTILE])
def test_each_class_of_sequence_becomes_one_visible_marker(name, sequence, shown):
    assert terminal_safe(f"before{sequence}after") == [("before", False), (shown, True), ("after", False)]


def test_newline_and_tab_and_any_printable_text_pass_unchanged():
    text = "Line one\n\tindented: café, 東京, 🙂, «quotes» [markup]\n"
    assert terminal_safe(text) == [(text, False)]
    assert safe_plain(text) == text


def test_an_unterminated_string_marks_up_to_the_end_of_its_line():
    assert terminal_safe("a\x1b]0;title\nb") == [("a", False), ("␛]0;title", True), ("\nb", False)]
    assert terminal_safe("ends in ESC\x1b") == [("ends in ESC", False), ("␛", True)]


def test_text_cut_anywhere_is_as_safe_as_the_whole():
    text = "x\x1b]52;c;aGk=\x07y\x1b[2Jz"
    for cut in range(len(text) + 1):
        assert safe_plain(text[:cut]) + safe_plain(text[cut:]) == safe_plain(text)


def test_a_terminal_receives_only_the_style_codes_rich_writes_itself():
    hostile = "".join(f"{sequence}{name}" for name, sequence, _ in HOSTILE)
    screen = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=2000)
    screen.print(safe_text(hostile))
    output = screen.file.getvalue()
    assert re.sub(r"\x1b\[[0-9;]*m", "", output) == safe_plain(hostile) + "\n"
    assert not set(output) & {"\x07", "\x9b", "\x9d", "\u202e"}


def test_markers_are_dimmed_and_the_rest_keeps_its_style():
    text = safe_text("a\x1b[2Jb", style="red")
    assert text.plain == "a␛[2Jb"
    assert [(span.start, span.end, span.style) for span in text.spans] == [(1, 5, "dim")]
    assert text.style == "red"
