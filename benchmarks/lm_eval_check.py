"""lm-evaluation-harness against `metroserve serve`: the same accuracy as lm-eval's own `hf` backend.

Writes two local lm-eval tasks (generated, deterministic; the hub is never used), then runs lm-eval
(installed in its own venv, given by --lm-eval-python) four times on the same float32 weights:

    hf                                          ms_mc (multiple choice) + ms_gen (generate-until)
    local-completions -> serve /v1/completions  ms_mc (echo + logprobs, token-id prompts) + ms_gen
    hf --apply_chat_template                    ms_gen
    local-chat-completions --apply_chat_template -> serve /v1/chat/completions   ms_gen

`serve` runs with --quantization none, i.e. the float32 weights of the converted Hugging Face
directory that `hf` loads with transformers. The tasks:

    ms_mc   multiple choice (loglikelihood of each choice after "Question: ...\\nAnswer:"): capital
            cities, which of two numbers is larger, antonyms; metrics acc and acc_norm.
    ms_gen  "Q: What is 12 + 7?\\nA:" (additions, subtractions, small products), greedy, until "\\n",
            max_gen_toks 16; exact match of the last number in the answer.

It prints a markdown table of accuracies and the differences from `hf`, and a per-item comparison
of the two backends (largest loglikelihood difference, items whose chosen answer differs and the hf
margin between their top two choices; generations that differ), and writes everything as JSON.

    .venv/bin/python benchmarks/lm_eval_check.py --lm-eval-python /work/peers/lmeval/bin/python

lm-eval's venv: python3.11 -m venv /work/peers/lmeval && /work/peers/lmeval/bin/pip install
torch==2.13.0 && /work/peers/lmeval/bin/pip install 'lm-eval[api,hf]' accelerate (lm-eval 0.4.13's
`api` extra no longer brings transformers; `hf` does).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "lm_eval" / "lm_eval_check.json"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# -- the tasks -------------------------------------------------------------------------------------

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"),
    ("Egypt", "Cairo"), ("Greece", "Athens"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Hungary", "Budapest"), ("Ireland", "Dublin"), ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"),
    ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Argentina", "Buenos Aires"),
    ("Mexico", "Mexico City"), ("Canada", "Ottawa"), ("Australia", "Canberra"), ("India", "New Delhi"),
    ("Thailand", "Bangkok"), ("South Korea", "Seoul"), ("Turkey", "Ankara"), ("Iran", "Tehran"),
    ("Cuba", "Havana"), ("Colombia", "Bogota"), ("Ukraine", "Kyiv"), ("Czech Republic", "Prague"),
    ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("Nigeria", "Abuja"), ("United Kingdom", "London"),
]
ANTONYMS = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
    ("up", "down"), ("open", "closed"), ("early", "late"), ("rich", "poor"), ("strong", "weak"),
    ("hard", "soft"), ("wet", "dry"), ("young", "old"), ("full", "empty"), ("high", "low"),
    ("long", "short"), ("loud", "quiet"), ("thick", "thin"), ("heavy", "light"), ("clean", "dirty"),
    ("true", "false"), ("win", "lose"), ("buy", "sell"), ("push", "pull"), ("love", "hate"),
    ("day", "night"), ("inside", "outside"), ("begin", "end"), ("first", "last"), ("near", "far"),
    ("safe", "dangerous"), ("cheap", "expensive"), ("easy", "difficult"), ("friend", "enemy"),
    ("north", "south"), ("east", "west"), ("left", "right"), ("always", "never"), ("give", "take"),
    ("arrive", "leave"),
]


def multiple_choice_docs(seed: int) -> list[dict]:
    """40 capitals (4 choices), 40 comparisons (2 choices), 40 antonyms (4 choices); answer: its index."""
    rng = random.Random(seed)
    docs: list[dict] = []

    def add(question: str, right: str, wrong: list[str], kind: str) -> None:
        choices = [right, *wrong]
        rng.shuffle(choices)
        docs.append({"id": len(docs), "kind": kind, "question": question, "choices": choices,
                     "answer": choices.index(right)})

    capitals = [c for _, c in CAPITALS]
    for country, capital in CAPITALS:
        add(f"What is the capital of {country}?", capital,
            rng.sample([c for c in capitals if c != capital], 3), "capital")
    for _ in range(40):
        a, b = rng.sample(range(2, 100), 2)
        add(f"Which number is larger, {a} or {b}?", str(max(a, b)), [str(min(a, b))], "compare")
    words = sorted({w for pair in ANTONYMS for w in pair})
    for word, opposite in ANTONYMS:
        wrong = rng.sample([w for w in words if w not in (word, opposite)], 3)
        add(f"What is the opposite of the word \"{word}\"?", opposite, wrong, "antonym")
    return docs


def generation_docs(seed: int, n: int = 100) -> list[dict]:
    """n arithmetic questions with integer answers: sums, differences (non-negative), small products."""
    rng = random.Random(seed + 1)
    docs = []
    for i in range(n):
        kind = ("add", "sub", "mul")[i % 3]
        if kind == "add":
            a, b = rng.randint(1, 60), rng.randint(1, 60)
            q, ans = f"What is {a} + {b}?", a + b
        elif kind == "sub":
            a, b = sorted(rng.sample(range(1, 100), 2), reverse=True)
            q, ans = f"What is {a} - {b}?", a - b
        else:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            q, ans = f"What is {a} times {b}?", a * b
        docs.append({"id": i, "kind": kind, "question": q, "answer": str(ans)})
    return docs


MC_YAML = """\
task: ms_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN_YAML = """\
task: ms_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
  temperature: 0.0
filter_list:
  - name: last_number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_tasks(task_dir: Path, seed: int, max_gen_toks: int) -> dict[str, int]:
    task_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, docs, yaml in (("ms_mc", multiple_choice_docs(seed), MC_YAML),
                             ("ms_gen", generation_docs(seed), GEN_YAML)):
        data = task_dir / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (task_dir / f"{name}.yaml").write_text(yaml.format(data=data, max_gen_toks=max_gen_toks))
        counts[name] = len(docs)
    return counts


# -- serve -----------------------------------------------------------------------------------------

def get_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def start_serve(log_path: Path, extra: list[str], timeout_s: float) -> tuple[subprocess.Popen, str, str]:
    """`metroserve serve --quantization none` on free loopback ports; returns (process, base url, model id)
    once /health answers 200 (a worker is ready) and /v1/models lists the model."""
    from metroserve.benchmarks.cluster import free_port

    port, scheduler_port = free_port(), free_port()
    args = [sys.executable, "-m", "metroserve.services.cli", "serve", "--quantization", "none",
            "--port", str(port), "--scheduler-port", str(scheduler_port), "--grpc-port", "0",
            "--metrics-port", "0", "--disable-log-requests", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}; log:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as reply:
                if reply.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            stop_serve(proc)
            raise RuntimeError(f"serve not ready after {timeout_s}s; log:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    model = get_json(base + "/v1/models")["data"][0]["id"]
    print(f"serve ready at {base}/v1 (model {model}) with {' '.join(args[3:])}", flush=True)
    return proc, base, model


def stop_serve(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- lm-eval ---------------------------------------------------------------------------------------

def run_lm_eval(name: str, lm_eval_python: str, model: str, model_args: str, tasks: list[str], task_dir: Path,
                out_dir: Path, limit: int | None, chat: bool, env: dict, batch_size: int) -> dict:
    """One `lm_eval run`; returns its results JSON and its samples, per task (keyed by doc id)."""
    run_dir = out_dir / name
    cmd = [lm_eval_python, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
           "--tasks", ",".join(tasks), "--include_path", str(task_dir), "--batch_size", str(batch_size),
           "--output_path", str(run_dir), "--log_samples", "--seed", "1234"]
    if model == "hf":
        cmd += ["--device", "cpu"]
    if chat:
        cmd += ["--apply_chat_template"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    print(f"\n[{name}] {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with open(out_dir / f"{name}.log", "wb") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - t0
    if rc != 0:
        raise RuntimeError(f"lm-eval {name} exited with {rc}; log:\n{(out_dir / f'{name}.log').read_text()[-6000:]}")
    results_file = sorted(glob.glob(str(run_dir / "**" / "results_*.json"), recursive=True))[-1]
    results = json.loads(Path(results_file).read_text())
    samples = {}
    for task in tasks:
        path = sorted(glob.glob(str(run_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True))[-1]
        samples[task] = {s["doc_id"]: s for s in map(json.loads, Path(path).read_text().splitlines())}
    print(f"[{name}] done in {seconds:.0f} s", flush=True)
    return {"command": cmd, "seconds": round(seconds, 1), "results": results["results"], "samples": samples,
            "n_samples": results.get("n-samples", {})}


def metric(run: dict, task: str, key: str) -> float:
    return float(run["results"][task][key])


# -- per-item comparison ---------------------------------------------------------------------------

def compare_mc(ref: dict, other: dict) -> dict:
    """Loglikelihoods per (doc, choice): the largest difference; docs whose argmax (acc) differs."""
    diffs, flips, items = [], [], []
    for doc_id, a in sorted(ref.items()):
        b = other[doc_id]
        lla = [float(r[0][0]) for r in a["resps"]]
        llb = [float(r[0][0]) for r in b["resps"]]
        diffs += [abs(x - y) for x, y in zip(lla, llb)]
        items.append({"doc_id": doc_id, "hf_ll": lla, "other_ll": llb})
        pick_a, pick_b = max(range(len(lla)), key=lla.__getitem__), max(range(len(llb)), key=llb.__getitem__)
        if pick_a != pick_b or a["acc"] != b["acc"]:
            top2 = sorted(lla, reverse=True)[:2]
            flips.append({"doc_id": doc_id, "question": a["doc"]["question"], "choices": a["doc"]["choices"],
                          "hf_ll": lla, "other_ll": llb, "hf_margin": top2[0] - top2[1],
                          "hf_acc": a["acc"], "other_acc": b["acc"]})
    return {"choices_compared": len(diffs), "max_abs_ll_diff": max(diffs), "mean_abs_ll_diff": sum(diffs) / len(diffs),
            "docs_with_different_pick": flips, "per_item": items}


def compare_gen(ref: dict, other: dict) -> dict:
    differ, items = [], []
    for doc_id, a in sorted(ref.items()):
        b = other[doc_id]
        ta, tb = a["resps"][0][0], b["resps"][0][0]
        items.append({"doc_id": doc_id, "hf": ta, "other": tb})
        if ta != tb:
            differ.append({"doc_id": doc_id, "question": a["doc"]["question"], "hf": ta, "other": tb,
                           "hf_em": a["exact_match"], "other_em": b["exact_match"]})
    return {"docs_compared": len(ref), "different_generations": differ, "per_item": items}


# -- main ------------------------------------------------------------------------------------------

def package_versions(python: str, names: list[str]) -> dict:
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    return json.loads(subprocess.run([python, "-c", code, *names], capture_output=True, text=True, check=True).stdout)


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run lm-evaluation-harness against `metroserve serve --quantization none` (local-completions "
                    "and local-chat-completions) and against lm-eval's own `hf` backend on the same float32 weights, "
                    "on two generated local tasks (multiple choice by loglikelihood; generate-until with exact "
                    "match); print the accuracies, their differences and a per-item comparison.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lm-eval-python", default="/work/peers/lmeval/bin/python",
                   help="python of the venv that has lm-eval[api,hf] (never the project's .venv)")
    p.add_argument("--limit", type=int, default=None,
                   help="items per task (lm-eval --limit); default: all (120 multiple choice, 100 generate)")
    p.add_argument("--model-dir", default=None,
                   help="Hugging Face model directory for hf and the tokenizer; default: the default model's "
                        "converted directory (resolve_model_dir(None)), which serve also loads")
    p.add_argument("--num-concurrent", type=int, default=8, help="lm-eval num_concurrent for the API backends")
    p.add_argument("--max-retries", type=int, default=3, help="lm-eval max_retries for the API backends")
    p.add_argument("--api-batch-size", type=int, default=1,
                   help="lm-eval --batch_size for local-completions (prompts per request; chat is always 1)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="lm-eval --batch_size for hf")
    p.add_argument("--max-gen-toks", type=int, default=16, help="ms_gen's max_gen_toks")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated task data")
    p.add_argument("--work-dir", default=None, help="tasks, lm-eval outputs and logs (default: a temporary dir)")
    p.add_argument("--json-out", default=str(DEFAULT_OUT), help="result JSON")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for `metroserve serve` (repeatable), e.g. --serve-arg=--kv-cache-memory=1GiB")
    p.add_argument("--serve-timeout", type=float, default=600, help="seconds to wait for serve to be ready")
    args = p.parse_args(argv)

    from metroserve.worker.model_files import resolve_model_dir

    model_dir = str(Path(args.model_dir) if args.model_dir else resolve_model_dir(None))
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="lm_eval_check-"))
    work.mkdir(parents=True, exist_ok=True)
    task_dir, out_dir = work / "tasks", work / "runs"
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = write_tasks(task_dir, args.seed, args.max_gen_toks)
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(work / "hf_datasets"), "TOKENIZERS_PARALLELISM": "false"}
    print(f"model dir {model_dir}\nwork dir {work}\ntasks {counts}", flush=True)
    t_start = time.monotonic()

    hf_args = f"pretrained={model_dir},dtype=float32"
    runs: dict[str, dict] = {}
    runs["hf"] = run_lm_eval("hf", args.lm_eval_python, "hf", hf_args, ["ms_mc", "ms_gen"], task_dir, out_dir,
                             args.limit, False, env, args.hf_batch_size)
    runs["hf-chat"] = run_lm_eval("hf-chat", args.lm_eval_python, "hf", hf_args, ["ms_gen"], task_dir, out_dir,
                                  args.limit, True, env, args.hf_batch_size)

    proc, base, served = start_serve(work / "serve.log", args.serve_arg, args.serve_timeout)
    try:
        api = (f"model={served},tokenizer={model_dir},tokenizer_backend=huggingface,"
               f"num_concurrent={args.num_concurrent},max_retries={args.max_retries}")
        runs["local-completions"] = run_lm_eval(
            "local-completions", args.lm_eval_python, "local-completions",
            f"{api},base_url={base}/v1/completions,tokenized_requests=True", ["ms_mc", "ms_gen"], task_dir, out_dir,
            args.limit, False, env, args.api_batch_size)
        runs["local-chat-completions"] = run_lm_eval(
            "local-chat-completions", args.lm_eval_python, "local-chat-completions",
            f"{api},base_url={base}/v1/chat/completions,tokenized_requests=False", ["ms_gen"], task_dir, out_dir,
            args.limit, True, env, 1)
    finally:
        stop_serve(proc)
    total_s = time.monotonic() - t_start

    rows = [  # (task / metric, reference run, server run)
        ("ms_mc acc (loglikelihood)", "ms_mc", "acc,none", "hf", "local-completions"),
        ("ms_mc acc_norm (loglikelihood)", "ms_mc", "acc_norm,none", "hf", "local-completions"),
        ("ms_gen exact_match (completions)", "ms_gen", "exact_match,last_number", "hf", "local-completions"),
        ("ms_gen exact_match (chat template)", "ms_gen", "exact_match,last_number", "hf-chat",
         "local-chat-completions"),
    ]
    table = []
    for label, task, key, ref, other in rows:
        a, b = 100 * metric(runs[ref], task, key), 100 * metric(runs[other], task, key)
        n = len(runs[ref]["samples"][task])
        table.append({"row": label, "task": task, "metric": key, "items": n, "hf_backend": ref, "server_backend": other,
                      "hf": round(a, 2), "serve": round(b, 2), "diff_points": round(b - a, 2),
                      "within_1_point": abs(b - a) <= 1.0})
    comparison = {
        "ms_mc hf vs local-completions": compare_mc(runs["hf"]["samples"]["ms_mc"],
                                                    runs["local-completions"]["samples"]["ms_mc"]),
        "ms_gen hf vs local-completions": compare_gen(runs["hf"]["samples"]["ms_gen"],
                                                      runs["local-completions"]["samples"]["ms_gen"]),
        "ms_gen hf-chat vs local-chat-completions": compare_gen(runs["hf-chat"]["samples"]["ms_gen"],
                                                                runs["local-chat-completions"]["samples"]["ms_gen"]),
    }

    print("\n| task, metric | items | lm-eval `hf` | lm-eval -> serve | serve - hf (points) | lm-eval backends |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['row']} | {r['items']} | {r['hf']:.1f} | {r['serve']:.1f} | {r['diff_points']:+.1f} | "
              f"`{r['hf_backend']}` vs `{r['server_backend']}` |")
    mc = comparison["ms_mc hf vs local-completions"]
    print(f"\nms_mc per choice ({mc['choices_compared']} loglikelihoods): max |hf - serve| "
          f"{mc['max_abs_ll_diff']:.2e}, mean {mc['mean_abs_ll_diff']:.2e}; "
          f"docs whose pick differs: {len(mc['docs_with_different_pick'])}")
    for f in mc["docs_with_different_pick"]:
        print(f"  doc {f['doc_id']} {f['question']!r}: hf margin {f['hf_margin']:.2e}, hf ll {f['hf_ll']}, "
              f"serve ll {f['other_ll']}")
    for key in ("ms_gen hf vs local-completions", "ms_gen hf-chat vs local-chat-completions"):
        g = comparison[key]
        print(f"{key}: {len(g['different_generations'])} of {g['docs_compared']} generations differ")
        for d in g["different_generations"]:
            print(f"  doc {d['doc_id']} {d['question']!r}: hf {d['hf']!r} serve {d['other']!r}")

    lm_versions = package_versions(args.lm_eval_python, ["lm_eval", "transformers", "torch", "datasets"])
    project_versions = package_versions(sys.executable, ["metroserve", "transformers", "torch"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "nproc": os.cpu_count(),
        "commit": commit.strip() + ("+uncommitted" if dirty else ""), "model_dir": model_dir,
        "lm_eval_env": lm_versions, "project_env": project_versions, "limit": args.limit, "task_items": counts,
        "total_seconds": round(total_s, 1), "command": [sys.executable, *sys.argv] if argv is None else argv,
        "table": table, "comparison": comparison,
        "runs": {k: {"command": v["command"], "seconds": v["seconds"], "results": v["results"]}
                 for k, v in runs.items()},
        "tasks": {name: (task_dir / f"{name}.yaml").read_text() for name in counts},
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nlm-eval {lm_versions['lm_eval']}; total {total_s:.0f} s; wrote {out}")
    return 0 if all(r["within_1_point"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
