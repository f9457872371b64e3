"""The internal plane refuses peers without the cluster's credentials, on a real `serve` stack.

Every call below comes from a process that reached the ports but holds no (or a wrong) secret: it
cannot register as a worker (and so receive prompts), take over a running worker's id, submit or
abort requests, read the cluster's status, or subscribe to a worker's tokens. Each is refused with
UNAUTHENTICATED before any message is read (the interceptor's own tests in test_cluster_auth.py show
that no message is parsed). With the secret, the same calls work, and serve needed no manual step.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import grpc
import openai
import pytest

from metroserve.rpc import cluster_pb2, cluster_pb2_grpc, generation_pb2, generation_pb2_grpc
from metroserve.rpc.auth import SECRET_METADATA_KEY
from tests.stack import ServeStack, cluster_metadata, wait_for

pytestmark = pytest.mark.service

NO_SECRET: tuple = ()
WRONG_SECRET = ((SECRET_METADATA_KEY, "not-the-secret"),)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    with ServeStack(tiny_model_dir, workers=1, extra_args=["--served-model-name", "tiny"],
                    log_path=tmp_path_factory.mktemp("serve") / "serve.log") as s:
        yield s


def _register(worker_id: str) -> cluster_pb2.WorkerMessage:
    return cluster_pb2.WorkerMessage(register=cluster_pb2.Register(
        worker_id=worker_id, epoch=1, model="tiny", limits=cluster_pb2.RequestLimits(
            vocab_size=512, max_model_len=2048, max_num_seqs=256, block_size=16, num_blocks=1 << 20)))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (err.value.code(), err.value.details())
    return err.value


def _worker_address(stack) -> str:
    (worker,) = stack.cluster_status().workers
    return worker.address


@pytest.mark.parametrize("metadata", [NO_SECRET, WRONG_SECRET], ids=["no-secret", "wrong-secret"])
def test_cannot_register_as_a_worker(stack, metadata):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        hub = cluster_pb2_grpc.WorkerHubStub(channel)
        _refused(lambda: list(hub.Connect(iter([_register("rogue")]), metadata=metadata, timeout=10)))
    assert [w.worker_id for w in stack.cluster_status().workers] == ["worker-0"]


def test_cannot_take_over_a_running_workers_id(stack):
    before = stack.cluster_status().workers[0]
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        hub = cluster_pb2_grpc.WorkerHubStub(channel)
        _refused(lambda: list(hub.Connect(iter([_register(before.worker_id)]), metadata=NO_SECRET, timeout=10)))
    (after,) = stack.cluster_status().workers
    assert (after.worker_id, after.epoch, after.pid) == (before.worker_id, before.epoch, before.pid)


def test_cannot_submit_or_abort_through_the_gateway_hub(stack):
    """GatewayHub carries the scheduler's Generate and Abort: submissions and aborts of requests."""
    submit = cluster_pb2.GatewayMessage(register=cluster_pb2.GatewayRegister(gateway_id="rogue", in_flight=[
        cluster_pb2.Submission(request=generation_pb2.GenerateRequest(
            request_id="stolen", token_ids=generation_pb2.TokenIds(ids=[5, 6, 7])))]))
    abort = cluster_pb2.GatewayMessage(abort=[generation_pb2.AbortRequest(request_id="someone-elses")])
    admitted = stack.cluster_status().num_admitted
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        hub = cluster_pb2_grpc.GatewayHubStub(channel)
        _refused(lambda: list(hub.Connect(iter([submit, abort]), metadata=NO_SECRET, timeout=10)))
    status = stack.cluster_status()
    assert status.num_gateways == 1 and status.num_admitted == admitted


@pytest.mark.parametrize("method", ["Generate", "Abort", "ListModels"])
def test_the_scheduler_serves_no_public_generation_api(stack, method):
    """Clients use a gateway. On the scheduler's port, the old token-carrying Generation service is
    refused without credentials and does not exist with them."""
    request = {"Generate": generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6])),
               "Abort": generation_pb2.AbortRequest(request_id="x"),
               "ListModels": generation_pb2.ListModelsRequest()}[method]
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = getattr(stub, method)

        def invoke(metadata):
            reply = call(request, metadata=metadata, timeout=10)
            return list(reply) if method == "Generate" else reply

        _refused(lambda: invoke(NO_SECRET))
        with pytest.raises(grpc.RpcError) as err:
            invoke(cluster_metadata())
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_cannot_read_the_cluster_status(stack):
    with grpc.insecure_channel(stack.scheduler_address) as channel:
        stub = cluster_pb2_grpc.ClusterStub(channel)
        _refused(lambda: stub.GetStatus(cluster_pb2.ClusterStatusRequest(), metadata=WRONG_SECRET, timeout=10))
        assert stub.GetStatus(cluster_pb2.ClusterStatusRequest(), metadata=cluster_metadata(), timeout=10).workers


def test_cannot_subscribe_to_a_workers_tokens(stack):
    address = _worker_address(stack)
    assert address.startswith("127.0.0.1:")  # serve binds nothing beyond loopback
    with grpc.insecure_channel(address) as channel:
        stub = cluster_pb2_grpc.TokenStreamStub(channel)
        _refused(lambda: next(iter(stub.Subscribe(cluster_pb2.Subscription(gateway_id="rogue"),
                                                  metadata=NO_SECRET, timeout=10))))



def _listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every TCP socket the process listens on, from /proc: its socket inodes
    matched against its network namespace's tcp and tcp6 tables (state 0A is LISTEN)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:
                continue
            ip_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(ip_hex)  # 32-bit words in host (little-endian) order
            ip = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, ip), int(port_hex, 16)))
    return found


def _is_loopback(ip: str) -> bool:
    """127.0.0.0/8 and ::1, also as grpc binds them: IPv4 in IPv6 (::ffff:127.0.0.1)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def test_serve_listens_on_loopback_only(stack):
    """Every port of every process serve started (gateway HTTP and gRPC, scheduler, worker token
    and health ports, metrics) is bound to loopback when no --host asks otherwise."""
    listening = {component: [a for pid in stack.child_pids(component) for a in _listening_addresses(pid)]
                 for component in ("gateway", "scheduler", "worker")}
    assert all(listening.values()), listening  # each process listens somewhere: the parse found them
    assert (stack.port in {port for _, port in listening["gateway"]}
            and stack.grpc_port in {port for _, port in listening["gateway"]}), listening
    exposed = {c: [a for a in addrs if not _is_loopback(a[0])] for c, addrs in listening.items()}
    assert not any(exposed.values()), exposed

def test_with_credentials_everything_works(stack):
    """serve made and handed out the secret itself: requests run, and a peer holding it is served."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    wait_for(lambda: stack.cluster_status().num_finished >= 1, 10, "the request to finish")
