"""A tiny GGUF model file, written with the `gguf` package, for conversion tests.

It carries everything transformers' GGUF loader reads: the llama hyperparameters, a
byte-level BPE tokenizer (every byte, a few merges, ChatML control tokens) with a chat
template, and random weights under llama.cpp's tensor names, quantized like the default
model's. Converting it takes about a second, so tests can exercise the real conversion path.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

HIDDEN_SIZE = 32
INTERMEDIATE_SIZE = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
CONTEXT_LENGTH = 256
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MERGES = ("h e", "l l", "he ll", "Ġ w")


def _vocabulary() -> list[str]:
    """Special tokens first (ids 0-2), then the 256 bytes as GPT-2 spells them, then one token per merge."""
    byte_spelling = bytes_to_unicode()
    merged = ["".join(merge.split(" ")) for merge in _MERGES]
    return [*_SPECIAL_TOKENS, *(byte_spelling[byte] for byte in range(256)), *merged]


def write_tiny_gguf(path: Path, *, seed: int = 0, architecture: str = "llama") -> Path:
    """Write a two-layer model with a 263-token vocabulary to `path`; return `path`.

    The tensors follow llama's layout whatever `architecture` says: another architecture
    only serves tests that refuse the file from its metadata, before any tensor is read.
    """
    tokens = _vocabulary()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE_SIZE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN_SIZE // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(list(_MERGES))
    control = len(_SPECIAL_TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * control + [gguf.TokenType.NORMAL] * (len(tokens) - control))
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_chat_template(CHAT_TEMPLATE)

    head_dim = HIDDEN_SIZE // HEADS
    # Shapes in torch order (out_features, in_features); the writer reverses them for ggml.
    shapes = {"token_embd.weight": (len(tokens), HIDDEN_SIZE), "output_norm.weight": (HIDDEN_SIZE,)}
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        shapes |= {
            f"{block}.attn_norm.weight": (HIDDEN_SIZE,),
            f"{block}.attn_q.weight": (HEADS * head_dim, HIDDEN_SIZE),
            f"{block}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN_SIZE),
            f"{block}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN_SIZE),
            f"{block}.attn_output.weight": (HIDDEN_SIZE, HEADS * head_dim),
            f"{block}.ffn_norm.weight": (HIDDEN_SIZE,),
            f"{block}.ffn_gate.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{block}.ffn_up.weight": (INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{block}.ffn_down.weight": (HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    for tensor_name, shape in shapes.items():
        if len(shape) == 1:
            # Norm weights near 1, kept in F32 as llama.cpp does.
            writer.add_tensor(tensor_name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            # Matrices in Q4_1, the default model's quantization, so conversion has to dequantize.
            values = (0.2 * rng.standard_normal(shape)).astype(np.float32)
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
            writer.add_tensor(tensor_name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
