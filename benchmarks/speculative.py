"""Speculative decoding vs plain decoding, side by side on the same model, prompts and threads.

Three measurements (``--only`` picks some):

- ``single``: one request at a time over an input-grounded workload (rename a variable in a
  standard-library function and print it whole, copy a passage, summarise a passage quoting it),
  greedy, n-gram speculation vs plain. Rounds alternate which engine goes first.
- ``single-chat``: one request at a time over the first 8 requests of the mixed chat workload of
  ``bench throughput`` (questions about documentation, answers mostly in new words): where drafts
  rarely match, speculation must cost little.
- ``batch``: the mixed chat workload (64 requests at once) with n-gram speculation vs plain:
  speculation must stay out of the way when the batch is large.
- ``draft``: the single-stream workload with a draft model. No smaller model with SmolLM2's
  tokenizer can be obtained here, so two self-drafts are measured: (a) SmolLM2-135M itself in
  bfloat16 (half the bytes to read per token; this CPU has AVX512-BF16), and (b) SmolLM2-135M cut
  to its first ``--draft-layers`` layers (an early-exit draft: same tokenizer, embeddings, final
  norm and head).

Prefix caching is off in both arms, so every round prefills every prompt the same way. Outputs of
the two arms are compared token for token.

    python benchmarks/speculative.py [--only single,batch,draft] [--rounds 2] [--json-out out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import shlex
import shutil
import string
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm.auto import tqdm

from metroserve import LLM, SamplingParams
from metroserve.benchmarks.workload import build_chat_workload, stdlib_docstrings
from metroserve.worker.model_files import cache_root, resolve_model_dir

SECTIONS = ("single", "single-chat", "batch", "draft")
# Functions to edit: (function, variable to rename, new name).
EDITS = ((textwrap.dedent, "margin", "common_prefix"), (textwrap.indent, "prefix", "pad"),
         (string.capwords, "sep", "separator"), (shlex.join, "split_command", "argv"),
         (textwrap.shorten, "width", "max_width"))


def grounded_workload(llm: LLM) -> list[list[int]]:
    """Chat prompts whose answers mostly repeat text from the prompt."""
    messages = [f"Here is a Python function:\n\n```python\n{inspect.getsource(fn)}```\n\nRename `{old}` to "
                f"`{new}` and output the complete updated function." for fn, old, new in EDITS]
    passages = [doc[:900] for _, doc in stdlib_docstrings() if len(doc) > 900][:3]
    messages += [f"Copy this text exactly:\n\n{passages[0]}", f"Copy this text exactly:\n\n{passages[1]}",
                 f"{passages[2]}\n\nSummarise the text above, quoting its key sentences word for word."]
    return [llm.apply_chat_template([{"role": "user", "content": m}]) for m in messages]


def layer_skip_draft(model_dir: Path, num_layers: int) -> Path:
    """The target's first num_layers decoder layers as a standalone model directory (cached)."""
    from safetensors.torch import load_file, save_file

    out = cache_root() / "drafts" / f"{model_dir.name}-first{num_layers}layers"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    if num_layers >= config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be below the target's {config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = num_layers
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in load_file(f).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = t
    save_file(tensors, out / "model.safetensors")
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams, one_at_a_time: bool):
    start = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start


def compare(name: str, plain: LLM, spec: LLM, prompts: list[list[int]], params: SamplingParams, rounds: int,
            one_at_a_time: bool, bar: tqdm) -> dict[str, Any]:
    """Alternate the two engines over `rounds` rounds; report tok/s of each, the ratio and draft counters."""
    seconds = {"plain": 0.0, "spec": 0.0}
    tokens = {"plain": 0, "spec": 0}
    outputs = {}
    before = spec.engine.stats().spec_decode
    before = (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens)
    for r in range(rounds):
        order = [("plain", plain), ("spec", spec)]
        for arm, llm in order if r % 2 == 0 else order[::-1]:
            outs, dt = timed_generate(llm, prompts, params, one_at_a_time)
            seconds[arm] += dt
            tokens[arm] += sum(map(len, outs))
            outputs[arm] = outs
            bar.update(1)
    after = spec.engine.stats().spec_decode
    drafts, draft_tokens, accepted = (after.num_drafts - before[0], after.num_draft_tokens - before[1],
                                      after.num_accepted_tokens - before[2])
    result = {
        "section": name, "requests": len(prompts), "rounds": rounds,
        "plain_tokens_per_s": tokens["plain"] / seconds["plain"], "spec_tokens_per_s": tokens["spec"] / seconds["spec"],
        "output_tokens_per_round": tokens["plain"] // rounds,
        "identical_outputs": sum(a == b for a, b in zip(outputs["plain"], outputs["spec"])),
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }
    result["speedup"] = result["spec_tokens_per_s"] / result["plain_tokens_per_s"]
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per section")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per single-stream request")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--batch-requests", type=int, default=64, help="requests of the batch section")
    parser.add_argument("--draft-layers", type=int, default=8, help="layers kept in the early-exit draft")
    parser.add_argument("--draft-tokens", type=int, default=3, help="num_speculative_tokens of the draft section")
    parser.add_argument("--json-out", type=Path, default=None, help="write the results here as JSON")


def run(args: argparse.Namespace) -> dict[str, Any]:
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ValueError(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    model_dir = resolve_model_dir(args.model)
    common = dict(enable_prefix_caching=False)
    plain = LLM(str(model_dir), **common)
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4}
    prompts = grounded_workload(plain)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    plain.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    results = []
    num_comparisons = len(sections) + ("draft" in sections)  # the draft section compares two drafts
    with tqdm(total=2 * args.rounds * num_comparisons, desc="speculative bench", unit="arm-run") as bar:
        if {"single", "single-chat", "batch"} & set(sections):
            spec = LLM(str(model_dir), speculative_config=ngram, **common)
            spec.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            if "single" in sections:
                results.append(compare("single: n-gram", plain, spec, prompts, greedy, args.rounds, True, bar))
            if "single-chat" in sections:
                chat = build_chat_workload(plain.get_tokenizer(), num_requests=args.batch_requests)[:8]
                results.append(compare("single-chat: n-gram", plain, spec, chat,
                                       SamplingParams(temperature=0, max_tokens=128), args.rounds, True, bar))
            if "batch" in sections:
                batch = build_chat_workload(plain.get_tokenizer(), num_requests=args.batch_requests)
                results.append(compare(f"batch of {len(batch)}: n-gram", plain, spec, batch,
                                       SamplingParams(temperature=0, max_tokens=128), args.rounds, False, bar))
            del spec
        if "draft" in sections:
            drafts = [("the target in bfloat16", {"model": str(model_dir), "draft_dtype": "bfloat16"}),
                      (f"first {args.draft_layers} layers",
                       {"model": str(layer_skip_draft(model_dir, args.draft_layers))})]
            for label, draft in drafts:
                spec = LLM(str(model_dir), speculative_config={"method": "draft_model", **draft,
                                                               "num_speculative_tokens": args.draft_tokens}, **common)
                spec.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                results.append(compare(f"single: draft = {label}", plain, spec, prompts, greedy, args.rounds, True,
                                       bar))
                del spec
    report = {"model_dir": str(model_dir), "torch_threads": torch.get_num_threads(), "ngram": ngram,
              "max_tokens": args.max_tokens, "results": results}
    print(f"\nmodel {model_dir}  torch threads {torch.get_num_threads()}  rounds {args.rounds}")
    print(f"{'section':<40} {'plain tok/s':>11} {'spec tok/s':>10} {'spec/plain':>10} {'accept':>7} "
          f"{'mean len':>8} {'identical':>9}")
    for r in results:
        print(f"{r['section']:<40} {r['plain_tokens_per_s']:>11.1f} {r['spec_tokens_per_s']:>10.1f} "
              f"{r['speedup']:>9.2f}x {r['acceptance_rate']:>7.2f} {r['mean_acceptance_length']:>8.2f} "
              f"{r['identical_outputs']:>5}/{r['requests']}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
