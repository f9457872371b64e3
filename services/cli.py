"""The `metroserve` command: offline generation, the services, and benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from metroserve.services.log_setup import setup_logging


def _generate(args: argparse.Namespace) -> None:
    from metroserve.common.sampling_params import SamplingParams
    from metroserve.worker.config import EngineConfig
    from metroserve.worker.llm import LLM

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


def _run_async(main, component: str) -> None:
    """Run a service coroutine on uvloop until SIGTERM/SIGINT, which set its stop event."""
    import uvloop

    setup_logging(component)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(runner())


def _scheduler(args: argparse.Namespace) -> None:
    from metroserve.rpc import SCHEDULER_GRPC_EXPERIMENTS

    os.environ.setdefault("GRPC_EXPERIMENTS", SCHEDULER_GRPC_EXPERIMENTS)  # before grpc starts its core
    from metroserve.scheduler.server import SchedulerOptions, run_scheduler
    from metroserve.services.tracing import configure_tracing

    configure_tracing("metroserve-scheduler", args.otlp_endpoint)
    options = SchedulerOptions(host=args.host, port=args.port, kvstore=args.kvstore, max_queue_len=args.max_queue_len,
                               heartbeat_timeout_s=args.heartbeat_timeout, metrics_port=args.metrics_port,
                               log_requests=not args.disable_log_requests, credentials=_cluster_credentials(args))
    _run_async(lambda stop: run_scheduler(options, stop), "scheduler")


def _gateway(args: argparse.Namespace) -> None:
    from metroserve.services.chat_serving import chat_serving_from_args
    from metroserve.services.cors import policy_from_args
    from metroserve.services.gateway import GatewayOptions, run_gateway
    from metroserve.services.http_limits import http_limits_from_args
    from metroserve.services.prompt_log import prompt_log_from_args
    from metroserve.services.tracing import configure_tracing

    configure_tracing("metroserve-gateway", args.otlp_endpoint)
    options = GatewayOptions(scheduler=args.scheduler, host=args.host, port=args.port, grpc_port=args.grpc_port,
                             model=args.model, served_model_name=args.served_model_name, api_key=args.api_key,
                             limits=http_limits_from_args(args), prompt_log=prompt_log_from_args(args),
                             cors=policy_from_args(args),
                             chat=chat_serving_from_args(args), scheduler_wait_s=args.scheduler_wait,
                             credentials=_cluster_credentials(args))
    _run_async(lambda stop: run_gateway(options, stop), "gateway")


def _cluster_credentials(args: argparse.Namespace):
    from metroserve.rpc.auth import credentials_from_args

    return credentials_from_args(args)


def _refuse_flags_of_the_other_engine(args: argparse.Namespace) -> None:
    """A worker flag that its --engine does not use is an error naming it, not silently ignored:
    the model engine's flags the mock has no use for (--model, --dtype, --kv-cache-memory, ...), and
    the --mock-* flags without --engine mock. A flag counts as given when it differs from its default."""
    from metroserve.worker.config import EngineConfig
    from metroserve.worker.mock_engine import ENGINE_FLAGS_USED, add_mock_engine_args

    def flags(add_args) -> dict[str, tuple[str, object]]:
        parser = argparse.ArgumentParser(add_help=False)
        add_args(parser)
        return {a.dest: (a.option_strings[0], a.default) for a in parser._actions}

    unused = {d: f for d, f in flags(EngineConfig.add_cli_args).items() if d not in ENGINE_FLAGS_USED} \
        if args.engine == "mock" else flags(add_mock_engine_args)
    given = sorted(flag for dest, (flag, default) in unused.items() if getattr(args, dest) != default)
    if given:
        raise ValueError(f"{', '.join(given)}: no effect with --engine {args.engine}"
                         + ("" if args.engine == "mock" else " (the --mock-* flags are for --engine mock)"))


def _worker(args: argparse.Namespace) -> None:
    import uvloop

    from metroserve.services.tracing import configure_tracing
    from metroserve.worker.service import WorkerOptions, WorkerService

    setup_logging("worker")
    configure_tracing("metroserve-worker", args.otlp_endpoint)
    options = WorkerOptions(scheduler=args.scheduler,
                            worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
                            host=args.host, port=args.port, advertise_address=args.advertise_address,
                            health_port=args.health_port, drain_timeout_s=args.drain_timeout,
                            metrics_port=args.metrics_port, credentials=_cluster_credentials(args))
    _refuse_flags_of_the_other_engine(args)
    if args.engine == "mock":  # torch is never imported on this path
        from metroserve.worker.mock_engine import MockEngine, mock_options_from_args

        mock = mock_options_from_args(args)
        model_name = args.served_model_name or "mock"

        def make_engine(sink):
            return MockEngine(mock, sink)
    else:
        from metroserve.worker.config import EngineConfig
        from metroserve.worker.model_files import served_model_name

        config = EngineConfig.from_cli_args(args)
        model_name = args.served_model_name or served_model_name(config.model)

        def make_engine(sink):
            from metroserve.worker.async_engine import AsyncEngine

            return AsyncEngine(config, detokenize=False, sink=sink, record_block_events=True, step_inline=True)

    async def main() -> None:
        service = WorkerService(make_engine, model_name, options)  # loads the model: the loop exists for its events
        signal.signal(signal.SIGINT, signal.default_int_handler)
        await service.run()

    uvloop.run(main())


def _serve(args: argparse.Namespace) -> None:
    from metroserve.rpc.auth import credentials_from_args
    from metroserve.services.chat_serving import chat_serving_from_args
    from metroserve.services.cors import policy_from_args
    from metroserve.services.http_limits import http_limits_from_args
    from metroserve.services.prompt_log import prompt_log_from_args
    from metroserve.services.serve import ServeOptions, Stack
    from metroserve.worker.config import EngineConfig
    from metroserve.worker.model_files import resolve_model_dir, served_model_name

    setup_logging("serve")
    config = EngineConfig.from_cli_args(args)
    name = args.served_model_name or served_model_name(config.model)
    config.model = str(resolve_model_dir(config.model))  # convert a GGUF once, before the workers start
    stack = Stack(ServeOptions(engine=config, served_model_name=name, workers=args.workers, host=args.host,
                               port=args.port, grpc_port=args.grpc_port, scheduler_port=args.scheduler_port,
                               kvstore=args.kvstore, api_key=args.api_key, cors=policy_from_args(args),
                               chat=chat_serving_from_args(args),
                               max_queue_len=args.max_queue_len, metrics_port=args.metrics_port,
                               heartbeat_timeout_s=args.heartbeat_timeout,
                               otlp_endpoint=args.otlp_endpoint,
                               log_requests=not args.disable_log_requests,
                               limits=http_limits_from_args(args), prompt_log=prompt_log_from_args(args),
                               credentials=credentials_from_args(args, generate=True)))

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    stack.start()
    try:
        if not stack.wait_ready():
            stack.stop()
            sys.exit("metroserve serve: the stack did not become ready; see the log above")
        print(f"metroserve: serving {name} at http://{args.host}:{args.port}/v1 (gRPC {args.host}:{args.grpc_port}, "
              f"{args.workers} worker{'s' if args.workers != 1 else ''})", flush=True)
        print(f"metroserve: metrics at {', '.join(stack.metrics_urls())}", flush=True)
        code = stack.supervise()
    except KeyboardInterrupt:
        code = 0
    stack.stop()
    sys.exit(code)


def _add_service_args(p: argparse.ArgumentParser, *, gateway: bool = False, scheduler: bool = False) -> None:
    from metroserve.services.chat_serving import add_chat_args
    from metroserve.services.cors import add_cors_args
    from metroserve.services.http_limits import add_http_limit_args
    from metroserve.services.prompt_log import add_prompt_log_args

    if gateway:
        p.add_argument("--host", default="127.0.0.1", help="address the REST and gRPC APIs listen on")
        p.add_argument("--port", type=int, default=8000, help="REST (OpenAI-compatible) port")
        p.add_argument("--grpc-port", type=int, default=50052, help="public gRPC port (0: off)")
        p.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on REST and gRPC (default: $METROSERVE_API_KEY)")
        p.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
        add_http_limit_args(p)
        add_prompt_log_args(p)
        add_cors_args(p)
        add_chat_args(p)
    if scheduler:
        p.add_argument("--kvstore", default="memory",
                       help="prefix index and request state: 'memory' (embedded) or redis://host:port/db")
        p.add_argument("--max-queue-len", type=int, default=1024,
                       help="requests that may wait for a worker slot; beyond it: 429 with Retry-After")


def _add_heartbeat_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="seconds of silence after which the scheduler drops a worker and moves its work")


def _add_observability_args(p: argparse.ArgumentParser, *, metrics_port: int | None = None,
                            metrics_help: str = "", log_requests: bool = False) -> None:
    p.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry traces here (OTLP/HTTP, e.g. http://127.0.0.1:4318); default: "
                        "$OTEL_EXPORTER_OTLP_ENDPOINT, else tracing is off")
    if metrics_port is not None:
        p.add_argument("--metrics-port", type=int, default=metrics_port, help=metrics_help)
    if log_requests:
        p.add_argument("--disable-log-requests", action="store_true",
                       help="no structured log line per finished request")


class _LazyParser(argparse.ArgumentParser):
    """A sub-command parser whose arguments are added only when it parses or prints its help.

    The benchmarks define their flags in modules that import torch, transformers and matplotlib;
    building them lazily keeps every other command from paying for those imports at start-up.
    """

    def __init__(self, *args, add_args: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_args = add_args

    def _complete(self) -> None:
        if self._add_args is not None:
            add_args, self._add_args = self._add_args, None
            add_args(self)

    def parse_known_args(self, args=None, namespace=None):
        self._complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._complete()
        return super().format_help()


@dataclass(frozen=True)
class _Benchmark:
    module: str  # in metroserve.benchmarks, with add_arguments(parser) and the entry point
    help: str
    entry: str = "run"  # run(args) -> report; or "main": main(args) -> exit status, module doc as description

    @property
    def formatter(self) -> type[argparse.HelpFormatter]:
        return argparse.RawDescriptionHelpFormatter if self.entry == "main" else argparse.ArgumentDefaultsHelpFormatter

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        module = import_module(f"metroserve.benchmarks.{self.module}")
        module.add_arguments(parser)
        if self.entry == "main":
            parser.description = module.__doc__
            parser.set_defaults(func=lambda args: sys.exit(module.main(args)))
        else:
            parser.set_defaults(func=module.run)


_BENCHMARKS = {
    "throughput": _Benchmark("throughput", "offline throughput vs transformers generate and generate_batch"),
    "batch-limit": _Benchmark("batch_limit", "a huge completions batch against a stack: refusal latency, admission "
                              "attempts, the gateway's memory"),
    "chaos": _Benchmark("chaos", "one fault at a time (SIGKILL/SIGSTOP a worker, SIGKILL the scheduler, a gateway, "
                        "redis) against serve --workers 2 with 16 greedy streams: identical text, blocks freed"),
    "soak": _Benchmark("soak", "streaming clients for a long run, a share leaving mid-stream: resident memory of "
                       "every process over time, no request left running, every block free"),
    "slowloris": _Benchmark("slowloris", "slow clients (headers and bodies a byte at a time) beside normal streams: "
                            "are they dropped by the timeouts, and the normal streams' ITL"),
    "overhead": _Benchmark("serve_overhead", "the service path (REST -> gateway -> scheduler -> worker) vs offline"),
    "speculative": _Benchmark("speculative", "speculative decoding (n-gram, draft model) vs plain decoding"),
    "serve": _Benchmark("serving", "load generator for any OpenAI-compatible server: TTFT, TPOT, ITL, throughput, "
                                   "goodput, prefix-cache hits; JSON and PNG plots", entry="main"),
    "observability": _Benchmark("observability_overhead",
                                "throughput with metrics, request logs and tracing on vs off"),
    "structured-outputs": _Benchmark("structured_outputs", "step-time overhead of structured-output token masks "
                                                           "(JSON schema, regex, choice) at batch 32"),
    "cluster": _Benchmark("cluster", "scheduler, gateways and mock workers as processes: tokens/s and CPU per "
                                     "component against workers and gateways; in-process placement latency",
                          entry="main"),
}


def build_parser() -> argparse.ArgumentParser:
    from metroserve.rpc.auth import add_cluster_auth_args
    from metroserve.worker.config import EngineConfig  # torch-free: the flags only
    from metroserve.worker.mock_engine import add_mock_engine_args

    parser = argparse.ArgumentParser(prog="metroserve",
                                     description="LLM serving with a paged KV cache and continuous batching.")
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

    serve = sub.add_parser("serve", help="run gateway, scheduler and workers on this machine (loopback)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--workers", type=int, default=1, help="worker processes, each with its own KV pool")
    serve.add_argument("--scheduler-port", type=int, default=50051, help="the scheduler's gRPC port (loopback)")
    _add_heartbeat_arg(serve)
    _add_service_args(serve, gateway=True, scheduler=True)
    _add_observability_args(serve, metrics_port=9090, log_requests=True,
                            metrics_help="Prometheus /metrics of the scheduler on this loopback port, of worker i on "
                                         "this port + 1 + i (0: none); the gateway's is on --port")
    EngineConfig.add_cli_args(serve)
    add_cluster_auth_args(serve)
    serve.set_defaults(func=_serve)

    sched = sub.add_parser("scheduler", help="run the central scheduler",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sched.add_argument("--host", default="127.0.0.1")
    sched.add_argument("--port", type=int, default=50051, help="gRPC port for gateways and workers")
    _add_heartbeat_arg(sched)
    _add_service_args(sched, scheduler=True)
    add_cluster_auth_args(sched)
    _add_observability_args(sched, metrics_port=0, log_requests=True,
                            metrics_help="serve Prometheus /metrics on this port (0: none)")
    sched.set_defaults(func=_scheduler)

    gw = sub.add_parser("gateway", help="run an API gateway (REST + gRPC) in front of a scheduler",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gw.add_argument("--scheduler", default="127.0.0.1:50051", help="the scheduler's host:port")
    gw.add_argument("--model", default=None, help="model directory or .gguf, for the tokenizer and chat template")
    gw.add_argument("--scheduler-wait", type=float, default=30.0,
                    help="seconds a request waits for a scheduler that does not answer (e.g. restarting) before "
                         "a 503 with Retry-After")
    _add_service_args(gw, gateway=True)
    add_cluster_auth_args(gw)
    _add_observability_args(gw)
    gw.set_defaults(func=_gateway)

    wk = sub.add_parser("worker", help="run a worker: one engine and KV pool, connected to a scheduler",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    wk.add_argument("--scheduler", default="127.0.0.1:50051", help="the scheduler's host:port")
    wk.add_argument("--worker-id", default=None, help="unique name (default: hostname-pid)")
    wk.add_argument("--engine", choices=("model", "mock"), default="model",
                    help="'mock': a simulated engine (paged pool, prefix cache, step-time model; no model, no torch) "
                         "for capacity planning and router tests; see the --mock-* flags")
    wk.add_argument("--host", default="127.0.0.1", help="address its token stream (for the gateways) listens on")
    wk.add_argument("--port", type=int, default=0, help="token stream port (0: any free port)")
    wk.add_argument("--advertise-address", default=None,
                    help="host:port the gateways dial for its tokens (default: --host:--port, this host's name "
                         "for 0.0.0.0)")
    wk.add_argument("--health-port", type=int, default=0,
                    help="an unauthenticated grpc.health.v1 port on --host for probes (0: none)")
    wk.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM, seconds to finish running work before handing it back")
    wk.add_argument("--served-model-name", default=None, help="the model id clients send (default: from --model)")
    _add_observability_args(wk, metrics_port=0, metrics_help="serve Prometheus /metrics on this port (0: none)")
    EngineConfig.add_cli_args(wk)
    add_mock_engine_args(wk)
    add_cluster_auth_args(wk)
    wk.set_defaults(func=_worker)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_LazyParser)
    for name, b in _BENCHMARKS.items():
        bench_sub.add_parser(name, help=b.help, formatter_class=b.formatter, add_args=b.add_to)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:  # bad input: one clear line, not a traceback
        sys.exit(f"metroserve: error: {e}")


if __name__ == "__main__":
    main()
