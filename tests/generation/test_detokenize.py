from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from streamchat.generation.detokenize import IncrementalDetokenizer, special_token_ids
from tests.support.tokenizers import (
    byte_level_tokenizer,
    default_model_tokenizer_or_skip,
    sentencepiece_tokenizer,
)

TOKENIZERS = {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_tokenizer}
TEXT = "Hello world! 🙂 東京は大きい 👍🏽 naïve — ok\n你好，世界！ ❤️ end"


def stream(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


def reference(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def random_streams(tokenizer: PreTrainedTokenizerBase, seed: int, count: int, max_length: int) -> list[list[int]]:
    """Any tokens, with byte-fallback and special tokens over-represented: they are the hard cases."""
    everything = list(range(len(tokenizer)))
    byte_ids = [i for i in everything if tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    pools = [everything, byte_ids or everything, sorted(special_token_ids(tokenizer))]
    rng = random.Random(seed)
    return [
        [rng.choice(rng.choices(pools, weights=[6, 3, 1])[0]) for _ in range(rng.randrange(1, max_length + 1))]
        for _ in range(count)
    ]


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_deltas_join_to_the_decoded_text(tokenizer_name: str) -> None:
    tokenizer = TOKENIZERS[tokenizer_name]()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)


def test_multi_token_emoji_arrives_whole() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "ðŁ", "ĻĤ"]  # the emoji's bytes: 2 + 2
    assert stream(tokenizer, ids) == ["a", "", "🙂", ""]


def test_byte_fallback_character_arrives_whole_after_its_run() -> None:
    # A run of <0xNN> tokens decodes as a whole, so the run is shown once it has ended.
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["▁The", "▁", "<0xF0>", "<0x9F>", "<0x91>", "<0x8D>", "▁dog"])
    assert stream(tokenizer, ids) == ["The", " ", "", "", "", "", "👍 dog", ""]


def test_invalid_byte_run_matches_full_decode() -> None:
    # "A" then an unfinished "€": the decoder turns the whole run into U+FFFDs, "A" included.
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["<0x41>", "<0xE2>", "<0x82>", "▁dog"])
    assert "".join(stream(tokenizer, ids)) == reference(tokenizer, ids) == "\ufffd" * 3 + " dog"


def test_sentencepiece_words_keep_their_space() -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["▁The", "▁dog", "▁sle", "eps"])
    assert tokenizer.decode(ids[1:2]) == "dog"  # decoded alone, "▁dog" loses its space
    assert stream(tokenizer, ids) == ["The", " dog", " sle", "eps", ""]


def test_special_tokens_are_skipped_without_eating_the_next_space() -> None:
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["▁The", "</s>", "▁dog"])
    assert stream(tokenizer, ids) == ["The", "", " dog", ""]
    assert reference(tokenizer, ids) == "The dog"


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_random_streams_match_full_decode_at_every_point(tokenizer_name: str) -> None:
    tokenizer = TOKENIZERS[tokenizer_name]()
    for ids in random_streams(tokenizer, seed=0, count=100, max_length=60):
        detokenizer = IncrementalDetokenizer(tokenizer)
        shown = ""
        for count, token_id in enumerate(ids, start=1):
            shown += detokenizer.push(token_id)
            # Shown text is final: the decode of everything so far only ever extends it.
            assert reference(tokenizer, ids[:count]).startswith(shown)
        assert shown + detokenizer.flush() == reference(tokenizer, ids)


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_long_random_stream_matches_full_decode(tokenizer_name: str) -> None:
    tokenizer = TOKENIZERS[tokenizer_name]()
    [ids] = random_streams(tokenizer, seed=1, count=1, max_length=5000)
    assert "".join(stream(tokenizer, ids)) == reference(tokenizer, ids)


class RecordingTokenizer:
    """Passes everything to a tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decode_lengths.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("tokenizer_name", TOKENIZERS)
def test_decode_window_does_not_grow_with_the_reply(tokenizer_name: str) -> None:
    longest_window = {}
    for repeats in (1, 50):
        tokenizer = RecordingTokenizer(TOKENIZERS[tokenizer_name]())
        ids = tokenizer.encode(TEXT * repeats, add_special_tokens=False)
        assert "".join(stream(tokenizer, ids)) == TEXT * repeats  # type: ignore[arg-type]
        longest_window[repeats] = max(tokenizer.decode_lengths)
    # Bounded by the longest run of byte tokens plus context, however long the reply.
    assert longest_window[50] == longest_window[1] < len(ids) / 100


@pytest.mark.default_model
def test_default_model_streams_match_full_decode() -> None:
    smollm2 = default_model_tokenizer_or_skip()
    ids = smollm2.encode(TEXT, add_special_tokens=False)
    deltas = stream(smollm2, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    for ids in random_streams(smollm2, seed=2, count=50, max_length=80):
        assert "".join(stream(smollm2, ids)) == reference(smollm2, ids)
