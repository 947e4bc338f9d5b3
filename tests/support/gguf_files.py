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


# Where a K-quant block keeps its float16 scales (d, and dmin where it has one), by ggml type: random blocks
# with these set to small values dequantize to sane weights.
_K_QUANT_SCALES = {
    gguf.GGMLQuantizationType.Q4_K: (0, 2),
    gguf.GGMLQuantizationType.Q5_K: (0, 2),
    gguf.GGMLQuantizationType.Q6_K: (208,),
}


def quantized(values: np.ndarray, matrix_type: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """`values` [rows, columns] in `matrix_type`'s blocks: gguf-py's quantization, or for the K-quants (which it
    cannot make) random blocks with sane scales."""
    if matrix_type not in _K_QUANT_SCALES:
        return gguf.quants.quantize(values, matrix_type)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[matrix_type]
    rows, columns = values.shape
    blocks = rng.integers(0, 256, size=(rows, columns // block_size, block_bytes), dtype=np.uint8)
    for start in _K_QUANT_SCALES[matrix_type]:
        blocks[..., start : start + 2] = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    architecture: str = "llama",
    matrix_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_1,
    hidden_size: int = HIDDEN_SIZE,
    embedding_type: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """Write a two-layer model with a 263-token vocabulary to `path`; return `path`.

    The tensors follow llama's layout whatever `architecture` says: another architecture
    only serves tests that refuse the file from its metadata, before any tensor is read.
    Its matrices are in `matrix_type` (the K-quants need a `hidden_size` of 256 or more), its token embedding in
    `embedding_type` (None: `matrix_type`).
    """
    intermediate_size = INTERMEDIATE_SIZE * hidden_size // HIDDEN_SIZE
    tokens = _vocabulary()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(hidden_size // HEADS)
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

    head_dim = hidden_size // HEADS
    # Shapes in torch order (out_features, in_features); the writer reverses them for ggml.
    shapes = {"token_embd.weight": (len(tokens), hidden_size), "output_norm.weight": (hidden_size,)}
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        shapes |= {
            f"{block}.attn_norm.weight": (hidden_size,),
            f"{block}.attn_q.weight": (HEADS * head_dim, hidden_size),
            f"{block}.attn_k.weight": (KV_HEADS * head_dim, hidden_size),
            f"{block}.attn_v.weight": (KV_HEADS * head_dim, hidden_size),
            f"{block}.attn_output.weight": (hidden_size, HEADS * head_dim),
            f"{block}.ffn_norm.weight": (hidden_size,),
            f"{block}.ffn_gate.weight": (intermediate_size, hidden_size),
            f"{block}.ffn_up.weight": (intermediate_size, hidden_size),
            f"{block}.ffn_down.weight": (hidden_size, intermediate_size),
        }
    for tensor_name, shape in shapes.items():
        if len(shape) == 1:
            # Norm weights near 1, kept in F32 as llama.cpp does.
            writer.add_tensor(tensor_name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            # Matrices in Q4_1 by default, the default model's quantization.
            values = (0.2 * rng.standard_normal(shape)).astype(np.float32)
            kind = embedding_type if tensor_name == "token_embd.weight" and embedding_type else matrix_type
            writer.add_tensor(tensor_name, quantized(values, kind, rng), raw_dtype=kind)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_model_directory(gguf: Path, destination: Path) -> Path:
    """The GGUF at `gguf` as a plain transformers model directory (safetensors, config, generation config,
    tokenizer), its weights dequantized as transformers reads them; return `destination`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers marks a model read from GGUF as quantized and refuses to save it, although its weights are
    # already dequantized; dropping that mark is all saving needs.
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(destination)
    return destination
