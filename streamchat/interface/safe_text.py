"""Text bound for a terminal, with every control character made visible and harmless.

A model's reply, a transcript line or a saved session is untrusted: a model can be
steered into writing `ESC [2J` (clear the screen), `ESC ]52;c;...` (write the
clipboard), an OSC 8 link hidden behind innocent text, or a bidi override that makes
text read differently from what it is. `terminal_safe` finds all of them:

- C0 controls except newline and tab, DEL, and C1 controls;
- escape sequences: CSI (`ESC [ ... final`), the strings OSC, DCS, SOS, PM and APC
  (up to BEL, ST or the end of the line), plain `ESC x`, and their C1 forms;
- Unicode bidi embeddings, overrides and isolates (U+202A-202E, U+2066-2069).

Each becomes a marker made of printable characters (ESC is `␛`, other C0 controls their
Control Pictures, C1 controls `␛` and their 7-bit twin, bidi controls their short name),
which the display dims: the user sees that something was there, and the terminal sees
no control character at all. Since every control character is replaced on its own, text
cut anywhere (a reply arriving in pieces) is as safe as the whole.
"""

from __future__ import annotations

import re

from rich.text import Text

# Characters that begin something a terminal would act on.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
ESC = "\x1b"
# CSI: parameter bytes, intermediate bytes, one final byte (ECMA-48 5.4).
_CSI_TAIL = re.compile("[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]")
# Other escape sequences: intermediate bytes and one final byte.
_ESCAPE_TAIL = re.compile("[\x20-\x2f]*[\x30-\x7e]")
# Control strings end at ST (ESC \ or its C1 form) or BEL (xterm); a newline ends the marker
# of one left open, so that a stray introducer does not dim the rest of a reply.
_STRING_END = re.compile("\x07|\x1b\\\\|\x9c|(?=\n)")
_STRING_INTRODUCERS = frozenset("]PX^_")  # OSC, DCS, SOS, PM, APC
# C1 controls that introduce a sequence, as the character that follows ESC in their 7-bit form.
_C1_INTRODUCERS = {"\x9b": "[", "\x9d": "]", "\x90": "P", "\x98": "X", "\x9e": "^", "\x9f": "_"}
_BIDI_NAMES = {
    "\u202a": "LRE",
    "\u202b": "RLE",
    "\u202c": "PDF",
    "\u202d": "LRO",
    "\u202e": "RLO",
    "\u2066": "LRI",
    "\u2067": "RLI",
    "\u2068": "FSI",
    "\u2069": "PDI",
}
MARKER_STYLE = "dim"

Piece = tuple[str, bool]  # (text, whether it is a marker standing for control characters)


def terminal_safe(text: str) -> list[Piece]:
    """`text` as pieces of plain text and markers, none holding a control character but newline and tab."""
    pieces: list[Piece] = []
    position = 0
    while (found := _CONTROL.search(text, position)) is not None:
        start = found.start()
        if start > position:
            pieces.append((text[position:start], False))
        end = _sequence_end(text, start)
        marker = "".join(_visible(character) for character in text[start:end])
        if start == position and pieces and pieces[-1][1]:  # one marker for a run of controls
            marker = pieces.pop()[0] + marker
        pieces.append((marker, True))
        position = end
    if position < len(text):
        pieces.append((text[position:], False))
    return pieces


def safe_plain(text: str) -> str:
    """`text` with its control characters replaced by their markers, unstyled (for files and pipes)."""
    return "".join(piece for piece, _ in terminal_safe(text))


def safe_text(text: str, style: str = "") -> Text:
    """`text` for Rich, in `style`, with its control characters as dimmed markers."""
    rich_text = Text(style=style)
    for piece, is_marker in terminal_safe(text):
        rich_text.append(piece, style=MARKER_STYLE if is_marker else None)
    return rich_text


def _sequence_end(text: str, start: int) -> int:
    """Where the control sequence that begins at `start` ends (exclusive)."""
    character = text[start]
    if character == ESC:
        introducer, body = text[start + 1 : start + 2], start + 2
        tail = _ESCAPE_TAIL.match(text, start + 1)
    elif character in _C1_INTRODUCERS:
        introducer, body, tail = _C1_INTRODUCERS[character], start + 1, None
    else:
        return start + 1
    if introducer == "[":
        csi = _CSI_TAIL.match(text, body)
        return csi.end() if csi else body
    if introducer and introducer in _STRING_INTRODUCERS:
        end = _STRING_END.search(text, body)
        return end.end() if end else len(text)
    return tail.end() if tail else start + 1


def _visible(character: str) -> str:
    code = ord(character)
    if character == ESC:
        return "␛"
    if code < 0x20:
        return chr(0x2400 + code)  # the Control Pictures block: ␀ ␁ ... ␟
    if code == 0x7F:
        return "␡"
    if 0x80 <= code <= 0x9F:
        return "␛" + chr(code - 0x40)  # a C1 control is ESC and its 7-bit twin
    name = _BIDI_NAMES.get(character)
    return f"⟨{name}⟩" if name else character
