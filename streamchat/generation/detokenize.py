"""Streaming text from token ids, one token at a time.

Decoding each token on its own goes wrong in three ways: an emoji or CJK character
spread over several byte tokens decodes as U+FFFD until its last byte arrives;
SentencePiece decoders drop the space of a leading "▁", so "▁world" alone reads
"world" where the reply reads " world"; and a byte-fallback decoder turns a whole run
of "<0xNN>" tokens into U+FFFDs as soon as one byte of the run is invalid, changing
text that looked finished. Re-decoding the whole reply each token is right but
quadratic. The detokenizer below decodes a short window instead, like vLLM: the
tokens shown last (for context) plus the tokens not yet shown, and emits what the
window's text adds past its shown part. It holds tokens back while the text ends in
an incomplete character or a byte run that may go on. The window slides forward
after every emitted delta, so each token costs O(1) amortised.

Invariant: the deltas of push() followed by flush() join to
tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False),
which is decode(ids, skip_special_tokens=True) for transformers 5 tokenizers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# What a decoder writes for a byte sequence that is not (yet) valid UTF-8.
_REPLACEMENT_CHARACTER = "\ufffd"
# A SentencePiece byte-fallback token, as tokenizers' ByteFallback decoder recognises it.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids decode(skip_special_tokens=True) drops: named special tokens plus added ones
    marked special (Llama 3's <|eot_id|>, SmolLM2's <|im_end|> are only the latter)."""
    added = (token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(tokenizer.all_special_ids).union(added)


class IncrementalDetokenizer:
    """Turns one reply's token ids into text deltas that never split a character.

    Use one per reply: push() each generated token, then flush() once at the end.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._special_ids = special_token_ids(tokenizer)
        self._window: list[int] = []  # shown tokens kept as context, then unshown ones
        self._shown = 0  # how many tokens at the start of the window are already shown

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete)."""
        # Special tokens decode to nothing, and would otherwise start a window whose first
        # real token loses its SentencePiece space as if it began the text.
        if token_id in self._special_ids:
            return ""
        self._window.append(token_id)
        if _BYTE_TOKEN.fullmatch(cast(str, self._tokenizer.convert_ids_to_tokens(token_id))):  # one id: one token
            return ""  # the run of byte tokens decodes as a whole once it ends
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back, even if it ends in an incomplete character; call it last."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        shown_text = self._decode(self._window[: self._shown])
        text = self._decode(self._window)
        if not final and text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        # The newly shown tokens become the context of the next window.
        self._window = self._window[self._shown :]
        self._shown = len(self._window)
        return text[len(shown_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        text = self._tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return cast(str, text)  # one sequence of ids: one text
