"""One decode query's attention over a full default cache, microseconds per call: repeat_kv against packed heads.

    python scripts/decode_attention_figures.py [--device cuda] [--threads 1]

The default model's shape (9 query heads, 3 KV heads, head dim 64) over 4 + 2000 + 1 slots,
a boolean mask, bfloat16 and float32; each eager and under torch.compile. "repeat_kv" is
what transformers' sdpa attention runs while compiling; "packed" is streamchat's
decode_attention (streamchat/placement/attention.py). Rows take turns; medians of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from streamchat.placement.attention import decode_attention

HEADS, KV_HEADS, SLOTS, HEAD_DIM, SCALE = 9, 3, 2005, 64, 0.125
ROUNDS, CALLS = 30, 10


def repeated(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    groups = HEADS // KV_HEADS
    return torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask, scale=SCALE
    )


def packed(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return decode_attention(query, keys, values, mask, SCALE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    device = torch.device(arguments.device)
    functions = {"repeat_kv": repeated, "packed": packed}
    for dtype in (torch.bfloat16, torch.float32):
        generator = torch.Generator().manual_seed(0)
        query = torch.randn(1, HEADS, 1, HEAD_DIM, generator=generator).to(device, dtype)
        keys, values = (torch.randn(1, KV_HEADS, SLOTS, HEAD_DIM, generator=generator).to(device, dtype) for _ in "kv")
        mask = torch.ones(1, 1, 1, SLOTS, dtype=torch.bool, device=device)
        mask[..., 4:10] = False  # a few free slots, as after an eviction
        calls = {}
        for name, function in functions.items():
            calls[f"{name} eager"] = function
            calls[f"{name} compiled"] = torch.compile(function, fullgraph=True, dynamic=False)
        times: dict[str, list[float]] = {name: [] for name in calls}
        with torch.inference_mode():
            for call in calls.values():
                call(query, keys, values, mask)  # compiles
            for _ in range(ROUNDS):
                for name, call in calls.items():
                    _synchronize(device)
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        call(query, keys, values, mask)
                    _synchronize(device)
                    times[name].append((time.perf_counter() - started) / CALLS * 1e6)
        figures = ", ".join(f"{name} {statistics.median(values):.0f}" for name, values in times.items())
        print(f"{str(dtype).removeprefix('torch.')} on {device}, {torch.get_num_threads()} threads, us/call: {figures}")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
