"""Tiny chat models: saved as real model directories, for driving the installed `streamchat` command,
or in memory (the scripted one), for driving the chat in-process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from tests.support.models import tiny_model
from tests.support.tokenizers import CHATML_TEMPLATE, _wrap_byte_level, byte_level_tokenizer

VOCAB = 700  # covers the offline byte-level tokenizer (600 tokens)


def save_tiny_chat_model(directory: Path) -> Path:
    """A random llama with a ChatML tokenizer that never ends a reply by itself, greedy or sampled.

    One feature of the residual stream is a constant no layer writes (every embedding holds it, every
    layer's output rows for it are zero), so after the final norm it is always positive. The output rows
    of the tokenizer's special tokens (the reply-ending ones among them) read only that feature, strongly
    negated: their logits are far below every other, and no temperature, top-p or seed draws them. Replies
    run to the length limit, and a test can interrupt them.
    """
    tokenizer = byte_level_tokenizer()
    model = tiny_model("llama", vocab_size=VOCAB)
    special = sorted(set(tokenizer.all_special_ids) | {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["model.embed_tokens.weight"][:, 0] = 0.1  # the constant feature: dimension 0
    for name in state:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            state[name][0] = 0  # no layer writes it
    head = state["lm_head.weight"]
    head[:, 0] = 0  # other tokens do not read it
    head[special] = 0
    head[special, 0] = -50.0
    model.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
    return directory


# A reply with every class of sequence a terminal acts on, each piece one token.
HOSTILE_REPLY_PIECES = (
    "Look",
    "\x1b[2J",  # CSI: clear the screen
    " csi",
    "\x1b]52;c;aGk=\x07",  # OSC 52: write the clipboard
    " clip",
    "\x1b]0;pwned\x1b\\",  # OSC 0: retitle the window
    " title",
    "\x1b]8;;http://evil.example\x1b\\",  # OSC 8: a hidden link
    " link",
    "\x1bP1$r\x1b\\",  # DCS
    "\x1b_apc\x1b\\",  # APC
    "\x1bXsos\x1b\\",  # SOS
    "\x1b^pm\x1b\\",  # PM
    "\x1bc",  # ESC c: reset the terminal
    "\x9b31m",  # C1 CSI
    " bidi",
    "\u202e",  # right-to-left override
    "evil",
    "\u2066",  # left-to-right isolate
    " end",
    "\x07",  # BEL
)


def scripted_model_and_tokenizer(pieces: tuple[str, ...] = HOSTILE_REPLY_PIECES) -> tuple[Any, PreTrainedTokenizerFast]:
    """A tiny llama and its tokenizer, in memory, whose greedy reply to any message is `pieces` joined,
    then the end of turn (which ends the reply: stop reason "eos").

    Each piece is a token of its own (added to the ChatML tokenizer), and the model maps
    the last token it sees to the next one of the script: embeddings put each script token
    on its own axis, attention and MLP outputs are zero so the residual stream stays that
    axis, and the output head points each axis at the following token. The script starts
    after the newline that ends every prompt, and ends with <|im_end|>. A piece may not hold
    a newline (the newline starts the script), and pieces must be distinct tokens.
    """
    tokenizer = _wrap_byte_level(CHATML_TEMPLATE)
    tokenizer.add_tokens(list(pieces))
    start = tokenizer.convert_tokens_to_ids("Ċ")  # the byte-level newline: the last token of a prompt
    chain = [start, *tokenizer.convert_tokens_to_ids(list(pieces))]
    if len(set(chain)) != len(chain):
        raise ValueError("each piece of the script must be a distinct token")
    following = [*chain[1:], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model = copy.deepcopy(tiny_model("llama", vocab_size=VOCAB))  # the cached one is shared: left as it is
    hidden = model.config.hidden_size
    if len(chain) > hidden:
        raise ValueError(f"a script of {len(chain)} tokens needs a hidden size of at least that")
    state = model.state_dict()
    with torch.no_grad():
        state["model.embed_tokens.weight"].zero_()
        state["lm_head.weight"].zero_()
        for axis, (token, next_token) in enumerate(zip(chain, following, strict=True)):
            state["model.embed_tokens.weight"][token, axis] = 1.0
            state["lm_head.weight"][next_token, axis] = 10.0
        for name, tensor in state.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensor.zero_()
    return model, tokenizer


def save_scripted_chat_model(directory: Path, pieces: tuple[str, ...] = HOSTILE_REPLY_PIECES) -> Path:
    """scripted_model_and_tokenizer(pieces), saved as a model directory that `streamchat run --model` loads."""
    model, tokenizer = scripted_model_and_tokenizer(pieces)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
