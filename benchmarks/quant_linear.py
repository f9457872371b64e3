"""Decode-sized projections over GGUF-quantized weights (worker/csrc/quant_linear.cpp) against the float32
panel GEMM (worker/csrc/packed_linear.cpp) on SmolLM2-135M's shapes.

Each weight is cycled over --copies copies (a model's layers; fewer where they would pass 1.5 GB), so
the weights come from memory, not cache, as in a decode step. Reports microseconds a call and the
weight bytes read a second (GB/s); random values (speed does not depend on them).

    .venv/bin/python -m metroserve.benchmarks.quant_linear [--rows 1 8] [--copies 30] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

from metroserve.worker.cpu_kernels import load_cpu_kernels

SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("head", 576, 49152))
QTYPES = {"Q4_1": (3, 2, 16), "Q8_0": (8, 1, 32)}  # GGML type id, fp16 scales and quant bytes a block
MAX_BYTES = 1.5e9  # of one weight's copies


def random_blocks(n: int, k: int, halves: int, quants: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k / 32 * block bytes] GGML blocks: random quant bytes behind small fp16 scales."""
    scales = (torch.rand(n, k // 32, halves, generator=gen) * 0.02).half().view(torch.uint8)
    return torch.cat([scales, torch.randint(0, 256, (n, k // 32, quants), generator=gen, dtype=torch.uint8)],
                     dim=2).view(n, -1)


Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weight) -> y


def seconds_per_call(call: Call, x: torch.Tensor, weights: list[torch.Tensor], rounds: int) -> float:
    """Median over rounds of one pass over all copies, per call."""
    for w in weights:  # warm-up: code, page tables, thread pool
        call(x, w)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for w in weights:
            call(x, w)
        times.append((time.perf_counter() - start) / len(weights))
    return statistics.median(times)


def weight_sets(kernels: ModuleType, n: int, k: int, copies: int,
                gen: torch.Generator) -> dict[str, tuple[list[torch.Tensor], Call]]:
    """Copies of a random [n, k] weight packed for each kind (f32 and the GGML formats), and its call."""
    count = max(2, min(copies, int(MAX_BYTES // (n * k * 4))))
    sets: dict[str, tuple[list[torch.Tensor], Call]] = {
        "f32": ([kernels.pack_linear_weight(torch.randn(n, k, generator=gen)) for _ in range(count)],
                functools.partial(_float_call, kernels, n))}
    for label, (qtype, halves, quants) in QTYPES.items():
        count = max(2, min(copies, int(MAX_BYTES // (n * k * (2 * halves + quants) / 32))))
        sets[label] = ([kernels.pack_quant_weight(random_blocks(n, k, halves, quants, gen), qtype, k)
                        for _ in range(count)], functools.partial(_quant_call, kernels, qtype, n))
    return sets


def _float_call(kernels: ModuleType, n: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kernels.packed_linear(x, w, n)


def _quant_call(kernels: ModuleType, qtype: int, n: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return kernels.quant_linear(x, w, qtype, n)


def measure(kernels: ModuleType, rows: list[int], copies: int, rounds: int) -> None:
    gen = torch.Generator().manual_seed(0)
    print(f"{'shape':>8} {'K':>5} {'N':>6} {'M':>3} | {'kind':>5} {'us':>9} {'GB/s':>6} {'x f32':>6}")
    for name, k, n in SHAPES:
        sets = weight_sets(kernels, n, k, copies, gen)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            base = 0.0
            for label, (weights, call) in sets.items():
                t = seconds_per_call(call, x, weights, rounds)
                base = base or t
                gbs = weights[0].numel() * weights[0].element_size() / t / 1e9
                print(f"{name:>8} {k:>5} {n:>6} {m:>3} | {label:>5} {t * 1e6:>9.1f} {gbs:>6.1f} {base / t:>6.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m metroserve.benchmarks.quant_linear", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x (decode batch sizes)")
    parser.add_argument("--copies", type=int, default=30, help="copies of each weight cycled over (a model's layers)")
    parser.add_argument("--rounds", type=int, default=5, help="passes over the copies; the median is reported")
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's default, one a core)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels(required=True)
    assert kernels is not None
    print(f"threads: {torch.get_num_threads()}")
    measure(kernels, args.rows, args.copies, args.rounds)


if __name__ == "__main__":
    main()
