#!/usr/bin/env python3
"""Model files of a real size with random weights, to measure how streamchat loads real sizes without the hub.

    python scripts/real_size_models.py smollm2-1.7b safetensors-bf16 models/smollm2-1.7b-bf16
    python scripts/real_size_models.py llama-2-7b gguf-q8_0 models/llama-2-7b-q8_0.gguf
    python scripts/real_size_models.py smollm2-1.7b gguf-q4_0 /tmp/quick.gguf --layers 1

The shapes are a --random-init preset's (streamchat.measure.models.PRESETS, llama family):

- safetensors-bf16: a model directory as the hub has them: config.json (bfloat16),
  generation_config.json, model-0000K-of-0000N.safetensors shards of at most 2 GB with
  model.safetensors.index.json, and a small offline byte-level tokenizer with a ChatML template.
- gguf-q8_0, gguf-q4_0, gguf-q4_1: one GGUF file under llama.cpp's tensor names, matrices in that
  type (the token embedding in Q8_0 for the 4-bit types, as the default model's file has it), norms
  in F32, the same tokenizer padded with unused tokens to the preset's vocabulary size.

Tensors are drawn, written and dropped one at a time (a safetensors shard at a time), so memory
stays near one shard whatever the model's size. --layers, --hidden, --intermediate and --vocab
shrink the model for quick runs and tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from streamchat.measure.models import PRESETS
from tests.support.tokenizers import byte_level_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

GGUF_TYPES = {
    "gguf-q8_0": gguf.GGMLQuantizationType.Q8_0,
    "gguf-q4_0": gguf.GGMLQuantizationType.Q4_0,
    "gguf-q4_1": gguf.GGMLQuantizationType.Q4_1,
}
GGUF_FILE_TYPES = {
    gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
}
FORMATS = ("safetensors-bf16", *GGUF_TYPES)
# The hub's usual shard limit is 5 GB; 2 GB keeps the one shard held in memory small.
SHARD_BYTES = 2_000_000_000
WEIGHT_SCALE = 0.02
# Rows drawn and quantized at once for a GGUF tensor: about 64 MB of float32, so the quantizer's
# temporaries stay small even for a 128k-token embedding.
GGUF_CHUNK_VALUES = 1 << 24


def preset_config(
    preset: str,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
) -> LlamaConfig:
    """The preset's LlamaConfig in bfloat16, with any size given here in place of the preset's."""
    fields = dict(PRESETS[preset])
    model_type = fields.pop("model_type")
    if model_type != "llama":
        raise SystemExit(f"{preset}: model_type {model_type!r}; only llama presets are written")
    if hidden is not None:
        fields["hidden_size"] = hidden
        # A preset's explicit head_dim belongs to its own hidden size; derive it from the new one.
        fields.pop("head_dim", None)
        if hidden % fields["num_attention_heads"]:
            raise SystemExit(f"--hidden {hidden} is not a multiple of {fields['num_attention_heads']} heads")
    for key, value in (("num_hidden_layers", layers), ("intermediate_size", intermediate), ("vocab_size", vocab)):
        if value is not None:
            fields[key] = value
    config = LlamaConfig(**fields)
    config.dtype = torch.bfloat16
    return config


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor LlamaForCausalLM saves, by its state_dict name, less lm_head.weight when it is tied."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _random_bf16(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16).mul_(WEIGHT_SCALE)


def _shard_plan(shapes: dict[str, tuple[int, ...]], element_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most SHARD_BYTES (a bigger tensor alone), in state_dict order."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * element_bytes
        if shards[-1] and filled + size > SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    # ChatML replies end with <|im_end|>; the tokenizer's own eos ends plain text.
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops)


def write_safetensors(config: LlamaConfig, out: Path, seed: int) -> list[Path]:
    """A bfloat16 model directory at `out`, one shard in memory at a time; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = byte_level_tokenizer()
    if config.bos_token_id != tokenizer.bos_token_id or config.eos_token_id != tokenizer.eos_token_id:
        # The presets' ids (1, 2, or Llama 3's) index a vocabulary we do not ship; point them at ours.
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.save_pretrained(out)
    _generation_config(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)

    shapes = weight_shapes(config)
    shards = _shard_plan(shapes, element_bytes=2)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    written: list[Path] = []
    for index, names in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_bf16(name, shapes[name], generator) for name in names}
        total += sum(tensor.nbytes for tensor in tensors.values())
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        del tensors
        weight_map |= dict.fromkeys(names, file_name)
        written.append(out / file_name)
        print(f"  {file_name}: {len(names)} tensors", flush=True)
    index_file = out / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return sorted(path for path in out.iterdir() if path.is_file())


def gguf_tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensors of the model, shapes in torch order (out_features, in_features)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_hidden_layers):
        block = f"blk.{layer}"
        shapes |= {
            f"{block}.attn_norm.weight": (hidden,),
            f"{block}.attn_q.weight": (q_width, hidden),
            f"{block}.attn_k.weight": (kv_width, hidden),
            f"{block}.attn_v.weight": (kv_width, hidden),
            f"{block}.attn_output.weight": (hidden, q_width),
            f"{block}.ffn_norm.weight": (hidden,),
            f"{block}.ffn_gate.weight": (inner, hidden),
            f"{block}.ffn_up.weight": (inner, hidden),
            f"{block}.ffn_down.weight": (hidden, inner),
        }
    shapes["output_norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (config.vocab_size, hidden)
    return shapes


def gguf_tensor_type(name: str, matrices: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Norms in F32 as llama.cpp keeps them; the embedding in Q8_0 beside 4-bit matrices, as the default model's."""
    if name.endswith("norm.weight"):
        return gguf.GGMLQuantizationType.F32
    if name == "token_embd.weight" and matrices in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return gguf.GGMLQuantizationType.Q8_0
    return matrices


def _vocabulary(tokenizer: PreTrainedTokenizerFast, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """The tokenizer's tokens, types and merges, the tokens padded with unused fillers to `vocab_size`.

    transformers takes a GGUF's vocab_size from its token count, so the list must be exactly as long
    as the embedding has rows.
    """
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    if [index for _, index in by_id] != list(range(len(by_id))):
        raise SystemExit("the tokenizer's ids are not contiguous")
    tokens = [token for token, _ in by_id]
    if vocab_size < len(tokens):
        raise SystemExit(f"vocab_size {vocab_size} is below the tokenizer's {len(tokens)} tokens")
    special = set(tokenizer.all_special_tokens)
    types = [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token in tokens]
    fillers = vocab_size - len(tokens)
    tokens += [f"<|filler_{index}|>" for index in range(fillers)]
    types += [gguf.TokenType.UNUSED] * fillers
    # tokenizers serialises a merge as a pair in recent versions, as "a b" in older ones.
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    return tokens, types, merges


def _random_quantized(
    shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType, generator: torch.Generator
) -> np.ndarray:
    """A matrix of N(0, 0.02²) values in `ggml_type`, drawn and quantized a chunk of rows at a time."""
    rows, columns = shape
    out = np.empty(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type), dtype=np.uint8)
    step = max(1, GGUF_CHUNK_VALUES // columns)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        # torch draws normals about four times faster than numpy here, which matters for 7B values.
        values = torch.randn((stop - start, columns), generator=generator).mul_(WEIGHT_SCALE).numpy()
        out[start:stop] = gguf.quants.quantize(values, ggml_type)
    return out


def write_gguf(config: LlamaConfig, out: Path, matrices: gguf.GGMLQuantizationType, seed: int) -> list[Path]:
    """One llama GGUF file at `out`, its tensors drawn and written one at a time; the files written."""
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"rope_type {rope['rope_type']!r} needs llama.cpp's rope_freqs tensor; not written here")
    tokenizer = byte_level_tokenizer()
    tokens, types, merges = _vocabulary(tokenizer, config.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"random-{config.num_hidden_layers}-layers")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(GGUF_FILE_TYPES[matrices])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    # As SmolLM2's file: a ChatML turn starts with <|im_start|> and a reply ends with <|im_end|>.
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(tokenizer.chat_template)

    # GGUFWriter holds every tensor added with add_tensor until the end; declaring the infos first and
    # then writing the data tensor by tensor keeps one tensor in memory instead of the whole model.
    shapes = gguf_tensor_shapes(config)
    for name, shape in shapes.items():
        ggml_type = gguf_tensor_type(name, matrices)
        nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, ggml_type)))
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    generator = torch.Generator().manual_seed(seed)
    for name, data in _gguf_tensors(shapes, matrices, generator):
        writer.write_tensor_data(data)
        if name.endswith("ffn_down.weight"):
            print(f"  {name.split('.ffn')[0]} written", flush=True)
    writer.close()
    return [out]


def _gguf_tensors(
    shapes: dict[str, tuple[int, ...]], matrices: gguf.GGMLQuantizationType, generator: torch.Generator
) -> Iterator[tuple[str, np.ndarray]]:
    for name, shape in shapes.items():
        ggml_type = gguf_tensor_type(name, matrices)
        if ggml_type == gguf.GGMLQuantizationType.F32:
            yield name, np.ones(shape, dtype=np.float32)
        else:
            yield name, _random_quantized(shape, ggml_type, generator)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Write the files the command line asks for and report them; return the files written."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", choices=[name for name, fields in PRESETS.items() if fields["model_type"] == "llama"])
    parser.add_argument("format", choices=FORMATS)
    parser.add_argument("out", type=Path, help="the model directory (safetensors) or the .gguf file to write")
    parser.add_argument("--layers", type=int, help="num_hidden_layers instead of the preset's (quick runs)")
    parser.add_argument("--hidden", type=int, help="hidden_size instead of the preset's (tests)")
    parser.add_argument("--intermediate", type=int, help="intermediate_size instead of the preset's (tests)")
    parser.add_argument("--vocab", type=int, help="vocab_size instead of the preset's (tests; GGUF: at least 600)")
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    config = preset_config(
        arguments.preset,
        layers=arguments.layers,
        hidden=arguments.hidden,
        intermediate=arguments.intermediate,
        vocab=arguments.vocab,
    )

    started = time.perf_counter()
    if arguments.format == "safetensors-bf16":
        files = write_safetensors(config, arguments.out, arguments.seed)
    else:
        if arguments.out.suffix != ".gguf":
            parser.error(f"{arguments.out}: a GGUF output is one file ending in .gguf")
        files = write_gguf(config, arguments.out, GGUF_TYPES[arguments.format], arguments.seed)
    seconds = time.perf_counter() - started

    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        print(f"{path}  {size:,} bytes")
    print(f"{len(files)} file(s), {total:,} bytes ({total / 1e9:.2f} GB), {seconds:.1f} s")
    return files


if __name__ == "__main__":
    main()
