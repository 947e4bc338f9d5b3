"""The default model's int4 products for 1-128 rows, microseconds per call: aten's kernel against streamchat's.

    python scripts/int4_kernel_figures.py [--dtype bfloat16] [--threads 2] [--rounds 15]

`aten` is Int4Linear (torch's _weight_int4pack_mm_for_cpu), `native` TiledInt4Linear
(streamchat/placement/kernels/int4_rows.c, built into a temporary directory), `widened` the
bfloat16 product with the weights widened first (what Int4Linear does past 128 rows). Same
weights, same levels; `error` is each kernel's relative distance from a float32 product with
the dequantized weights. Calls take turns within a round; medians of rounds.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from streamchat.placement.int4_linear import Int4Linear
from streamchat.placement.native import load_native_kernels
from streamchat.placement.native_layers import TiledInt4Linear

# The default model's shapes (in, out), q/k/v and gate/up fused as at load.
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 128)
CALLS = 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=15)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    dtype = getattr(torch, arguments.dtype)
    kernels = load_native_kernels(Path(tempfile.mkdtemp(prefix="streamchat-kernels-")))
    if kernels is None:
        raise SystemExit("streamchat's native kernels do not build or run on this machine")
    print(f"{'shape':>8} {'rows':>4} {'aten us':>8} {'native us':>9} {'widened us':>10}", end="")
    print(f" {'aten err':>8} {'native err':>10}")
    for name, (in_features, out_features) in SHAPES.items():
        torch.manual_seed(0)
        original = torch.nn.Linear(in_features, out_features, bias=False).to(dtype)
        aten, native = Int4Linear(original), TiledInt4Linear(original, kernels)
        weight = aten.widened(dtype)
        exact = native.widened(torch.float32)
        for rows in ROWS:
            x = torch.randn(rows, in_features).to(dtype)
            calls = {
                "aten": functools.partial(aten.product, x),
                "native": functools.partial(native.product, x),
                "widened": functools.partial(torch.matmul, x, weight.T),
            }
            times: dict[str, list[float]] = {key: [] for key in calls}
            with torch.inference_mode():
                for _ in range(arguments.rounds):
                    for key, call in calls.items():
                        started = time.perf_counter()
                        for _ in range(CALLS):
                            call()
                        times[key].append((time.perf_counter() - started) / CALLS * 1e6)
                expected = x.float() @ exact.T
                errors = [
                    ((layer.product(x).float() - expected).norm() / expected.norm()).item() for layer in (aten, native)
                ]
            median = {key: statistics.median(values) for key, values in times.items()}
            print(
                f"{name:>8} {rows:>4} {median['aten']:>8.1f} {median['native']:>9.1f} {median['widened']:>10.1f}"
                f" {errors[0]:>8.4f} {errors[1]:>10.4f}"
            )


if __name__ == "__main__":
    main()
