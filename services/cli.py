"""The `metroserve` command."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> None:
    from worker.config import EngineConfig
    from worker.llm import LLM
    from worker.sampling_params import SamplingParams

    config = EngineConfig.from_cli_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, {c.finish_reason}]\n")


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import throughput
    from worker.config import EngineConfig

    parser = argparse.ArgumentParser(prog="metroserve", description="LLM serving with a paged KV cache and continuous batching.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline for prompts given as arguments or stdin lines",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: one per stdin line")
    gen.add_argument("--raw", action="store_true", help="send prompts as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput vs transformers generate and generate_batch",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    throughput.add_arguments(tp)
    tp.set_defaults(func=throughput.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:  # bad input: one clear line, not a traceback
        sys.exit(f"metroserve: error: {e}")


if __name__ == "__main__":
    main()
