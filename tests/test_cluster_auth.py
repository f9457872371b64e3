"""Cluster authentication (metroserve.rpc.auth) on a loopback aio server: the secret check refuses
before any request is read, the client adds the secret to every kind of call, mutual TLS refuses
peers without a certificate from the cluster's CA, and the command line rejects incomplete credentials."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from metroserve.rpc.auth import (
    ENV_SECRET,
    ClusterCredentials,
    add_cluster_auth_args,
    add_server_port,
    child_process_auth,
    credentials_from_args,
    generate_secret,
    open_channel,
    server_interceptors,
)

SECRET = generate_secret()
TIMEOUT = 5.0
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@dataclass
class Probe:
    """What the server did: handlers entered (by method) and request messages deserialized."""

    entered: list[str] = field(default_factory=list)
    parsed: list[bytes] = field(default_factory=list)

    def deserialize(self, data: bytes) -> bytes:
        self.parsed.append(data)
        return data


class CountingHealth(health.aio.HealthServicer):
    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    async def Check(self, request, context):
        self.probe.entered.append("Check")
        return await super().Check(request, context)

    async def Watch(self, request, context):
        self.probe.entered.append("Watch")
        await super().Watch(request, context)  # writes its replies through the context


def probe_handler(probe: Probe) -> grpc.GenericRpcHandler:
    """test.Probe: one method of each kind over raw bytes, deserialized through the probe."""

    async def echo(request: bytes, context) -> bytes:
        probe.entered.append("Echo")
        metadata = dict(context.invocation_metadata())
        return request + metadata.get("x-extra", "").encode()

    async def repeat(request: bytes, context):
        probe.entered.append("Repeat")
        for _ in range(2):
            yield request

    async def collect(requests, context) -> bytes:
        probe.entered.append("Collect")
        return b"".join([r async for r in requests])

    async def chat(requests, context):
        probe.entered.append("Chat")
        async for r in requests:
            yield r.upper()

    kinds = {"Echo": (grpc.unary_unary_rpc_method_handler, echo),
             "Repeat": (grpc.unary_stream_rpc_method_handler, repeat),
             "Collect": (grpc.stream_unary_rpc_method_handler, collect),
             "Chat": (grpc.stream_stream_rpc_method_handler, chat)}
    return grpc.method_handlers_generic_handler("test.Probe", {
        name: make(behaviour, request_deserializer=probe.deserialize) for name, (make, behaviour) in kinds.items()})


@contextlib.asynccontextmanager
async def serving(creds: ClusterCredentials) -> AsyncIterator[tuple[str, Probe]]:
    probe = Probe()
    server = grpc.aio.server(interceptors=server_interceptors(creds))
    servicer = CountingHealth(probe)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((probe_handler(probe),))
    port = add_server_port(server, "127.0.0.1:0", creds)
    assert port > 0
    await server.start()
    try:
        yield f"127.0.0.1:{port}", probe
    finally:
        await server.stop(None)


async def requests(*items: bytes) -> AsyncIterator[bytes]:
    for item in items:
        yield item


def raw(channel: grpc.aio.Channel, kind: str, method: str):
    return getattr(channel, kind)(f"/test.Probe/{method}")


async def call_every_kind(channel: grpc.aio.Channel) -> dict[str, object]:
    """Each kind of call once; the value is the answer, or the status code it failed with."""
    stub = health_pb2_grpc.HealthStub(channel)

    async def watch_first():
        call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        try:
            return (await call.read()).status  # Watch never ends by itself
        finally:
            call.cancel()

    async def chat():
        call = raw(channel, "stream_stream", "Chat")(timeout=TIMEOUT)
        await call.write(b"ab")
        replies = [await call.read()]
        await call.done_writing()
        replies.append(await call.read())
        return replies

    calls = {
        "Check": lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT),
        "Watch": watch_first,
        "Echo": lambda: raw(channel, "unary_unary", "Echo")(b"hi", timeout=TIMEOUT),
        "Repeat": lambda: _collect(raw(channel, "unary_stream", "Repeat")(b"hi", timeout=TIMEOUT)),
        "Collect": lambda: raw(channel, "stream_unary", "Collect")(requests(b"a", b"b"), timeout=TIMEOUT),
        "Chat": chat,
    }
    results: dict[str, object] = {}
    for name, make in calls.items():
        try:
            results[name] = await make()
        except grpc.aio.AioRpcError as e:
            results[name] = e.code()
    return results


async def _collect(call) -> list:
    return [r async for r in call]


EXPECTED = {"Check": health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING),
            "Watch": health_pb2.HealthCheckResponse.SERVING, "Echo": b"hi", "Repeat": [b"hi", b"hi"],
            "Collect": b"ab", "Chat": [b"AB", grpc.aio.EOF]}


def test_the_right_secret_passes_every_kind_of_call():
    async def main():
        creds = ClusterCredentials(secret=SECRET)
        async with serving(creds) as (address, probe), open_channel(address, creds) as channel:
            assert await call_every_kind(channel) == EXPECTED
            assert sorted(probe.entered) == sorted(EXPECTED)
    asyncio.run(main())


@pytest.mark.parametrize("client_secret", [None, "not-the-secret", SECRET[:-1]], ids=["none", "wrong", "truncated"])
def test_calls_without_the_secret_are_refused_before_any_message_is_read(client_secret):
    async def main():
        async with serving(ClusterCredentials(secret=SECRET)) as (address, probe):
            if client_secret is None:
                channel = grpc.aio.insecure_channel(address)
            else:
                channel = open_channel(address, ClusterCredentials(secret=client_secret))
            async with channel:
                assert await call_every_kind(channel) == dict.fromkeys(EXPECTED, UNAUTHENTICATED)
            assert probe.entered == [] and probe.parsed == []
    asyncio.run(main())


class Aborted(Exception):
    pass


class FakeContext:
    code: grpc.StatusCode | None = None

    def peer(self) -> str:
        return "ipv4:192.0.2.1:5000"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


def test_a_refused_call_gets_a_handler_that_never_reads_its_requests(caplog):
    async def main():
        interceptor = server_interceptors(ClusterCredentials(secret=SECRET))[0]

        async def continuation(details):
            raise AssertionError("the method's own handler was looked up")

        read: list[bytes] = []

        async def requests():
            read.append(b"")
            yield b""

        for metadata in ((), (("metroserve-cluster-secret", "guess"),)):
            details = SimpleNamespace(method="/test.Probe/Echo", invocation_metadata=metadata)
            handler = await interceptor.intercept_service(continuation, details)
            assert handler.request_streaming and handler.request_deserializer is None
            context = FakeContext()
            with pytest.raises(Aborted):
                await handler.stream_stream(requests(), context)
            assert context.code == UNAUTHENTICATED and read == []
    asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "refused /test.Probe/Echo from ipv4:192.0.2.1:5000: no cluster secret",
        "refused /test.Probe/Echo from ipv4:192.0.2.1:5000: wrong cluster secret"]  # never the secret tried


def test_unknown_methods_are_refused_not_reported_missing():
    async def main():
        creds = ClusterCredentials(secret=SECRET)
        async with serving(creds) as (address, probe):
            async with grpc.aio.insecure_channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary("/test.Probe/Nothing")(b"x", timeout=TIMEOUT)
                assert refused.value.code() == UNAUTHENTICATED
                assert ENV_SECRET in refused.value.details() and SECRET not in refused.value.details()
            async with open_channel(address, creds) as channel:  # with the secret, grpc's own answer
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await channel.unary_unary("/test.Probe/Nothing")(b"x", timeout=TIMEOUT)
                assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert probe.parsed == []
    asyncio.run(main())


def test_the_callers_own_metadata_still_arrives():
    async def main():
        creds = ClusterCredentials(secret=SECRET)
        async with serving(creds) as (address, _), open_channel(address, creds) as channel:
            metadata = grpc.aio.Metadata(("x-extra", "!"))
            assert await raw(channel, "unary_unary", "Echo")(b"hi", metadata=metadata, timeout=TIMEOUT) == b"hi!"
            assert list(metadata) == [("x-extra", "!")]  # the secret went into a copy
    asyncio.run(main())


# -- mutual TLS ----------------------------------------------------------------------------------

OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign
[server]
basicConstraints = critical,CA:FALSE
subjectAltName = DNS:localhost,IP:127.0.0.1
extendedKeyUsage = serverAuth
[client]
basicConstraints = critical,CA:FALSE
extendedKeyUsage = clientAuth
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca/server/client from one CA, rogue-ca/rogue from another: <name>.pem and <name>.key (EC P-256)."""
    d = tmp_path_factory.mktemp("pki")
    (d / "openssl.cnf").write_text(OPENSSL_CONFIG)
    common = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
              "-config", str(d / "openssl.cnf")]

    def make(name: str, extensions: str, ca: str | None) -> None:
        signer = ["-CA", str(d / f"{ca}.pem"), "-CAkey", str(d / f"{ca}.key")] if ca else []
        subprocess.run(["openssl", "req", "-x509", *common, "-subj", f"/CN=metroserve-{name}",
                        "-extensions", extensions, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"),
                        *signer],
                       check=True, capture_output=True)

    make("ca", "ca", None)
    make("server", "server", "ca")
    make("client", "client", "ca")
    make("rogue-ca", "ca", None)
    make("rogue", "client", "rogue-ca")
    return d


def tls(pki: Path, name: str, ca: str = "ca", **kw) -> ClusterCredentials:
    return ClusterCredentials(tls_cert=str(pki / f"{name}.pem"), tls_key=str(pki / f"{name}.key"),
                              tls_ca=str(pki / f"{ca}.pem"), **kw)


def test_mutual_tls_serves_a_client_with_a_certificate_from_the_cluster_ca(pki):
    async def main():
        async with serving(tls(pki, "server")) as (address, probe):
            async with open_channel(address, tls(pki, "client")) as channel:
                assert await call_every_kind(channel) == EXPECTED
            # tls_server_name replaces the dialed host as the name the server's certificate must hold.
            async with open_channel(address, tls(pki, "client", tls_server_name="localhost")) as channel:
                assert await raw(channel, "unary_unary", "Echo")(b"x", timeout=TIMEOUT) == b"x"
            async with open_channel(address, tls(pki, "client", tls_server_name="elsewhere")) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await raw(channel, "unary_unary", "Echo")(b"x", timeout=TIMEOUT)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert len(probe.entered) == len(EXPECTED) + 1
    asyncio.run(main())


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_cluster_ca(pki):
    async def main():
        async with serving(tls(pki, "server")) as (address, probe):
            rogue = tls(pki, "rogue", ca="ca")  # trusts the server, but its own certificate is from elsewhere
            certless = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
            for channel in (open_channel(address, rogue), grpc.aio.secure_channel(address, certless),
                            grpc.aio.insecure_channel(address)):
                async with channel:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await raw(channel, "unary_unary", "Echo")(b"x", timeout=TIMEOUT)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert probe.entered == [] and probe.parsed == []
    asyncio.run(main())


def test_mutual_tls_with_a_secret_checks_both(pki):
    async def main():
        async with serving(tls(pki, "server", secret=SECRET)) as (address, probe):
            async with open_channel(address, tls(pki, "client", secret="wrong")) as channel:
                assert await call_every_kind(channel) == dict.fromkeys(EXPECTED, UNAUTHENTICATED)
            assert probe.entered == []
            async with open_channel(address, tls(pki, "client", secret=SECRET)) as channel:
                assert await call_every_kind(channel) == EXPECTED
    asyncio.run(main())


# -- command line --------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_auth_args(parser)
    return parser.parse_args(argv)


def test_credentials_come_from_the_secret_file_else_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_SECRET, "from-the-environment")
    assert credentials_from_args(parse()).secret == "from-the-environment"
    (tmp_path / "secret").write_text("from-the-file\n")
    creds = credentials_from_args(parse("--cluster-secret-file", str(tmp_path / "secret")))
    assert creds.secret == "from-the-file" and not creds.tls
    assert "from-the-file" not in repr(creds)


def test_credentials_are_required(tmp_path, monkeypatch, pki):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    cases = {(): ENV_SECRET,
             ("--tls-cert", str(pki / "client.pem")): "missing --tls-key, --tls-ca",
             ("--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key"),
              "--tls-ca", str(tmp_path / "absent.pem")): "cannot read --tls-ca",
             ("--tls-cert", str(pki / "client.key"), "--tls-key", str(pki / "client.key"),
              "--tls-ca", str(pki / "ca.pem")): "--tls-cert",
             ("--cluster-secret-file", str(tmp_path / "absent")): "cannot read --cluster-secret-file",
             ("--cluster-secret-file", str(pki / "openssl.cnf")): "printable ASCII",  # several lines
             ("--cluster-secret-file", str(pki / "openssl.cnf"), "--tls-server-name", "x"): "--tls-server-name"}
    for argv, reason in cases.items():
        with pytest.raises(SystemExit, match=reason):
            credentials_from_args(parse(*argv))
    creds = credentials_from_args(parse("--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key"),
                                        "--tls-ca", str(pki / "ca.pem")))
    assert creds.tls and creds.secret is None


def test_serve_generates_a_secret_and_hands_it_on_by_environment_only(monkeypatch, pki):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    creds = credentials_from_args(parse(), generate=True)
    assert creds.secret and creds.secret != credentials_from_args(parse(), generate=True).secret
    assert child_process_auth(creds) == ([], {ENV_SECRET: creds.secret})
    parent = tls(pki, "client", secret=creds.secret, tls_server_name="localhost")
    argv, env = child_process_auth(parent)
    assert not any(creds.secret in arg for arg in argv) and env == {ENV_SECRET: creds.secret}
    monkeypatch.setenv(ENV_SECRET, creds.secret)
    assert credentials_from_args(parse(*argv)) == parent  # what the child reads back
