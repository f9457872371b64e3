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


def window_top1(logits: np.ndarray, window: list[int]) -> list[int]:
    """The argmax after each prefix whose next token window_nll scores."""
    first = len(window) // 2
    return logits[first - 1 : len(window) - 1].argmax(axis=1).tolist()


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
    nll, top1 = [], []
    for i, window in enumerate(job["windows"]):
        llm.reset()  # a fresh context for every window
        llm.eval(window)
        scores = np.asarray(llm.scores[: len(window)])
        nll += window_nll(scores, window)
        top1 += window_top1(scores, window)
        print(f"    llama.cpp window {i + 1}/{len(job['windows'])}", file=sys.stderr, flush=True)
    return {"nll": nll, "top1": top1, "version": llama_cpp.__version__}


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


def metroserve_nll(path: Path, quantization: str | None, windows: list[list[int]],
                   quantized_activations: str = "float32") -> tuple[list[float], list[int]]:
    """Score the windows with metroserve's model forward (one prefill of each window): NLL and argmax."""
    import torch

    from metroserve import LLM
    from metroserve.worker.attention import BatchLayout, TorchAttention, block_tables_to_slots
    from metroserve.worker.kv_cache import KVCache

    model = LLM(str(path), quantization=quantization, quantized_activations=quantized_activations,
                kv_cache_memory="64MiB").engine.model
    cfg, n, cpu = model.cfg, len(windows[0]), torch.device("cpu")
    blocks = list(range(-(-n // 16)))
    positions = np.arange(n)
    nll, top1 = [], []
    for window in windows:
        attention = TorchAttention(16)
        cache = KVCache(cfg.num_layers, len(blocks), 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, cpu)
        table, slots = block_tables_to_slots([blocks], np.zeros(n, dtype=np.int64), positions, 16, cpu)
        layout = BatchLayout([0], [n], [n], [blocks], table, slots)
        with torch.inference_mode():
            hidden = model(torch.tensor(window), torch.from_numpy(positions), attention, cache,
                           model.prepare_attention(attention, layout))
            logits = model.compute_logits(hidden).numpy()
        nll += window_nll(logits, window)
        top1 += window_top1(logits, window)
    return nll, top1


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
    from metroserve.worker.cpu_kernels import load_cpu_kernels
    from metroserve.worker.model_files import default_model_path

    files = make_files(args, default_model_path())
    kernels = load_cpu_kernels()
    int8_inputs = kernels is not None and bool(kernels.int8_gemm_available())
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
        # metroserve_float32 is the dequantized model (transformers' up to the order of sums): the
        # other rows' top-1 agreement is with its argmaxes.
        runs = {"metroserve_float32": ("none", "float32"), "metroserve": (None, "float32")}
        if int8_inputs:
            runs["metroserve_int8_inputs"] = (None, "int8")
        top1 = {"llama_cpp": llama["top1"]}
        for label, (quantization, activations) in runs.items():
            print(f"  metroserve quantization={quantization} activations={activations}", flush=True)
            nll, top1[label] = metroserve_nll(path, quantization, windows, activations)
            row[f"{label}_ppl"] = ppl(nll)
        reference = top1.pop("metroserve_float32")
        for label, argmax in top1.items():
            row[f"{label}_top1_agreement"] = sum(a == b for a, b in zip(argmax, reference)) / len(argmax)
        row["ratio_pct"] = 100 * (row["metroserve_ppl"] / row["llama_cpp_ppl"] - 1)
        if int8_inputs:
            row["int8_inputs_ratio_pct"] = 100 * (row["metroserve_int8_inputs_ppl"] / row["llama_cpp_ppl"] - 1)
        print(f"  {row}", flush=True)
        rows.append(row)
    cpu = next(line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    result = {"command": " ".join(sys.argv), "cpu": cpu, "llama_cpp_python": llama_version,
              "torch": torch.__version__, "tokens": len(ids), "n_ctx": args.n_ctx,
              "scored_tokens": sum(len(w) - len(w) // 2 for w in windows), "text_sources": sources, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| type | file tensor types | llama.cpp ppl | metroserve ppl | metroserve float32 ppl | ratio "
          "| metroserve int8 inputs ppl | ratio | top-1 agreement with float32: llama.cpp / metroserve / int8 inputs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mix = ", ".join(f"{k} x{v}" for k, v in r["tensor_types"].items())
        int8 = (f"{r['metroserve_int8_inputs_ppl']:.4f} | {r['int8_inputs_ratio_pct']:+.3f}%"
                if "int8_inputs_ratio_pct" in r else "- | -")
        print(f"| {r['type']} | {mix} | {r['llama_cpp_ppl']:.4f} | {r['metroserve_ppl']:.4f} | "
              f"{r['metroserve_float32_ppl']:.4f} | {r['ratio_pct']:+.3f}% | {int8} | "
              f"{r['llama_cpp_top1_agreement']:.3f} / {r['metroserve_top1_agreement']:.3f} / "
              f"{r.get('metroserve_int8_inputs_top1_agreement', float('nan')):.3f} |")
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
