"""What another process on the machine costs the engine: offline decode throughput alone and
beside a bursty CPU hog (by default 6 ms of busy loop every 70 ms, about 8% of one core: what the
gateway, scheduler and a benchmark client used together in a served run of the service-overhead
benchmark on 2 cores). Under `serve` those processes share the worker's cores, so this bounds what
the service path can keep of offline throughput on a small machine.

    python -m metroserve.benchmarks.colocated_load --rounds 3

Rounds alternate which mode goes first; the report gives each run and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

HOG = ("import sys, time\nperiod, burst = float(sys.argv[1]), float(sys.argv[2])\nwhile True:\n"
       "    time.sleep(period)\n    t = time.perf_counter()\n    while time.perf_counter() - t < burst: pass\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=32, help="also the engine's max_num_seqs")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hog-period-ms", type=float, default=70.0, help="sleep between bursts")
    parser.add_argument("--hog-burst-ms", type=float, default=6.0, help="busy loop per burst")
    args = parser.parse_args()

    from metroserve import LLM, SamplingParams
    from metroserve.benchmarks.workload import build_chat_workload
    from metroserve.worker.model_files import resolve_model_dir

    llm = LLM(model=str(resolve_model_dir(args.model)), max_num_seqs=args.num_requests, kv_cache_memory="1GiB",
              enable_prefix_caching=False)
    prompts = build_chat_workload(llm.get_tokenizer(), num_requests=args.num_requests)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    hog_args = [sys.executable, "-c", HOG, str(args.hog_period_ms / 1e3), str(args.hog_burst_ms / 1e3)]
    runs: dict[str, list[float]] = {"alone": [], "beside the hog": []}
    for round_index in range(args.rounds):
        for mode in list(runs) if round_index % 2 == 0 else list(runs)[::-1]:
            hog = subprocess.Popen(hog_args) if mode != "alone" else None
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if hog is not None:
                hog.kill()
                hog.wait()
            runs[mode].append(len(prompts) * args.max_tokens / seconds)
            print(f"round {round_index} {mode:15s} {runs[mode][-1]:.1f} tok/s", flush=True)
    med = {mode: statistics.median(v) for mode, v in runs.items()}
    print(f"median tok/s: alone {med['alone']:.1f}, beside the hog {med['beside the hog']:.1f}; "
          f"ratio {med['beside the hog'] / med['alone']:.3f}")


if __name__ == "__main__":
    main()
