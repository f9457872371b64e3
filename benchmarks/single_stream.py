"""Single-stream decode: one chat request at a time, this engine vs llama.cpp on the same GGUF file.

What a person chatting waits for per token. Each peer gets the same token-id prompt (the chat
template applied by the engine's tokenizer), decodes greedily for --max-tokens tokens ignoring EOS,
--repeats times; the decode rate is (tokens - 1) / (time from the first token to the last), so
prefill is not in it (TTFT is reported apart). Peers, each in a fresh process, run one after the
other on the same threads:
- engine: metroserve as a user starts it on the file (its default --quantization: the GGUF's own
  quantized matrices served quantized, multiplied by exact float32 activations);
- engine-python-layers: the same, with decode steps' layers run by the Python loop instead of one
  C++ call (worker/fused_decode.py): what the fused path saves;
- engine-int8-inputs: the same with --quantized-activations int8 (activations rounded to int8 and
  multiplied in integers, as llama.cpp does; x86 with AVX2 or AVX-512);
- engine-fp32: the same with --quantization none (every weight dequantized to float32: the engine
  before quantized serving);
- llama.cpp: llama-cpp-python from its own virtual environment (--llama-cpp-python: that venv's
  python; never a dependency of this project), n_threads = the engine's threads, the same prompt
  tokens, greedy, through its low-level generate() so EOS does not stop it.
Weights resident: the bytes of every tensor the engine's model holds (DecoderForCausalLM.resident_bytes:
weights with their packed and quantized copies); also the process's RSS growth over loading (that
plus the libraries loaded and the float32 file read at load, whose freed pages the engine keeps).

    python benchmarks/single_stream.py --llama-cpp-python /tmp/llamacpp-venv/bin/python \\
        [--model FILE.gguf] [--max-tokens 128] [--repeats 3] [--json-out out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Write a long story about a dragon who learns to bake bread."

# Run by the llama.cpp venv's python: argv = model path, threads, max tokens, repeats, prompt ids (JSON), n_batch.
_LLAMA_CPP = r"""
import json, sys, time
from llama_cpp import Llama
path, prompt = sys.argv[1], json.loads(sys.argv[5])
threads, max_tokens, repeats, n_batch = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + max_tokens + 8,
            n_batch=n_batch, n_ubatch=n_batch, verbose=False, logits_all=False)
runs = []
for _ in range(repeats + 1):  # the first is a warm-up
    llm.reset()
    start = time.perf_counter(); times = []; tokens = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter()); tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    runs.append({"ttft_s": times[0] - start, "decode_s": times[-1] - times[0], "tokens": tokens})
print(json.dumps(runs[1:]))
"""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _engine_peer(model: str | None, options: dict[str, str], fused: bool, prompt: list[int], max_tokens: int,
                 repeats: int, conn) -> None:
    from metroserve import LLM, SamplingParams

    before = _rss_bytes()
    llm = LLM(model, kv_cache_memory="256MiB", max_num_seqs=8, **options)
    rss = _rss_bytes() - before
    if not fused:  # the ablation: decode steps run the layers through the Python loop
        llm.engine.model.fused_decode = None
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    runs = []
    for i in range(repeats + 1):  # the first is a warm-up
        engine.add_request(prompt, params, request_id=f"r{i}")
        start = time.perf_counter()
        times: list[float] = []
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for request in engine.step():
                new = request.seqs[0].token_ids[len(prompt) + len(tokens):]
                times.extend([time.perf_counter()] * len(new))
                tokens.extend(new)
        runs.append({"ttft_s": times[0] - start, "decode_s": times[-1] - times[0], "tokens": tokens})
    conn.send({"runs": runs[1:], "weights_bytes": engine.model.resident_bytes(), "rss_bytes": rss})


def _run_engine(model: str | None, options: dict[str, str], fused: bool, prompt: list[int], max_tokens: int,
                repeats: int) -> dict[str, Any]:
    """A fresh process running the engine with these EngineConfig options (fused: decode steps' layers in
    one C++ call where the model has it, worker/fused_decode.py; False runs them in Python)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_peer, args=(model, options, fused, prompt, max_tokens, repeats, child))
    proc.start()
    while not parent.poll(1):
        if not proc.is_alive():
            raise RuntimeError(f"the engine peer ({options}) exited with {proc.exitcode}")
    result = parent.recv()
    proc.join()
    return result


def _run_llama_cpp(python: str, model_path: Path, threads: int, prompt: list[int], max_tokens: int,
                   repeats: int, n_batch: int) -> dict[str, Any]:
    out = subprocess.run([python, "-c", _LLAMA_CPP, str(model_path), str(threads), str(max_tokens), str(repeats),
                          json.dumps(prompt), str(n_batch)], check=True, capture_output=True, text=True)
    return {"runs": json.loads(out.stdout.strip().splitlines()[-1])}


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    rates = [(len(r["tokens"]) - 1) / r["decode_s"] for r in result["runs"]]
    return {"decode_tok_s": statistics.median(rates), "decode_tok_s_runs": rates,
            "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in result["runs"]),
            "tokens": result["runs"][0]["tokens"],
            **({"weights_mib": result["weights_bytes"] / 2**20, "load_rss_mib": result["rss_bytes"] / 2**20}
               if "weights_bytes" in result else {})}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per peer, after one warm-up (default: 3)")
    parser.add_argument("--llama-cpp-python", default=None,
                        help="python of a venv with llama-cpp-python installed (omit: llama.cpp is not run)")
    parser.add_argument("--llama-cpp-n-batch", type=int, default=512,
                        help="llama.cpp's n_batch (and n_ubatch) for the prompt; 1 feeds it token by token, as its "
                             "decode steps run (a build whose batched kernels die with SIGILL on the CPU needs it)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from metroserve.common.tokenizer import load_tokenizer
    from metroserve.worker.cpu_kernels import load_cpu_kernels
    from metroserve.worker.model_files import default_model_path, resolve_model_dir

    model_path = Path(args.model) if args.model else default_model_path()
    tokenizer = load_tokenizer(resolve_model_dir(args.model))
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    threads = torch.get_num_threads()
    peers: dict[str, dict[str, Any]] = {}
    engines: list[tuple[str, dict[str, str], bool]] = [
        ("engine", {}, True), ("engine-python-layers", {}, False), ("engine-fp32", {"quantization": "none"}, True)]
    kernels = load_cpu_kernels()
    if kernels is not None and kernels.int8_gemm_available():
        engines.insert(2, ("engine-int8-inputs", {"quantized_activations": "int8"}, True))
    for name, options, fused in engines:
        peers[name] = _summary(_run_engine(args.model, options, fused, prompt, args.max_tokens, args.repeats))
    if args.llama_cpp_python:
        peers["llama.cpp"] = _summary(_run_llama_cpp(args.llama_cpp_python, model_path, threads, prompt,
                                                     args.max_tokens, args.repeats, args.llama_cpp_n_batch))
    report = {"model": str(model_path), "threads": threads, "prompt_tokens": len(prompt),
              "llama_cpp_n_batch": args.llama_cpp_n_batch,
              "max_tokens": args.max_tokens, "peers": peers}
    reference = peers.get("llama.cpp")
    print(f"{model_path.name}: {len(prompt)} prompt tokens, {args.max_tokens} generated, {threads} threads")
    print("| peer | decode tok/s | vs llama.cpp | TTFT ms | weights resident MiB | RSS growth at load MiB "
          "| tokens equal to engine-fp32's |")
    print("|---|---|---|---|---|---|---|")
    for name, peer in peers.items():
        ratio = f"{peer['decode_tok_s'] / reference['decode_tok_s']:.2f}x" if reference else "-"
        mib = (f"{peer['weights_mib']:.0f} | {peer['load_rss_mib']:.0f}" if "weights_mib" in peer else "- | -")
        print(f"| {name} | {peer['decode_tok_s']:.1f} | {ratio} | {peer['ttft_ms']:.0f} | {mib} | "
              f"{_common_prefix(peer['tokens'], peers['engine-fp32']['tokens'])}/{len(peer['tokens'])} |")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
