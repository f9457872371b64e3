"""Structured outputs: what grammar token masks add to a decode step at batch 32.

B requests (default 32) decode at once, greedy, for --max-tokens new tokens, once unconstrained and
once under each constraint (arms):
- unconstrained: ignore_eos, so all B rows decode for the whole run;
- json: a JSON schema with bounded strings and integers, an array with minItems high enough that
  the grammar cannot complete within --max-tokens (so no request ends early);
- regex: a character class repeated at least --regex-min-chars times (the same: it cannot end early);
- choice: one of four long sentences. A choice ends after a few tens of tokens, so it gives fewer
  full-batch decode steps; its rows count only the steps where all B rows still decode.
Constrained requests run with ignore_eos too; they end only when the grammar completes (or at
--max-tokens).

The benchmark drives the engine itself (``llm.engine.add_request`` / ``llm.engine.step``) and
times every ``step()``; only steps whose batch is B sequences each decoding one token (no prefill
chunk, no finished row) are counted: median and p90 over them. For the constrained arms it also
times, per counted step, through wrappers on the engine's StructuredOutputs and xgrammar's
GrammarMatcher (a few microseconds per step):
- fill: ``StructuredOutputs._masks`` (the bitmask rows of all B matchers), which runs in the mask
  thread, submitted before the model's forward;
- wait: how long the engine thread blocked in ``Future.result()`` for it after the logits: the
  part of the fill NOT hidden behind the forward (hidden = fill - wait);
- apply: ``StructuredOutputs.apply_masks`` (bitmask -> -inf logits);
- accept: ``GrammarMatcher.accept_token`` for the B sampled tokens (engine thread, after sampling);
- execute: ``ModelRunner.execute`` (inputs, forward, logits, masks, sampling), to show how much the
  forward itself slows while the mask thread runs beside it on the same cores.
Arms run in the same process on one engine (prefix caching off, so every arm prefills the same
prompts and decodes over the same context lengths), interleaved: each round runs every arm, the
order rotating between rounds; each round's ratio (arm median / unconstrained median of the same
round) is reported. ``other cores``: cores other processes kept busy during the arm (/proc/stat).

    python benchmarks/structured_outputs.py [--quantization default,none] [--rounds 3] [--batch 32] \\
        [--max-tokens 128] [--arms unconstrained,json,regex,choice] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import Future
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("unconstrained", "json", "regex", "choice")
RESULTS = Path(__file__).resolve().parent / "results" / "structured_outputs"
TOPICS = ("a lighthouse keeper", "a chess club", "a bakery", "a mountain village", "a space station crew",
          "a jazz band", "a school robotics team", "a fishing boat")


def json_schema(min_items: int) -> str:
    person = {"type": "object",
              "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 24},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120},
                             "city": {"type": "string", "minLength": 1, "maxLength": 16}},
              "required": ["name", "age", "city"]}
    return json.dumps({"type": "object",
                       "properties": {"people": {"type": "array", "items": person, "minItems": min_items}},
                       "required": ["people"]})


CHOICES = (
    "The first option is that the committee approves the whole proposal today without any further changes.",
    "The second option is that the committee rejects the proposal and asks the authors to start again.",
    "The third option is that the committee delays its decision until the next meeting in the spring.",
    "The fourth option is that the committee approves only the budget and sends the rest back for review.",
)


def constraint(arm: str, args: argparse.Namespace):
    from metroserve.common.structured_outputs import StructuredOutputsParams

    if arm == "unconstrained":
        return None
    if arm == "json":
        return StructuredOutputsParams(json=json_schema(args.json_min_items))
    if arm == "regex":
        return StructuredOutputsParams(regex=f"[a-z ]{{{args.regex_min_chars},}}")
    if arm == "choice":
        return StructuredOutputsParams(choice=CHOICES)
    raise ValueError(arm)


def prompts(tokenizer, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        text = (f"Team {i}: describe the people of {TOPICS[i % len(TOPICS)]}, each with a name, an age and a "
                f"city, as a JSON list, then say what the committee should decide about their proposal.")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def _busy_cpu_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class _TimedFuture:
    """The mask future, recording how long result() blocked the engine thread."""

    def __init__(self, inner: Future, probe: Probe):
        self._inner, self._probe = inner, probe

    def result(self, timeout=None):
        start = time.perf_counter()
        value = self._inner.result(timeout)
        end = time.perf_counter()
        self._probe.cur["wait"] += end - start
        self._probe.cur["window"] += start - self._probe.cur.pop("submitted", start)
        return value


class Probe:
    """Wrappers timing one step's parts; ``cur`` holds the running step's seconds."""

    def __init__(self, engine):
        import xgrammar as xgr

        self.cur: dict[str, Any] = {}
        self.engine = engine
        runner = engine.runner
        so = engine.structured_outputs  # built now, outside any timed step
        execute, masks, start_masks, apply_masks = runner.execute, so._masks, so.start_masks, so.apply_masks
        accept = xgr.GrammarMatcher.accept_token
        probe = self

        def timed_execute(batch, sample_rows, sample_seqs):
            probe.cur["decode_rows"] = (len(batch.seqs) if all(n == 1 for n in batch.num_new_tokens)
                                        and len(sample_seqs) == len(batch.seqs) else 0)
            start = time.perf_counter()
            try:
                return execute(batch, sample_rows, sample_seqs)
            finally:
                probe.cur["execute"] += time.perf_counter() - start

        def timed_masks(rows):
            start = time.perf_counter()
            try:
                return masks(rows)
            finally:
                probe.cur["fill"] += time.perf_counter() - start

        def timed_start_masks(rows):
            probe.cur["submitted"] = time.perf_counter()
            return _TimedFuture(start_masks(rows), probe)

        def timed_apply(logits, bitmask, rows):
            start = time.perf_counter()
            try:
                return apply_masks(logits, bitmask, rows)
            finally:
                probe.cur["apply"] += time.perf_counter() - start

        def timed_accept(matcher, token, *a, **k):
            start = time.perf_counter()
            try:
                return accept(matcher, token, *a, **k)
            finally:
                probe.cur["accept"] += time.perf_counter() - start

        runner.execute = timed_execute
        so._masks, so.start_masks, so.apply_masks = timed_masks, timed_start_masks, timed_apply
        xgr.GrammarMatcher.accept_token = timed_accept  # type: ignore[method-assign,assignment]

    def step(self) -> dict[str, Any]:
        self.cur = {"execute": 0.0, "fill": 0.0, "wait": 0.0, "window": 0.0, "apply": 0.0, "accept": 0.0,
                    "decode_rows": 0}
        start = time.perf_counter()
        self.engine.step()
        self.cur["step"] = time.perf_counter() - start
        self.cur.pop("submitted", None)
        return self.cur


def wait_for_idle(limit_s: float, threshold: float = 0.25) -> float:
    """Sleep (up to limit_s) until other processes keep fewer than threshold cores busy over 1 s; the
    seconds waited. The machine is shared: an arm that starts beside someone's test run is not fair."""
    start = time.perf_counter()
    while True:
        busy, own, t0 = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        other = ((_busy_cpu_seconds() - busy) - (_own_cpu_seconds() - own)) / (time.perf_counter() - t0)
        if other < threshold or time.perf_counter() - start >= limit_s:
            return time.perf_counter() - start


def run_arm(probe: Probe, arm: str, prompt_ids: list[list[int]], args: argparse.Namespace, tag: str) -> dict:
    from metroserve import SamplingParams

    engine = probe.engine
    waited = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else 0.0
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=constraint(arm, args))
    requests = [engine.add_request(p, params, request_id=f"{tag}-{arm}-{i}") for i, p in enumerate(prompt_ids)]
    steps = []
    busy, own, start = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
    while engine.has_unfinished_requests():
        steps.append(dict(probe.step()))
    wall = time.perf_counter() - start
    other = ((_busy_cpu_seconds() - busy) - (_own_cpu_seconds() - own)) / wall
    full = [s for s in steps if s["decode_rows"] == len(prompt_ids)]
    outputs = [r.seqs[0].token_ids[len(p):] for r, p in zip(requests, prompt_ids)]
    return {"arm": arm, "waited_for_idle_s": waited, "steps": len(steps), "full_batch_steps": len(full), "wall_s": wall,
            "other_cores": max(0.0, other),
            "finish_reasons": sorted({str(r.seqs[0].finish_reason) for r in requests}),
            "output_tokens": [len(o) for o in outputs],
            "sample_text": engine.tokenizer.decode(outputs[0][:48]),
            "per_step_ms": {k: [1000 * s[k] for s in full] for k in
                            ("step", "execute", "fill", "wait", "window", "apply", "accept")}}


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summarize(arm_run: dict) -> dict:
    ms = arm_run["per_step_ms"]
    out = {"step_p50": _q(ms["step"], 0.5), "step_p90": _q(ms["step"], 0.9), "execute_p50": _q(ms["execute"], 0.5)}
    for k in ("fill", "wait", "window", "apply", "accept"):
        out[f"{k}_p50"] = _q(ms[k], 0.5)
        out[f"{k}_mean"] = statistics.fmean(ms[k]) if ms[k] else float("nan")
    if ms["fill"] and sum(ms["fill"]) > 0:
        out["hidden_frac"] = 1 - sum(ms["wait"]) / sum(ms["fill"])
    return out


def run_setting(quantization: str, args: argparse.Namespace) -> dict:
    import torch

    from metroserve import LLM

    llm = LLM(args.model, quantization=None if quantization == "default" else quantization,
              kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.batch, enable_prefix_caching=False)
    engine = llm.engine
    prompt_ids = prompts(engine.tokenizer, args.batch)
    probe = Probe(engine)
    arms = list(args.arms)
    # Warm-up: compiles each grammar (cached by content afterwards) and warms the kernels; not kept.
    for arm in arms:
        run_arm(probe, arm, prompt_ids, argparse.Namespace(**{**vars(args), "max_tokens": 8, "wait_idle": 0}),
                "warmup")
    rounds = []
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        runs = {}
        for arm in order:
            runs[arm] = run_arm(probe, arm, prompt_ids, args, f"r{r}")
            s = summarize(runs[arm])
            print(f"[{quantization}] round {r} {arm}: {runs[arm]['full_batch_steps']} full steps, "
                  f"step p50 {s['step_p50']:.2f} ms, fill p50 {s['fill_p50']:.2f} ms, "
                  f"wait p50 {s['wait_p50']:.2f} ms, other cores {runs[arm]['other_cores']:.2f}", flush=True)
        rounds.append({"order": order, "runs": runs, "summary": {a: summarize(v) for a, v in runs.items()}})
    del llm, engine, probe
    return {"quantization": quantization, "threads": torch.get_num_threads(), "prompt_tokens":
            [len(p) for p in prompt_ids], "rounds": rounds}


def _cpu() -> dict[str, Any]:
    model, flags = "", list[str]()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    return {"model_name": model, "cores": os.cpu_count(),
            "flags": [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")]}


def table(report: dict) -> str:
    lines = ["| weights | round | arm | full-batch steps | step p50 ms | step p90 ms | vs unconstrained (p50) "
             "| execute p50 ms | fill p50 ms | wait (fill not hidden) p50 ms | fill hidden | apply p50 ms "
             "| accept p50 ms | other cores |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting in report["settings"]:
        for r, rnd in enumerate(setting["rounds"]):
            base = rnd["summary"].get("unconstrained", {}).get("step_p50")
            for arm in report["arms"]:
                s, run = rnd["summary"][arm], rnd["runs"][arm]
                ratio = f"{s['step_p50'] / base:.3f}" if base and arm != "unconstrained" else "1.000" if base else "-"
                constrained = arm != "unconstrained"
                hidden = f"{100 * s['hidden_frac']:.0f}%" if constrained and "hidden_frac" in s else "-"

                def c(key: str, s=s, constrained=constrained) -> str:
                    return f"{s[key]:.2f}" if constrained else "-"

                lines.append(f"| {setting['quantization']} | {r} | {arm} | {run['full_batch_steps']} | "
                             f"{s['step_p50']:.2f} | {s['step_p90']:.2f} | {ratio} | {s['execute_p50']:.2f} | "
                             f"{c('fill_p50')} | {c('wait_p50')} | {hidden} | {c('apply_p50')} | "
                             f"{c('accept_p50')} | {run['other_cores']:.2f} |")
    return "\n".join(lines)


def median_table(report: dict) -> str:
    lines = ["| weights | arm | step p50 ms (median of rounds) | ratio per round | median ratio |",
             "|---|---|---|---|---|"]
    for setting in report["settings"]:
        for arm in report["arms"]:
            if arm == "unconstrained":
                p50 = statistics.median(r["summary"][arm]["step_p50"] for r in setting["rounds"])
                lines.append(f"| {setting['quantization']} | {arm} | {p50:.2f} | - | 1.000 |")
                continue
            ratios = [r["summary"][arm]["step_p50"] / r["summary"]["unconstrained"]["step_p50"]
                      for r in setting["rounds"]]
            p50 = statistics.median(r["summary"][arm]["step_p50"] for r in setting["rounds"])
            lines.append(f"| {setting['quantization']} | {arm} | {p50:.2f} | "
                         f"{', '.join(f'{x:.3f}' for x in ratios)} | {statistics.median(ratios):.3f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", default="default",
                        help="comma-separated settings, one engine each: 'default' (the checkpoint's own), "
                             "'none' (float32), or any --quantization value")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)}; "
                        "unconstrained is always run (the ratios' base)")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests (and --max-num-seqs)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all arms")
    parser.add_argument("--json-min-items", type=int, default=64,
                        help="the JSON arm's array minItems (high enough that no output completes it)")
    parser.add_argument("--regex-min-chars", type=int, default=2000,
                        help="the regex arm: [a-z ]{N,} (N high enough that no output completes it)")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--wait-idle", type=float, default=120.0,
                        help="before each arm, wait up to this many seconds for other processes to use under "
                             "0.25 cores (0: don't wait); the arm's 'other cores' says how it went")
    parser.add_argument("--json-out", type=Path, default=None,
                        help=f"default: {RESULTS.relative_to(RESULTS.parents[2])}/<weights>.json")


def run(args: argparse.Namespace) -> dict:
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r}; choose from {', '.join(ARMS)}")
    args.arms = ["unconstrained"] + [a for a in arms if a != "unconstrained"]
    settings = [q for q in args.quantization.split(",") if q]
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "cpu": _cpu(),
        "model": args.model or "SmolLM2-135M-Instruct (packaged GGUF)", "batch": args.batch,
        "max_tokens": args.max_tokens, "arms": args.arms, "argv": sys.argv[1:],
        "constraints": {"json": json_schema(args.json_min_items), "regex": f"[a-z ]{{{args.regex_min_chars},}}",
                        "choice": list(CHOICES)},
        "settings": []}
    out = args.json_out or RESULTS / f"{'-'.join(settings)}.json"
    for q in settings:
        report["settings"].append(run_setting(q, args))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(table(report))
    print()
    print(median_table(report))
    print(f"\nJSON: {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
