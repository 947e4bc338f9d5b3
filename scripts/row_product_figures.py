"""The default model's weight products for 1-32 rows, milliseconds per call: two ways to call the same product.

    python scripts/row_product_figures.py [--dtype float32] [--threads 2] [--rounds 15]

A decode step of R conversations multiplies R rows by each weight. `linear` is
F.linear(x, W), what nn.Linear runs; `weight-major` is (W @ x.T).T, the same product with
the weight as the left operand, which BLAS splits over the weight's rows. The shapes are
the default model's (SmolLM2-135M, q/k/v and gate/up fused as at load); the last, the
output head, is a fifth of its weights. Calls take turns within a round; medians of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 32)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


def weight_major(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=15)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    dtype = getattr(torch, arguments.dtype)
    generator = torch.Generator().manual_seed(0)
    calls = {"linear": linear, "weight-major": weight_major}
    print(f"{arguments.dtype}, {torch.get_num_threads()} threads, ms per call (median of {arguments.rounds} rounds)")
    print(f"{'product':>8} {'rows':>4} " + " ".join(f"{name:>12}" for name in calls) + "  faster")
    with torch.inference_mode():
        for name, (outputs, inputs) in SHAPES.items():
            weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
            for rows in ROWS:
                x = torch.randn(rows, inputs, generator=generator).to(dtype)
                for call in calls.values():
                    call(x, weight)  # warm up
                times: dict[str, list[float]] = {call: [] for call in calls}
                for _ in range(arguments.rounds):
                    for call_name, call in calls.items():
                        start = time.perf_counter()
                        call(x, weight)
                        times[call_name].append((time.perf_counter() - start) * 1e3)
                medians = {call_name: statistics.median(taken) for call_name, taken in times.items()}
                ratio = medians["linear"] / medians["weight-major"]
                cells = " ".join(f"{medians[call_name]:12.3f}" for call_name in calls)
                print(f"{name:>8} {rows:>4} {cells}  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
