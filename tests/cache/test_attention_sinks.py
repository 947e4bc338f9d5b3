"""The paper's effect on the real default model: sinks keep perplexity low when the window rolls."""

import math
from pathlib import Path

import pytest

from streamchat.measure.perplexity import streaming_nll

# Chapters 1-3 of Pride and Prejudice (public domain, from Project Gutenberg's text): about 3,000 tokens.
TEXT = Path(__file__).resolve().parents[1] / "support" / "texts" / "pride-and-prejudice-chapters-1-3.txt"


@pytest.mark.slow
@pytest.mark.default_model
def test_sinks_halve_perplexity_over_window_attention(default_model):
    ids = default_model.tokenizer(TEXT.read_text(encoding="utf-8"), return_tensors="pt").input_ids
    ids = ids[:, :2048]
    with_sinks = math.exp(streaming_nll(default_model.model, ids, sinks=4, window=252, chunk=32).mean())
    window_only = math.exp(streaming_nll(default_model.model, ids, sinks=0, window=256, chunk=32).mean())
    print(f"\n2048 tokens, cache 256: sinks 4+252 PPL {with_sinks:.2f}, window 0+256 PPL {window_only:.2f}")
    assert window_only >= 1.5 * with_sinks
