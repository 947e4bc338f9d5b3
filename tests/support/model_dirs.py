"""A tiny chat model saved as a real model directory, for driving the installed `streamchat` command."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer

VOCAB = 700  # covers the offline byte-level tokenizer (600 tokens)


def save_tiny_chat_model(directory: Path) -> Path:
    """A random llama with a ChatML tokenizer that never ends a reply by itself.

    Its output rows for the tokenizer's special tokens are zeroed: among hundreds of
    random logits, a logit of 0 is never the largest, so replies run to the length
    limit and a test can interrupt them.
    """
    tokenizer = byte_level_tokenizer()
    model = tiny_model("llama", vocab_size=VOCAB)
    special = sorted(set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    with torch.no_grad():
        weights = model.get_output_embeddings().weight.clone()
        weights[special] = 0
    state = {**model.state_dict(), "lm_head.weight": weights}
    model.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
    return directory
