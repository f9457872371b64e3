"""The deployment files: docker-compose.yml's structure (checked without Docker) and the gRPC
health check the containers run."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CPU_OVERRIDE_FILE = ROOT / "docker-compose.cpu.yml"
SUBCOMMANDS = {"scheduler", "worker", "gateway"}


class _Reset:
    """What Compose's `!reset` tag stands for: the key is removed from the merged file."""


class _ComposeLoader(yaml.SafeLoader):
    """SafeLoader that also reads the `!reset` tag override files use."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())


def _load(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        return yaml.load(handle, Loader=_ComposeLoader)


def _argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def compose_commands() -> dict[str, list[str]]:
    """Service name -> argv after the `metroserve` entrypoint, for every service built from the
    repo's Dockerfile, so that a test can run the compose stack's exact commands as local processes."""
    services = _load(COMPOSE_FILE)["services"]
    return {name: _argv(spec["command"]) for name, spec in services.items() if "build" in spec}


def _flag(argv: list[str], flag: str) -> str:
    """The value after `flag` in argv (fails the test when the flag is missing)."""
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def _seconds(duration: str) -> int:
    """Compose durations as this file writes them: '<n>s' or '<n>m'."""
    return int(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]]


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return _load(COMPOSE_FILE)["services"]


def test_the_four_services_exist(services):
    assert set(services) == {"redis", "scheduler", "worker", "gateway"}


def test_metroserve_services_share_one_image_built_from_the_dockerfile(services):
    ours = [services[name] for name in ("scheduler", "worker", "gateway")]
    assert all(spec["build"] == "." for spec in ours)
    assert len({spec["image"] for spec in ours}) == 1


def test_compose_commands_returns_each_metroserve_service_argv():
    commands = compose_commands()
    assert set(commands) == SUBCOMMANDS
    assert commands["scheduler"] == ["scheduler", "--host", "0.0.0.0", "--port", "50051",
                                     "--kvstore", "redis://redis:6379/0", "--metrics-port", "9090"]
    assert commands["worker"][:3] == ["worker", "--scheduler", "scheduler:50051"]
    assert all(isinstance(arg, str) for argv in commands.values() for arg in argv)


def test_argv_splits_a_string_command_like_a_shell():
    assert _argv("worker --model '/models/my model'") == ["worker", "--model", "/models/my model"]


def test_every_command_starts_with_a_subcommand():
    for name, argv in compose_commands().items():
        assert argv[0] in SUBCOMMANDS, f"{name}: {argv}"
        assert argv[0] == name  # each service runs its own role


def test_clients_point_at_the_scheduler_port():
    commands = compose_commands()
    scheduler_port = _flag(commands["scheduler"], "--port")
    for client in ("worker", "gateway"):
        assert _flag(commands[client], "--scheduler") == f"scheduler:{scheduler_port}"


def test_scheduler_kvstore_is_the_redis_service(services):
    url = _flag(_argv(services["scheduler"]["command"]), "--kvstore")
    assert url.startswith("redis://redis:6379/")
    assert services["scheduler"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_redis_keeps_no_data(services):
    argv = _argv(services["redis"]["command"])
    assert _flag(argv, "--save") == "" and _flag(argv, "--appendonly") == "no"
    assert "volumes" not in services["redis"]


def test_worker_is_scalable(services):
    worker = services["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "hostname" not in worker


def test_worker_reserves_one_nvidia_gpu(services):
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert _flag(_argv(services["worker"]["command"]), "--device") == "cuda"


def test_worker_waits_for_a_healthy_scheduler_and_has_time_to_load_and_drain(services):
    worker = services["worker"]
    assert worker["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert "healthcheck" in worker
    assert _seconds(worker["healthcheck"]["start_period"]) >= 300
    assert _seconds(worker["stop_grace_period"]) >= 60
    assert any(volume.endswith(":/cache") for volume in worker["volumes"])


def test_gateway_publishes_rest_and_grpc_and_passes_the_api_key(services):
    gateway = services["gateway"]
    argv = _argv(gateway["command"])
    published = {str(port) for port in gateway["ports"]}
    assert f"8000:{_flag(argv, '--port')}" in published
    assert f"50052:{_flag(argv, '--grpc-port')}" in published
    assert "METROSERVE_API_KEY" in gateway["environment"]  # bare name: taken from the host env
    assert gateway["depends_on"]["scheduler"]["condition"] == "service_healthy"


def test_every_metroserve_service_requires_the_cluster_secret_from_the_host(services):
    """The containers authenticate each other with METROSERVE_CLUSTER_SECRET; compose refuses to
    start without it (`${VAR:?...}`) rather than run an open internal plane."""
    for name in ("scheduler", "worker", "gateway"):
        secret = services[name]["environment"]["METROSERVE_CLUSTER_SECRET"]
        assert secret.startswith("${METROSERVE_CLUSTER_SECRET:?"), (name, secret)


def _healthcheck_port(argv: list[str]) -> str | None:
    """The port a healthcheck probes when it is one of the known forms, else None."""
    match argv:
        case ["CMD", "redis-cli", "ping"]:
            return "6379"
        case ["CMD", "python", "-m", "metroserve.services.healthcheck", target]:
            host, _, port = target.rpartition(":")
            return port if host == "127.0.0.1" else None
        case ["CMD", "python", "-c", code] if code == (
                "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"):
            return "8000"
    return None


def test_every_healthcheck_is_a_known_form_probing_the_service_port(services):
    served_port = {"scheduler": "--port", "worker": "--health-port", "gateway": "--port"}
    for name, spec in services.items():
        port = _healthcheck_port(spec["healthcheck"]["test"])
        assert port is not None, f"{name}: unknown healthcheck {spec['healthcheck']['test']}"
        if name in served_port:
            assert port == _flag(_argv(spec["command"]), served_port[name]), name


def test_cpu_override_runs_workers_on_cpu_without_the_gpu_reservation():
    override = _load(CPU_OVERRIDE_FILE)["services"]
    assert set(override) == {"worker"}
    argv = _argv(override["worker"]["command"])
    assert _flag(argv, "--device") == "cpu"
    assert [arg for arg in argv if arg not in ("cpu", "cuda")] == [
        arg for arg in compose_commands()["worker"] if arg not in ("cpu", "cuda")]
    assert isinstance(override["worker"]["deploy"]["resources"]["reservations"]["devices"], _Reset)


# --- services/healthcheck.py against a real gRPC health server ---------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def _run_healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metroserve.services.healthcheck", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def test_healthcheck_exits_0_when_serving(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = _run_healthcheck(target)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_healthcheck_exits_1_when_not_serving(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = _run_healthcheck(target)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "NOT_SERVING" in result.stderr


def test_healthcheck_checks_the_named_service(health_server):
    target, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("metroserve.Generation", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert _run_healthcheck(target, "--service", "metroserve.Generation").returncode == 1
    unknown = _run_healthcheck(target, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_healthcheck_exits_1_when_nothing_listens():
    result = _run_healthcheck(f"127.0.0.1:{_free_port()}", "--timeout", "2")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "UNAVAILABLE" in result.stderr
