"""docker-compose.yml's service commands, run as local processes (no Docker): with the hostnames and
ports swapped for loopback ones, the scheduler, a worker and the gateway come up, serve a chat
completion, pass their own compose healthchecks, and the scheduler writes the prefix-block index
to Redis."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import redis

from tests.redis_server import RedisServer
from tests.stack import ROOT, free_port, wait_for
from tests.stack import metric_value as value
from tests.stack import scrape_metrics as scrape
from tests.test_compose import COMPOSE_FILE, _load, compose_commands

START_ORDER = ("scheduler", "worker", "gateway")
COMPOSE_PORTS = {"scheduler": "50051", "worker_health": "8081", "gateway": "8000", "gateway_grpc": "50052",
                 "scheduler_metrics": "9090", "worker_metrics": "9100"}


def _replace_flag(argv: list[str], flag: str, old: str, new: str) -> list[str]:
    """argv with `flag old` turned into `flag new`; fails when compose no longer has `flag old`."""
    i = argv.index(flag)
    assert argv[i + 1] == old, f"{flag} is {argv[i + 1]!r} in compose, expected {old!r}: {argv}"
    return argv[:i + 1] + [new] + argv[i + 2:]


def local_commands(model: Path, redis_port: int, ports: dict[str, int]) -> dict[str, list[str]]:
    """compose_commands() with every compose hostname and port swapped for loopback ones."""
    commands = {}
    for name, argv in compose_commands().items():
        argv = [a.replace("redis:6379", f"127.0.0.1:{redis_port}")
                 .replace(f"scheduler:{COMPOSE_PORTS['scheduler']}", f"127.0.0.1:{ports['scheduler']}") for a in argv]
        if "--host" in argv:
            argv = _replace_flag(argv, "--host", "0.0.0.0", "127.0.0.1")
        if name == "scheduler":
            argv = _replace_flag(argv, "--port", COMPOSE_PORTS["scheduler"], str(ports["scheduler"]))
            argv = _replace_flag(argv, "--metrics-port", COMPOSE_PORTS["scheduler_metrics"],
                                 str(ports["scheduler_metrics"]))
        elif name == "worker":
            argv = _replace_flag(argv, "--device", "cuda", "cpu")
            argv = _replace_flag(argv, "--health-port", COMPOSE_PORTS["worker_health"], str(ports["worker_health"]))
            argv = _replace_flag(argv, "--metrics-port", COMPOSE_PORTS["worker_metrics"], str(ports["worker_metrics"]))
            argv += ["--model", str(model), "--kv-cache-memory", "64MiB"]
        elif name == "gateway":
            argv = _replace_flag(argv, "--port", COMPOSE_PORTS["gateway"], str(ports["gateway"]))
            argv = _replace_flag(argv, "--grpc-port", COMPOSE_PORTS["gateway_grpc"], str(ports["gateway_grpc"]))
            argv += ["--model", str(model)]  # the gateway takes no engine flags such as --kv-cache-memory
        leftover = [a for a in argv if re.search(r"\b(redis|scheduler):\d+", a)]
        assert not leftover, f"{name}: compose hostnames left in {argv}"
        commands[name] = argv
    return commands


def local_healthcheck(test: list[str], port_map: dict[str, int]) -> list[str]:
    """A compose healthcheck `test` as a local command: CMD dropped, python -> this interpreter,
    127.0.0.1:<compose port> -> the local port."""
    assert test[0] == "CMD", test
    argv = test[1:]
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]

    def swap(match: re.Match) -> str:
        assert match.group(1) in port_map, f"healthcheck probes unknown port {match.group(1)}: {test}"
        return f"127.0.0.1:{port_map[match.group(1)]}"
    return [re.sub(r"127\.0\.0\.1:(\d+)", swap, a) for a in argv]


def _alive_or_fail(procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}: {logs[name].read_text()[-3000:]}")


def _http_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """Terminate in reverse start order: gateway, worker, then scheduler."""
    for proc in reversed(list(procs.values())):
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.service
def test_compose_commands_run_as_local_processes(tiny_model_dir, tmp_path):
    ports = {key: free_port() for key in COMPOSE_PORTS}
    port_map = {COMPOSE_PORTS[key]: ports[key] for key in COMPOSE_PORTS}
    services = _load(COMPOSE_FILE)["services"]
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Path] = {}
    with RedisServer() as redis_server:
        port_map["6379"] = redis_server.port
        commands = local_commands(tiny_model_dir, redis_server.port, ports)
        assert list(commands) != [] and set(commands) == set(START_ORDER)
        assert f"redis://127.0.0.1:{redis_server.port}/0" in commands["scheduler"]
        try:
            for name in START_ORDER:
                logs[name] = tmp_path / f"{name}.log"
                with open(logs[name], "wb") as log:
                    procs[name] = subprocess.Popen([sys.executable, "-m", "metroserve.services.cli", *commands[name]],
                                                   cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

            health_url = f"http://127.0.0.1:{ports['gateway']}/health"

            def gateway_up() -> bool:
                _alive_or_fail(procs, logs)
                return _http_ok(health_url)

            wait_for(gateway_up, 180, "the gateway's /health", 0.3)

            # One chat completion through gateway -> scheduler -> worker. The message is long enough to
            # fill several 16-token KV blocks, so the worker has blocks to report to the index.
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['gateway']}/v1", api_key="unused",
                                   max_retries=0)
            model_id = client.models.list().data[0].id
            message = "Please summarize what a paged key-value cache does in an inference server. " * 4
            reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": message}],
                                                   max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            assert reply.choices[0].message.content and reply.usage is not None
            assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens >= 48

            # Each service's own compose healthcheck, run here against the substituted port.
            for name in (*START_ORDER, "redis"):
                test = services[name]["healthcheck"]["test"]
                argv = local_healthcheck(test, port_map)
                if name == "redis":  # `redis-cli ping` probes the container's default port
                    argv = [*argv[:1], "-p", str(redis_server.port), *argv[1:]]
                result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)
                assert result.returncode == 0, f"{name} healthcheck {argv}: {result.stderr}"
            assert any(str(ports["scheduler"]) in a for a in local_healthcheck(services["scheduler"]["healthcheck"]
                                                                                ["test"], port_map))

            # Each service's /metrics on the port compose gives it counts the completion.
            worker_metrics = scrape(f"http://127.0.0.1:{ports['worker_metrics']}/metrics")
            assert value(worker_metrics, "generation_tokens_total") == 8
            assert value(worker_metrics, "request_success_total", finished_reason="length") == 1
            scheduler_metrics = scrape(f"http://127.0.0.1:{ports['scheduler_metrics']}/metrics")
            assert sum(v for (name, _), v in scheduler_metrics.items()
                       if name == "metroserve:scheduler_placements_total") == 1
            gateway_metrics = scrape(f"http://127.0.0.1:{ports['gateway']}/metrics")
            assert value(gateway_metrics, "gateway_requests_total", route="/v1/chat/completions", status="200") == 1

            # The scheduler wrote the worker's prefix blocks to Redis (batched in the background).
            worker_id = f"{socket.gethostname()}-{procs['worker'].pid}"  # the worker's default --worker-id
            r = redis.Redis(port=redis_server.port, decode_responses=True)
            try:
                keys = wait_for(lambda: sorted(r.scan_iter("metroserve:wblk:*")), 20,
                                "metroserve:wblk:* keys in Redis")
                assert keys == [f"metroserve:wblk:{worker_id}"]
                hashes = r.smembers(keys[0])
                assert len(hashes) >= 3
                some = next(iter(hashes))
                assert isinstance(some, str)  # decode_responses=True
                assert r.hgetall(f"metroserve:blk:{some}").keys() == {worker_id}
            finally:
                r.close()
            _alive_or_fail(procs, logs)
        finally:
            _stop(procs)
    assert all(p.returncode is not None for p in procs.values())


@pytest.mark.parametrize("test, expected", [
    (["CMD", "python", "-m", "metroserve.services.healthcheck", "127.0.0.1:50051"],
     [sys.executable, "-m", "metroserve.services.healthcheck", "127.0.0.1:1234"]),
    (["CMD", "python", "-c", "urlopen('http://127.0.0.1:8000/health')"],
     [sys.executable, "-c", "urlopen('http://127.0.0.1:4321/health')"]),
])
def test_local_healthcheck_substitutes_ports(test, expected):
    assert local_healthcheck(test, {"50051": 1234, "8000": 4321}) == expected
