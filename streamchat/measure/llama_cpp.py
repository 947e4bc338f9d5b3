"""llama.cpp beside streamchat, for the benches that compare the two (llama-cpp-python, when installed).

Which GGUF file llama.cpp reads for a --model (a .gguf path, or the default model's packaged file),
greedy decoding on it in this process (`bench decode`), and a fresh process that only loads it
(`bench load`). The llama_cpp package is imported only where one of these runs.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from streamchat import defaults
from streamchat.loading.resolve import packaged_gguf

LLAMA_CPP_MIN_CONTEXT = 512
# The context a fresh process loads the model with (`bench load`): what a chat asks of llama.cpp.
LOAD_CONTEXT = 2048
# That process: the file and n_ctx on its command line, every core; a line on stdout once the model is loaded.
_LOAD_SCRIPT = (
    "import os, sys\n"
    "from llama_cpp import Llama\n"
    "Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=os.cpu_count(), verbose=False)\n"
    "print('loaded', flush=True)\n"
)


def llama_cpp_gguf(model: str | None) -> tuple[Path | None, str]:
    """The GGUF llama.cpp reads for `model`, or None and why there is no llama.cpp row."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama.cpp row skipped: llama-cpp-python is not installed (pip install 'streamchat[llamacpp]')"
    if model is not None and model.endswith(".gguf"):
        return Path(model), ""
    if model not in (None, defaults.DEFAULT_MODEL):
        return None, f"llama.cpp row skipped: {model} is not a GGUF file"
    gguf = packaged_gguf(defaults.DEFAULT_MODEL)
    return (gguf, "") if gguf is not None else (None, "llama.cpp row skipped: the default model is not installed")


class LlamaCpp:
    """llama.cpp on a GGUF file, greedy, with `threads` threads (as many as torch uses)."""

    def __init__(self, gguf: Path, context: int, threads: int) -> None:
        from llama_cpp import Llama

        self.gguf = gguf
        # The prompt goes in one token at a time (n_batch 1), as every decode step does anyway: llama.cpp's
        # AMX matmul for batches dies with SIGILL on VMs that list AMX but do not enable it (the CI machine).
        self.llama = Llama(
            model_path=str(gguf),
            n_ctx=max(context, LLAMA_CPP_MIN_CONTEXT),
            n_batch=1,
            n_ubatch=1,
            n_threads=threads,
            verbose=False,
        )

    def decode(self, ids: list[int], max_new_tokens: int) -> float:
        """Seconds per decode step of a reply of `max_new_tokens`: from the first generated token to the last."""
        stamps = []
        for _ in self.llama.generate(ids, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == max_new_tokens:
                break
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")


def load_command(gguf: Path) -> list[str]:
    """A fresh Python process that loads `gguf` as a chat would (n_ctx LOAD_CONTEXT, every core), says so on
    stdout and exits."""
    return [sys.executable, "-c", _LOAD_SCRIPT, str(gguf), str(LOAD_CONTEXT)]
