"""GPU check: attention kernel timings, decode tokens/s against the memory-bandwidth roofline, and
the offline throughput benchmark, written as one report. scripts/gpu_check.sh runs it after the
GPU tests; the whole script is sized to finish in under 8 minutes on one H200.

The models are random-weight Llamas of real shapes built in code (benchmarks/random_model.py),
because the GPU machine has no copy of the weights and step time depends on shapes, not values.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check [--smoke]

--smoke runs every section on tiny shapes, on any device (CPU: the Triton interpreter), to check
the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from tqdm.auto import tqdm

from metroserve import EngineConfig, LLMEngine, SamplingParams
from metroserve.benchmarks.random_model import write_random_llama
from metroserve.worker.attention import AttentionBackend, BatchLayout, TorchAttention, block_tables_to_slots
from metroserve.worker.kv_cache import KVCache

# Peak HBM bandwidth from the data sheets, bytes/s; other devices use the measured copy bandwidth.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}

FULL: dict[str, Any] = dict(
    kernel_heads=[(9, 3, 64), (32, 8, 64), (32, 8, 128)],
    # (label, query lengths, context lengths)
    kernel_shapes=[("decode 1 x 1024", [1], [1024]), ("decode 1 x 8192", [1], [8192]),
                   ("decode 8 x 2048", [1] * 8, [2048] * 8), ("decode 64 x 2048", [1] * 64, [2048] * 64),
                   ("decode 256 x 1024", [1] * 256, [1024] * 256),
                   ("prefill 1 x 2048", [2048], [2048]), ("chunks 4 x 512 over 1536", [512] * 4, [2048] * 4)],
    decode_models=["smollm2-135m", "llama-3.2-1b"], decode_batches=[1, 8, 64, 256], decode_context=512,
    decode_steps=32, throughput_shape="smollm2-135m", throughput_requests=64, throughput_max_tokens=128,
)
SMOKE: dict[str, Any] = dict(
    kernel_heads=[(4, 2, 16)],
    kernel_shapes=[("decode 2 x 40", [1, 1], [40, 40]), ("prefill 1 x 24", [24], [24])],
    decode_models=["tiny"], decode_batches=[1, 2], decode_context=16, decode_steps=2,
    throughput_shape="tiny", throughput_requests=2, throughput_max_tokens=4,
)


def hbm_bandwidth(device: torch.device, measured_copy: float) -> tuple[float, str]:
    """Peak bandwidth (bytes/s) and where it came from: the data sheet, else the measured device copy."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bandwidth in HBM_BANDWIDTH.items():
            if key in name:
                return bandwidth, f"{name} data sheet"
    return measured_copy, "measured copy"


def copy_bandwidth(device: torch.device, size: int = 2**30) -> float:
    """Bytes read plus written per second by one large device-to-device copy (best of 5)."""
    src = torch.empty(size // 4 if device.type == "cuda" else size // 64, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds per call of fn after two warm-up calls. Each sample runs enough calls back
    to back (at least 1 ms of them) that a small shape measures the kernels, not one sync's latency."""
    fn()
    fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    calls = max(1, min(50, int(1e-3 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / calls)
    return 1000 * float(np.median(times))


def kernel_timings(cfg: dict, device: torch.device, dtype: torch.dtype, repeats: int, emit) -> None:
    """One attention layer (K/V write plus attention), Triton vs the torch backend, per shape; emit(row) each."""
    from metroserve.worker.attention.triton import TritonAttention

    rng = np.random.default_rng(0)
    cases = [(h, s) for h in cfg["kernel_heads"] for s in cfg["kernel_shapes"]]
    for (num_heads, num_kv_heads, head_dim), (label, query_lens, context_lens) in tqdm(cases, desc="kernels"):
        bs = 16
        blocks_per_seq = [-(-c // bs) for c in context_lens]
        cache = KVCache(1, sum(blocks_per_seq) + 1, bs, num_kv_heads, head_dim, dtype, device)
        cache.k.normal_()
        cache.v.normal_()
        order = rng.permutation(cache.num_blocks - 1) + 1
        tables, start = [], 0
        for n in blocks_per_seq:
            tables.append(order[start : start + n].tolist())
            start += n
        seq_index = np.repeat(np.arange(len(query_lens)), query_lens)
        positions = np.concatenate([np.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
        table_tensor, slots = block_tables_to_slots(tables, seq_index, positions, bs, device)
        layout = BatchLayout(np.cumsum([0] + query_lens[:-1]).tolist(), query_lens, context_lens, tables,
                             table_tensor, slots)
        t = sum(query_lens)
        q = torch.randn(t, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.randn(t, num_kv_heads, head_dim, dtype=dtype, device=device)
        v = torch.randn(t, num_kv_heads, head_dim, dtype=dtype, device=device)
        row = {"heads": f"{num_heads}/{num_kv_heads}x{head_dim}", "shape": label}
        backends: list[tuple[str, AttentionBackend[Any]]] = [
            ("torch", TorchAttention(bs)), ("triton", TritonAttention(bs, num_heads, num_kv_heads, head_dim, dtype))]
        for name, backend in backends:
            meta = backend.prepare(layout)
            row[f"{name}_ms"] = time_ms(partial(backend.forward, 0, q, k, v, cache, meta), device, repeats)
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        emit(row)


def decode_rates(model_dir: Path, shape: str, cfg: dict, device: torch.device, bandwidth: float,
                 enforce_eager: bool, emit) -> None:
    """Decode tokens/s at each batch size: every sequence decoding (greedy, no EOS) from a
    decode_context-token prompt, timed over decode_steps steps after three untimed ones. emit(row)
    per batch size, so that a later failure keeps the rows measured before it."""
    # No detokenization: this measures the model step and its scheduling, not text assembly.
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device.type, attention_backend="triton",
                                    enforce_eager=enforce_eager, gpu_memory_utilization=0.45,
                                    max_num_seqs=max(cfg["decode_batches"]), enable_prefix_caching=False),
                       detokenize=False)
    mcfg = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_bytes_per_token = 2 * mcfg.num_layers * mcfg.num_kv_heads * mcfg.head_dim * engine.kv_cache.k.element_size()
    rng = np.random.default_rng(1)
    for batch in cfg["decode_batches"]:
        steps, context = cfg["decode_steps"], cfg["decode_context"]
        # Long enough that no sequence finishes while later prompts prefill or during the timed steps.
        params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - context - 1, ignore_eos=True)
        requests = [engine.add_request(p, params) for p in rng.integers(3, 500, size=(batch, context)).tolist()]
        seqs = [r.seqs[0] for r in requests]
        while any(r.metrics.first_token_time is None for r in requests):
            engine.step()
        for _ in range(3):  # untimed: compiles this batch's decode kernels before the clock starts
            engine.step()
        tokens_before = sum(s.num_tokens for s in seqs)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(device)
        seconds = time.perf_counter() - start
        decoding = len(engine.batcher.running)
        tokens_after = sum(s.num_tokens for s in seqs)
        for r in requests:
            engine.abort_request(r.request_id)
        if decoding != batch or tokens_after - tokens_before != batch * steps:
            raise RuntimeError(f"batch {batch}: {decoding} sequences decoding, {tokens_after - tokens_before} "
                               f"tokens in {steps} steps; the measurement needs all of them every step")
        # Each step reads every weight once and each sequence's whole context (its mean over the timed steps).
        mean_context = (tokens_before + tokens_after) / 2 / batch
        step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
        roofline = batch * bandwidth / step_bytes
        rate = batch * steps / seconds
        emit({"model": shape, "graphs": engine.runner.graphs is not None, "batch": batch,
                     "context": round(mean_context), "step_ms": 1000 * seconds / steps, "tokens_per_s": rate,
                     "roofline_tokens_per_s": roofline, "fraction_of_roofline": rate / roofline,
                     "weight_mb": weight_bytes / 1e6, "kv_mb_per_step": (step_bytes - weight_bytes) / 1e6})
    del engine
    release(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def offline_throughput(model_dir: Path, cfg: dict, device: torch.device, out: Path) -> dict[str, Any]:
    """benchmarks/throughput.py (engine vs transformers generate and generate_batch) on this device."""
    from metroserve.benchmarks import throughput

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    args = parser.parse_args(["--model", str(model_dir), "--device", device.type,
                              "--num-requests", str(cfg["throughput_requests"]),
                              "--max-tokens", str(cfg["throughput_max_tokens"]), "--json-out", str(out)])
    return throughput.run(args)


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """columns: (header, key, format)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(format(row[k], f) for _, k, f in columns) + " |")
    return "\n".join(lines)


def write_report(results: dict[str, Any], out: Path) -> str:
    env = results["environment"]
    parts = [f"# GPU check ({'smoke run: numbers mean nothing' if results['smoke'] else 'full run'})", "",
             f"{env['device_name']}, torch {env['torch']}, triton {env['triton']}, {env['dtype']}. "
             f"Roofline bandwidth {env.get('bandwidth_tb_s', math.nan):.2f} TB/s "
             f"({env.get('bandwidth_source', 'not measured')}); measured device copy "
             f"{env.get('copy_tb_s', math.nan):.2f} TB/s (read + written).", ""]
    if results.get("kernels"):
        parts += ["## Attention layer: Triton vs torch backend (K/V write + attention, median ms)", "",
                  markdown_table(results["kernels"], [
                      ("heads q/kv x dim", "heads", "s"), ("shape", "shape", "s"), ("torch ms", "torch_ms", ".3f"),
                      ("triton ms", "triton_ms", ".3f"), ("speed-up", "speedup", ".2f")]), ""]
    if results.get("decode"):
        parts += ["## Decode tokens/s against the memory-bandwidth roofline", "",
                  "Roofline = batch x bandwidth / (weight bytes + KV bytes read per step).", "",
                  markdown_table(results["decode"], [
                      ("model", "model", "s"), ("graphs", "graphs", ""), ("batch", "batch", "d"),
                      ("context", "context", "d"), ("step ms", "step_ms", ".2f"), ("tok/s", "tokens_per_s", ".0f"),
                      ("roofline tok/s", "roofline_tokens_per_s", ".0f"),
                      ("of roofline", "fraction_of_roofline", ".1%"),
                      ("weights MB", "weight_mb", ".0f"), ("KV MB/step", "kv_mb_per_step", ".0f")]), ""]
    if "throughput" in results:
        t = results["throughput"]
        rows = [{"peer": name, **p, "ratio": p.get("engine_over_peer", math.nan)} for name, p in t["peers"].items()]
        parts += [f"## Offline throughput ({t['num_requests']} chat requests, max {t['max_tokens']} new tokens, "
                  f"{t['device']} {t['dtype']}, random-weight {results['throughput_shape']})", "",
                  markdown_table(rows, [("peer", "peer", "s"), ("output tokens", "output_tokens", "d"),
                                        ("seconds", "seconds", ".2f"), ("tok/s", "tokens_per_s", ".0f"),
                                        ("engine / peer", "ratio", ".2f")]), ""]
    for section, error in results["errors"].items():
        parts += [f"**{section} failed**: `{error}` (traceback in the log)", ""]
    parts += [f"Sections skipped for time: {', '.join(results['skipped']) or 'none'}. "
              f"Wall time {results['wall_seconds']:.0f} s."]
    report = "\n".join(parts) + "\n"
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check"), help="report folder")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks the script only")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="skip a section that, by its estimate, would end more than this many seconds from now")
    parser.add_argument("--deadline", type=float, default=None,
                        help="the same as a Unix time (gpu_check.sh passes it, counting the imports too)")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("no CUDA device: the full check needs a GPU (use --smoke to test the script)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (first import)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = args.deadline or time.time() + args.budget_s
    stopping = False

    def stop(*_) -> None:
        """gpu_check.sh's timeout sends SIGTERM: leave through the finally below, which writes the report."""
        nonlocal stopping
        stopping = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the report short
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    import triton

    results: dict[str, Any] = {"smoke": args.smoke, "skipped": [], "errors": {}, "kernels": [], "decode": [],
                               "throughput_shape": cfg["throughput_shape"], "wall_seconds": 0.0,
                               "environment": {
                                   "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                                   else "CPU"),
                                   "torch": torch.__version__, "triton": triton.__version__,
                                   "dtype": str(dtype).removeprefix("torch.")}}

    def save() -> None:
        results["wall_seconds"] = time.perf_counter() - start
        write_report(results, args.out)

    def emit_to(key: str):
        def emit(row: dict[str, Any]) -> None:
            results[key].append(row)
            save()
        return emit

    def run_section(section: str, estimate_s: float, fn) -> Any:
        """fn's result, or None when it would end past the deadline, the run is stopping, or it
        fails: one section's failure must not cost the others' numbers on a machine lent for minutes."""
        if stopping or time.time() + estimate_s > deadline:
            results["skipped"].append(section)
            return None
        value = None
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - reported, and the run goes on
            logging.exception("section %s failed", section)
            results["errors"][section] = f"{type(exc).__name__}: {exc}"
        try:
            release(device)  # outside the except block: the traceback no longer holds the section's tensors
        except Exception as exc:  # noqa: BLE001 - a sticky CUDA error surfaces here again
            results["errors"].setdefault(section, f"{type(exc).__name__}: {exc}")
        save()
        return value

    def bandwidths() -> None:
        copy = copy_bandwidth(device)
        bandwidth, source = hbm_bandwidth(device, copy)
        results["environment"].update(bandwidth_tb_s=bandwidth / 1e12, bandwidth_source=source, copy_tb_s=copy / 1e12)

    def model_dir(tmp: str, shape: str) -> Path:
        """The random-weight model of this shape, written on first use."""
        path = Path(tmp) / shape
        if not path.exists():
            write_random_llama(path, shape, device=device.type, dtype=dtype)
            release(device)
        return path

    def decode(tmp: str, shape: str, eager: bool) -> None:
        bandwidth = results["environment"].get("bandwidth_tb_s", math.nan) * 1e12
        run_section(f"decode {shape} {'eager' if eager else 'graphs'}", 30 if shape == cfg["throughput_shape"] else 45,
                    lambda: decode_rates(model_dir(tmp, shape), shape, cfg, device, bandwidth, eager,
                                         emit_to("decode")))

    try:
        with tempfile.TemporaryDirectory(prefix="metroserve-gpu-check-") as tmp:
            # What the issue asks for first (kernels; the default model's decode, graphs on and off;
            # throughput), then the larger model's decode while time is left.
            run_section("bandwidth", 5, bandwidths)
            run_section("kernels", 35, lambda: kernel_timings(cfg, device, dtype, 3 if args.smoke else 20,
                                                              emit_to("kernels")))
            for eager in (False, True):
                decode(tmp, cfg["throughput_shape"], eager)
            throughput = run_section("throughput", 80, lambda: offline_throughput(
                model_dir(tmp, cfg["throughput_shape"]), cfg, device, args.out / "throughput.json"))
            if throughput is not None:
                results["throughput"] = throughput
                for peer, error in throughput["failed_peers"].items():
                    results["errors"][f"throughput peer {peer}"] = error
            for shape in cfg["decode_models"]:
                if shape != cfg["throughput_shape"]:
                    for eager in (False, True):
                        decode(tmp, shape, eager)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        results["wall_seconds"] = time.perf_counter() - start
        print(write_report(results, args.out))
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
