"""Perplexity of metroserve serving a GGUF's quantized weights against llama.cpp on the same file.

For each 4-bit type (the default model's own Q4_1, and Q4_0 and Q4_K_M made from it by llama.cpp's
quantizer) both engines score the same 4096 token ids (metroserve's tokenizer; llama.cpp is given
the ids, it does not re-tokenize) with llama-perplexity's protocol: 512-token windows, each from a
fresh context, scoring tokens 256..511 of each window from their prefix; ppl = exp(mean NLL), the
log-softmax taken in float64 on both sides. metroserve with --quantization none (the file's weights
dequantized to float32) is a reference row. llama-cpp-python lives in its own venv, so its side
runs as a subprocess of this script (--llama-job) under --llama-cpp-python.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/perplexity.py --out benchmarks/results/perplexity.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

# The project's seed article (../shared/seed beside the checkout), then the GPL-3 text Debian ships.
DEFAULT_TEXTS = [*sorted(glob.glob(str(Path(__file__).resolve().parents[2] / "shared" / "seed" / "*.txt"))),
                 "/usr/share/common-licenses/GPL-3"]
REQUANTIZED = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def window_nll(logits: np.ndarray, window: list[int]) -> list[float]:
    """NLL of tokens n/2..n-1 of the window, each from the logits after its prefix (float64)."""
    first = len(window) // 2
    rows = logits[first - 1 : len(window) - 1].astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
    targets = np.asarray(window[first:])
    return (log_norm - rows[np.arange(len(targets)), targets]).tolist()


def llama_job(job: dict) -> dict:
    """What runs in llama-cpp-python's venv: quantize a file, or score windows."""
    import llama_cpp

    if job["op"] == "quantize":
        params = llama_cpp.llama_model_quantize_default_params()
        params.allow_requantize = True
        params.ftype = getattr(llama_cpp, job["ftype"])
        rc = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(), params)
        return {"rc": rc}
    llm = llama_cpp.Llama(job["model"], n_ctx=job["n_ctx"], logits_all=True, n_threads=job["threads"], verbose=False)
    nll = []
    for i, window in enumerate(job["windows"]):
        llm.reset()  # a fresh context for every window
        llm.eval(window)
        nll += window_nll(np.asarray(llm.scores[: len(window)]), window)
        print(f"    llama.cpp window {i + 1}/{len(job['windows'])}", file=sys.stderr, flush=True)
    return {"nll": nll, "version": llama_cpp.__version__}


def run_llama(python: str, job: dict) -> dict:
    out = subprocess.run([python, __file__, "--llama-job"], input=json.dumps(job), text=True,
                         stdout=subprocess.PIPE, check=True)
    return json.loads(out.stdout.splitlines()[-1])  # the last line: native code may print before it


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each GGML type the file holds."""
    from gguf import GGMLQuantizationType, GGUFReader

    counts: dict[str, int] = {}
    for tensor in GGUFReader(path).tensors:
        name = GGMLQuantizationType(tensor.tensor_type).name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def held_out_ids(files: list[str], n_tokens: int, tokenizer: Any) -> tuple[list[int], list[dict]]:
    """The first n_tokens ids of the files' text, reading only as many files as that needs."""
    text, sources = "", []
    for name in files:
        part = Path(name).read_text()
        text = f"{text}\n\n{part}" if text else part
        sources.append({"path": name, "chars": len(part)})
        ids = tokenizer.encode(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens], sources
    raise SystemExit(f"only {len(ids)} tokens in {files}; need {n_tokens}")


def metroserve_nll(path: Path, quantization: str | None, windows: list[list[int]]) -> list[float]:
    """Score the windows with metroserve's model forward (one prefill of each window)."""
    import torch

    from metroserve import LLM
    from metroserve.worker.attention import BatchLayout, TorchAttention, block_tables_to_slots
    from metroserve.worker.kv_cache import KVCache

    model = LLM(str(path), quantization=quantization, kv_cache_memory="64MiB").engine.model
    cfg, n, cpu = model.cfg, len(windows[0]), torch.device("cpu")
    blocks = list(range(-(-n // 16)))
    positions = np.arange(n)
    nll = []
    for window in windows:
        attention = TorchAttention(16)
        cache = KVCache(cfg.num_layers, len(blocks), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu)
        table, slots = block_tables_to_slots([blocks], np.zeros(n, dtype=np.int64), positions, 16, cpu)
        layout = BatchLayout([0], [n], [n], [blocks], table, slots)
        with torch.inference_mode():
            hidden = model(torch.tensor(window), torch.from_numpy(positions), attention, cache,
                           model.prepare_attention(attention, layout))
            nll += window_nll(model.compute_logits(hidden).numpy(), window)
    return nll


def ppl(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def make_files(args: argparse.Namespace, source: Path) -> dict[str, Path]:
    files = {"Q4_1": source}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    for name, ftype in REQUANTIZED.items():
        dst = args.work_dir / f"{source.stem.split('.')[0]}.{name}.gguf"
        if not dst.exists():
            print(f"quantizing {source.name} -> {dst} ({ftype}) with llama.cpp", flush=True)
            if run_llama(args.llama_cpp_python, {"op": "quantize", "src": str(source), "dst": str(dst),
                                                 "ftype": ftype})["rc"] != 0:
                raise SystemExit(f"llama_model_quantize failed for {name}")
        files[name] = dst
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", nargs="+", default=DEFAULT_TEXTS,
                        help="held-out text files, read in order until --tokens tokens (default: the seed "
                             "texts, then the GPL-3 text)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens scored in windows (default 4096)")
    parser.add_argument("--n-ctx", type=int, default=512, help="window length, as llama-perplexity's -c")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (set OMP_NUM_THREADS too)")
    parser.add_argument("--llama-cpp-python", default="/tmp/llamacpp-venv/bin/python",
                        help="a python with llama-cpp-python installed")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/ppl"), help="where requantized GGUFs go")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/perplexity.json"), help="JSON results")
    parser.add_argument("--llama-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_job:
        print(json.dumps(llama_job(json.load(sys.stdin))))
        return

    import torch

    from metroserve import LLM
    from metroserve.worker.model_files import default_model_path

    files = make_files(args, default_model_path())
    ids, sources = held_out_ids(args.text, args.tokens, LLM(None, kv_cache_memory="64MiB").get_tokenizer())
    windows = [ids[i : i + args.n_ctx] for i in range(0, len(ids) - args.n_ctx + 1, args.n_ctx)]
    print(f"{len(ids)} tokens from {[s['path'] for s in sources]}: {len(windows)} windows of {args.n_ctx}")
    rows, llama_version = [], None
    for name, path in files.items():
        types = tensor_types(path)
        print(f"{name}: {path} tensor types {types}", flush=True)
        llama = run_llama(args.llama_cpp_python, {"op": "nll", "model": str(path), "n_ctx": args.n_ctx,
                                                  "threads": args.threads, "windows": windows})
        llama_version = llama["version"]
        row: dict[str, Any] = {"type": name, "file": str(path), "tensor_types": types,
                               "llama_cpp_ppl": ppl(llama["nll"])}
        for label, quantization in (("metroserve_ppl", None), ("metroserve_float32_ppl", "none")):
            print(f"  metroserve quantization={quantization}", flush=True)
            row[label] = ppl(metroserve_nll(path, quantization, windows))
        row["ratio_pct"] = 100 * (row["metroserve_ppl"] / row["llama_cpp_ppl"] - 1)
        print(f"  llama.cpp {row['llama_cpp_ppl']:.4f}  metroserve {row['metroserve_ppl']:.4f}  "
              f"float32 {row['metroserve_float32_ppl']:.4f}  ({row['ratio_pct']:+.3f}%)", flush=True)
        rows.append(row)
    cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    result = {"command": " ".join(sys.argv), "cpu": cpu, "llama_cpp_python": llama_version,
              "torch": torch.__version__, "tokens": len(ids), "n_ctx": args.n_ctx,
              "scored_tokens": sum(len(w) - len(w) // 2 for w in windows), "text_sources": sources, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| type | file tensor types | llama.cpp ppl | metroserve ppl | metroserve float32 ppl | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mix = ", ".join(f"{k} x{v}" for k, v in r["tensor_types"].items())
        print(f"| {r['type']} | {mix} | {r['llama_cpp_ppl']:.4f} | {r['metroserve_ppl']:.4f} | "
              f"{r['metroserve_float32_ppl']:.4f} | {r['ratio_pct']:+.3f}% |")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
