"""Offline throughput: this engine vs transformers ``generate`` (static batches) vs transformers'
continuous batching (``generate_batch``) vs vLLM's CPU build (``vllm``, from its own venv: never a
dependency of this project), on one chat workload, the same model and the same threads.

Every peer gets the same token-id prompts, decodes greedily up to ``--max-tokens`` new tokens and
stops at the model's EOS. Output tokens are counted the same way for all: the generated tokens up
to and including the first EOS, capped at ``--max-tokens``. Only generation is timed; model loading
and a one-request warm-up are not. With --device cuda every peer runs on the GPU (bf16 by default).

Each peer runs in a fresh process (spawned one after the other), so each gets the process state it
would have on its own: the engine sets glibc's malloc thresholds for its process
(worker/cpu_allocator.py), and in one shared process the transformers peers that ran after it
inherited them (8% faster static ``generate`` on a 2-core Zen 4: 198 s instead of 214 s).

The vllm peer runs ``LLM.generate`` in the python given by --vllm-python, on the same token-id
prompts, with VLLM_CPU_OMP_THREADS_BIND=0-<threads - 1>, VLLM_CPU_KVCACHE_SPACE=4 (GiB) and the
LD_PRELOAD of tcmalloc and Intel OpenMP that vLLM's CPU guide recommends (where present), over
a copy of the model directory without the engine's own extra files (vLLM would load every
``*.safetensors`` it finds); its time is generate's wall time, warm-up excluded, as for the others.

    python benchmarks/throughput.py [--num-requests 64] [--max-tokens 128] [--json-out out.json] \\
        [--peers engine,hf-static,vllm --vllm-python /work/peers/vllm/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from metroserve import LLM, SamplingParams
from metroserve.benchmarks.workload import build_chat_workload
from metroserve.worker.config import (
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    QUANTIZED_ACTIVATIONS_CHOICES,
    EngineConfig,
)
from metroserve.worker.model_files import resolve_model_dir

PEERS = ("engine", "hf-static", "hf-cb", "vllm")
WARMUP_TEXT = "Warm-up request: say hello."


@dataclass
class PeerResult:
    """One peer's run: the outputs (trimmed at the first EOS) and the seconds spent generating."""

    peer: str
    outputs: list[list[int]]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.nan


class TimedSections:
    """Wall seconds spent in the timed sections of a peer's run, and how many cores other processes
    kept busy during them (from /proc/stat; not measured elsewhere)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._other_busy: float | None = 0.0

    @contextlib.contextmanager
    def section(self):
        busy, own, start = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            end_busy = _busy_cpu_seconds()
            if busy is None or end_busy is None or self._other_busy is None:
                self._other_busy = None
            else:
                self._other_busy += (end_busy - busy) - (_own_cpu_seconds() - own)

    def extra(self) -> dict[str, float]:
        if self._other_busy is None or self.seconds <= 0:
            return {}
        return {"other_processes_cores": max(0.0, self._other_busy) / self.seconds}


def trim_output(ids: list[int], eos_ids: set[int], max_tokens: int) -> list[int]:
    """Generated ids up to and including the first EOS, capped at max_tokens."""
    ids = list(ids[:max_tokens])
    for i, tok in enumerate(ids):
        if tok in eos_ids:
            return ids[: i + 1]
    return ids


def eos_token_ids(model_dir: Path) -> list[int]:
    """The model's EOS ids, from config.json and generation_config.json (as the engine reads them)."""
    ids: set[int] = set()
    sources = [AutoConfig.from_pretrained(model_dir)]
    with contextlib.suppress(OSError):  # no generation_config.json
        sources.append(GenerationConfig.from_pretrained(model_dir))
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if not ids:
        raise ValueError(f"{model_dir} names no eos_token_id; this benchmark needs natural EOS stops")
    return sorted(ids)


def greedy_config(max_tokens: int, eos_ids: list[int], pad_id: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The engine's defaults: CUDA when there is one; float32 on CPU, bfloat16 on CUDA."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    return dev, _DTYPES[dtype if dtype != "auto" else ("bfloat16" if dev.type == "cuda" else "float32")]


def load_hf_model(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A transformers causal LM: a PreTrainedModel with GenerationMixin, which no one class types."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    # transformers wraps PreTrainedModel.to in functools.wraps, which mypy reads as an unbound function.
    return model.to(device).eval()  # type: ignore[arg-type]


def run_engine(model: str | None, prompts: list[list[int]], warmup: list[int], max_tokens: int,
               eos_ids: list[int], device: torch.device, dtype: torch.dtype,
               speculative_config: str | None = None, quantization: str | None = None,
               quantized_activations: str = "float32", kv_cache_dtype: str = "auto") -> PeerResult:
    """metroserve's LLM.generate over all prompts at once; reports KV efficiency, prefix-cache hits and,
    with speculative decoding, its draft counters."""
    dtype_name = next(name for name, d in _DTYPES.items() if d == dtype)
    llm = LLM(model=model, device=device.type, dtype=dtype_name, speculative_config=speculative_config,
              quantization=quantization, quantized_activations=quantized_activations, kv_cache_dtype=kv_cache_dtype)
    llm.generate([warmup], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    before = llm.engine.stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    clock = TimedSections()
    with clock.section():
        outs = llm.generate(prompts, params, use_tqdm=True)
    after = llm.engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    extra = {
        **clock.extra(),
        "kv_efficiency_at_peak": after.kv_efficiency_at_peak,
        "peak_used_blocks": after.peak_used_blocks,
        "num_total_blocks": after.num_total_blocks,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
    }
    if after.spec_decode is not None:
        sd, sd0 = after.spec_decode, before.spec_decode
        drafts, accepted = sd.num_drafts - sd0.num_drafts, sd.num_accepted_tokens - sd0.num_accepted_tokens
        draft_tokens = sd.num_draft_tokens - sd0.num_draft_tokens
        extra.update(spec_num_drafts=drafts, spec_num_draft_tokens=draft_tokens, spec_num_accepted_tokens=accepted,
                     spec_acceptance_rate=accepted / draft_tokens if draft_tokens else 0.0,
                     spec_mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)
    outputs = [trim_output(list(o.outputs[0].token_ids), set(eos_ids), max_tokens) for o in outs]
    return PeerResult("engine", outputs, clock.seconds, extra)


def run_hf_static(model_dir: Path, prompts: list[list[int]], warmup: list[int], max_tokens: int,
                  eos_ids: list[int], pad_id: int, batch_size: int, device: torch.device,
                  dtype: torch.dtype) -> PeerResult:
    """transformers generate on left-padded static batches of batch_size, in request order."""
    model = load_hf_model(model_dir, device, dtype)
    config = greedy_config(max_tokens, eos_ids, pad_id)

    def generate(batch: list[list[int]], gen_config: GenerationConfig) -> list[list[int]]:
        width = max(map(len, batch))
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             generation_config=gen_config)
        return out[:, width:].tolist()  # drop the (left-padded) prompt columns

    generate([warmup], greedy_config(4, eos_ids, pad_id))
    outputs: list[list[int]] = []
    clock = TimedSections()
    with tqdm(total=len(prompts), desc="hf-static", unit="req") as bar:
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            with clock.section():
                generated = generate(batch, config)
            outputs += [trim_output(ids, set(eos_ids), max_tokens) for ids in generated]
            bar.update(len(batch))
    return PeerResult("hf-static", outputs, clock.seconds, {"batch_size": batch_size, **clock.extra()})


def cb_config(prompts: list[list[int]], max_tokens: int, seed: int):
    """Continuous-batching settings for CPU, matched to the engine's defaults.

    Pages of the engine's block size (16 tokens, not the default 256, which strands ~128 tokens per
    request); a batch budget equal to the engine's max_num_batched_tokens; and a pool that holds the
    whole workload at once (as the engine's 4GiB pool does), since on CPU transformers would
    otherwise size the pool from 90% of free host RAM.
    """
    # Imported here so that a transformers without it fails only this peer, not the module.
    from transformers import ContinuousBatchingConfig

    # transformers renamed block_size to page_size (5.17, on the GPU image, has the first; 5.24 the second).
    page_field = next(f.name for f in dataclasses.fields(ContinuousBatchingConfig)
                      if f.name in ("page_size", "block_size"))
    engine_defaults = EngineConfig()
    page = engine_defaults.block_size
    num_blocks = sum(math.ceil((len(p) + max_tokens) / page) for p in prompts)
    page_arg: dict[str, Any] = {page_field: page}
    return ContinuousBatchingConfig(**page_arg, num_blocks=num_blocks,
                                    max_batch_tokens=engine_defaults.max_num_batched_tokens, seed=seed)



def run_hf_cb(model_dir: Path, prompts: list[list[int]], warmup: list[int], max_tokens: int,
              eos_ids: list[int], pad_id: int, seed: int, device: torch.device, dtype: torch.dtype) -> PeerResult:
    """transformers' continuous batching (generate_batch): SDPA over its paged cache."""
    model = load_hf_model(model_dir, device, dtype)
    config = greedy_config(max_tokens, eos_ids, pad_id)
    cb = cb_config(prompts, max_tokens, seed)
    model.generate_batch(inputs=[warmup], generation_config=greedy_config(4, eos_ids, pad_id),
                         continuous_batching_config=cb_config([warmup], 4, seed))
    clock = TimedSections()
    with clock.section():
        results = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                                       progress_bar=True)
    done = list(results.values())  # in input order
    failed = [r.request_id for r in done if r.error is not None]
    if len(done) != len(prompts) or failed:
        raise RuntimeError(f"generate_batch finished {len(done)}/{len(prompts)} requests; failed: {failed}")
    outputs = [trim_output(r.generated_tokens, set(eos_ids), max_tokens) for r in done]
    extra = {"attn_implementation": model.config._attn_implementation,
             "page_size": getattr(cb, "page_size", getattr(cb, "block_size", None)),
             "num_blocks": cb.num_blocks, "max_batch_tokens": cb.max_batch_tokens, **clock.extra()}
    return PeerResult("hf-cb", outputs, clock.seconds, extra)


# Run by the vLLM venv's python as a script: argv = model dir, dtype, max tokens, JSON file of {"prompts", "warmup"};
# prints {"outputs", "seconds", "version"} as one line.
_VLLM = r"""
import json, sys, time
from vllm import LLM, SamplingParams, __version__
from vllm.inputs import TokensPrompt
def main():  # vLLM spawns its engine process: the work must not run on that child's import
    model_dir, dtype, max_tokens, job = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.load(open(sys.argv[4]))
    llm = LLM(model_dir, dtype=dtype, max_model_len=4096, seed=0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    warmup = [TokensPrompt(prompt_token_ids=job["warmup"])]
    llm.generate(warmup, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
                      "version": __version__}))
if __name__ == "__main__":
    main()
"""


def run_vllm(python: str, model_dir: Path, prompts: list[list[int]], warmup: list[int], max_tokens: int,
             eos_ids: list[int], dtype: torch.dtype) -> PeerResult:
    """vLLM's offline LLM.generate in its own venv's python (see the module docstring)."""
    dtype_name = next(name for name, d in _DTYPES.items() if d == dtype)
    threads = torch.get_num_threads()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
    preload = vllm_preload(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    with tempfile.TemporaryDirectory() as tmp:
        model_copy = Path(tmp) / model_dir.name
        model_copy.mkdir()
        for item in model_dir.iterdir():
            if item.suffix != ".safetensors" or item.name == "model.safetensors":
                (model_copy / item.name).symlink_to(item)
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"prompts": prompts, "warmup": warmup}))
        script = Path(tmp) / "run_vllm.py"  # a file, not -c: vLLM's spawned engine process re-imports it
        script.write_text(_VLLM)
        out = subprocess.run([python, str(script), str(model_copy), dtype_name, str(max_tokens), str(job)],
                             env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"vllm exited with {out.returncode}: {out.stderr[-2000:]}")
    # vLLM logs to stdout too, some of it after the result line.
    result = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"outputs"')))
    outputs = [trim_output(o, set(eos_ids), max_tokens) for o in result["outputs"]]
    return PeerResult("vllm", outputs, result["seconds"], {"version": result["version"], "ld_preload": preload})


def vllm_preload(python: str) -> list[str]:
    """The libraries vLLM's CPU guide preloads for speed, where present: tcmalloc (Debian's
    libtcmalloc-minimal4) and Intel's OpenMP runtime from the vLLM venv (the intel-openmp wheel)."""
    candidates = (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                  Path(python).parents[1] / "lib" / "libiomp5.so")  # <venv>/bin/python -> <venv>/lib
    return [str(path) for path in candidates if path.is_file()]


def _run_peer(peer: str, args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], warmup: list[int],
              eos_ids: list[int], pad_id: int, device: torch.device, dtype: torch.dtype) -> PeerResult:
    """One peer's run, in its own process."""
    if peer == "engine":
        return run_engine(args.model, prompts, warmup, args.max_tokens, eos_ids, device, dtype,
                          args.speculative_config, args.quantization, args.quantized_activations,
                          args.kv_cache_dtype)
    if peer == "hf-static":
        return run_hf_static(model_dir, prompts, warmup, args.max_tokens, eos_ids, pad_id, args.hf_batch_size,
                             device, dtype)
    if peer == "vllm":
        if not args.vllm_python:
            raise ValueError("the vllm peer needs --vllm-python (a venv with vllm-cpu installed)")
        vllm_dtype = dtype if args.vllm_dtype is None else device_and_dtype(args.device, args.vllm_dtype)[1]
        return run_vllm(args.vllm_python, model_dir, prompts, warmup, args.max_tokens, eos_ids, vllm_dtype)
    return run_hf_cb(model_dir, prompts, warmup, args.max_tokens, eos_ids, pad_id, args.seed, device, dtype)


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF-format model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=64, help="chat requests in the workload")
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens per request")
    parser.add_argument("--peers", default="engine,hf-static,hf-cb",
                        help=f"comma list of {', '.join(PEERS)} (vllm needs --vllm-python)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf-static peer")
    parser.add_argument("--json-out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                        help="all peers' dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--vllm-dtype", default=None, choices=["auto", *_DTYPES],
                        help="the vllm peer's dtype instead of --dtype, to run each engine at its best setting in "
                             "one run (e.g. metroserve with --quantized-activations int8 against vLLM in bfloat16)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="run the engine peer with speculative decoding (same JSON as the engine flag)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a venv with vllm-cpu installed, for the vllm peer (never a project dependency)")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                        help="the engine peer's --quantization (default: the checkpoint's own, e.g. a GGUF's "
                             "Q4_1 matrices served quantized; the transformers peers run the dequantized weights)")
    parser.add_argument("--quantized-activations", default="float32", choices=QUANTIZED_ACTIVATIONS_CHOICES,
                        help="the engine peer's --quantized-activations (int8: integer products, opt-in)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                        help="the engine peer's --kv-cache-dtype (bfloat16: half the KV bytes, opt-in)")


def _print_report(report: dict[str, Any]) -> None:
    peers = report["peers"]
    print(f"\nmodel {report['model_dir']}  {report['device']} {report['dtype']}  "
          f"torch threads {report['torch_threads']}  "
          f"requests {report['num_requests']}  prompt tokens {report['prompt_tokens']} "
          f"({report['prompt_len_min']}-{report['prompt_len_max']})  max new tokens {report['max_tokens']}")
    print(f"engine: quantization {report['quantization'] or 'default'}, quantized activations "
          f"{report['quantized_activations']}, kv cache {report['kv_cache_dtype']}; vllm dtype "
          f"{report['vllm_dtype'] or report['dtype']}")
    print(f"{'peer':<10} {'requests':>8} {'out tok':>8} {'seconds':>9} {'out tok/s':>10} {'engine/peer':>12} "
          f"{'other cores':>12}")
    for name, p in peers.items():
        ratio = f"{p['engine_over_peer']:.2f}x" if "engine_over_peer" in p else "-"
        others = f"{p['other_processes_cores']:.2f}" if "other_processes_cores" in p else "-"
        print(f"{name:<10} {p['requests']:>8} {p['output_tokens']:>8} {p['seconds']:>9.1f} "
              f"{p['tokens_per_s']:>10.1f} {ratio:>12} {others:>12}")
    print(f"(other cores: mean cores other processes kept busy while the peer was timed, of {os.cpu_count()}; "
          "well above 0 means the peer's numbers are low)")
    if "engine" in peers:
        e = peers["engine"]
        print(f"engine: KV efficiency at peak {e['kv_efficiency_at_peak']:.3f} (target >= 0.96, "
              f"{e['peak_used_blocks']}/{e['num_total_blocks']} blocks), preemptions {e['num_preemptions']}, "
              f"prefix-cache hits {e['prefix_cache_hits']}/{e['prefix_cache_queries']} prompt tokens "
              f"({e['prefix_cache_hit_rate']:.1%})")
        if "spec_num_drafts" in e:
            print(f"engine speculation: {e['spec_num_drafts']} drafts, {e['spec_num_draft_tokens']} draft tokens, "
                  f"{e['spec_num_accepted_tokens']} accepted (rate {e['spec_acceptance_rate']:.2f}, "
                  f"mean acceptance length {e['spec_mean_acceptance_length']:.2f})")
    for name, same in report["identical_to_engine"].items():
        print(f"greedy outputs token-identical, engine vs {name}: {same}/{report['num_requests']}")
    for name, error in report["failed_peers"].items():
        print(f"peer {name} FAILED: {error}")
    print(f"wall time (loads, warm-ups and all peers): {report['wall_seconds']:.0f}s")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected peers on one workload, print the table and return the results."""
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown or not peers:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    wall_start = time.perf_counter()
    device, dtype = device_and_dtype(args.device, args.dtype)
    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos_ids = eos_token_ids(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    prompts = build_chat_workload(tokenizer, num_requests=args.num_requests, seed=args.seed)
    warmup = tokenizer.encode(WARMUP_TEXT, add_special_tokens=False)
    print(f"torch threads: {torch.get_num_threads()}; {len(prompts)} prompts, "
          f"{sum(map(len, prompts))} prompt tokens; peers: {', '.join(peers)}")

    results: dict[str, PeerResult] = {}
    failed: dict[str, str] = {}
    spawn = multiprocessing.get_context("spawn")
    for peer in peers:
        print(f"== {peer}", flush=True)
        try:
            with spawn.Pool(1) as pool:  # a fresh process per peer (see the module docstring)
                results[peer] = pool.apply(_run_peer, (peer, args, model_dir, prompts, warmup, eos_ids, pad_id,
                                                       device, dtype))
        except Exception as exc:  # noqa: BLE001 - one peer's failure (e.g. an older transformers) is reported
            logging.exception("peer %s failed", peer)
            failed[peer] = f"{type(exc).__name__}: {exc}"

    engine = results.get("engine")
    report: dict[str, Any] = {
        "model_dir": str(model_dir), "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "quantization": args.quantization, "quantized_activations": args.quantized_activations,
        "kv_cache_dtype": args.kv_cache_dtype, "vllm_dtype": args.vllm_dtype,
        "torch_threads": torch.get_num_threads(), "num_requests": len(prompts),
        "max_tokens": args.max_tokens, "seed": args.seed, "prompt_tokens": sum(map(len, prompts)),
        "prompt_len_min": min(map(len, prompts)), "prompt_len_max": max(map(len, prompts)), "peers": {},
        "identical_to_engine": {}, "failed_peers": failed,
    }
    for name, r in results.items():
        entry = {"requests": len(r.outputs), "output_tokens": r.output_tokens, "seconds": r.seconds,
                 "tokens_per_s": r.tokens_per_s, **r.extra}
        if engine is not None:
            entry["engine_over_peer"] = engine.tokens_per_s / r.tokens_per_s
            if r is not engine:
                same = sum(a == b for a, b in zip(engine.outputs, r.outputs))
                report["identical_to_engine"][name] = same
        report["peers"][name] = entry
    report["wall_seconds"] = time.perf_counter() - wall_start
    _print_report(report)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    report = run(parser.parse_args(argv))
    return 1 if report["failed_peers"] else 0


if __name__ == "__main__":
    sys.exit(main())
