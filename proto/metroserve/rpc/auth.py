"""Authentication of metroserve's internal gRPC plane: which processes may talk to the scheduler,
the workers and the gateway.

What it protects: every internal channel (gateway <-> scheduler, worker <-> scheduler, gateway <->
worker) and every method on the internal servers, health checks and unknown methods included.
Without it, any process that reaches the scheduler's port could register as a worker and receive
other users' prompts, or evict a worker by reusing its id. The public API's `--api-key`
(services/grpc_api.py, services/rest.py) is a separate check for clients and is not this one.

Two modes, chosen by what the deployment provides (ClusterCredentials):

- Shared cluster secret (METROSERVE_CLUSTER_SECRET, or --cluster-secret-file). Every call carries it
  as `metroserve-cluster-secret` metadata; the server's ClusterSecretInterceptor compares it in
  constant time and refuses a call without it with UNAUTHENTICATED before reading any request
  message, so no servicer code runs and no bytes of the caller's messages are parsed. This works
  across hosts over plain TCP, but without TLS the secret travels in clear text: anyone who can
  watch the network can read it and then join the cluster. Use it on a trusted network (one
  host, a private container network), and TLS on untrusted ones.
- Mutual TLS (--tls-cert, --tls-key, --tls-ca: PEM files). Servers require a client certificate
  signed by the CA and clients verify the server's against the same CA, so a peer without such a
  certificate is refused at the handshake. Given a secret as well, both checks apply.

How deployments provide credentials: `metroserve serve` makes an ephemeral secret
(generate_secret) and hands it to the processes it starts in their environment, never on their
command line, where any local user could read it; docker-compose passes METROSERVE_CLUSTER_SECRET
from the operator's environment to every container. Starting without either a secret or the full
TLS triple is an error (credentials_from_args): there is no unauthenticated mode.

Cost: per call, not per message: the server looks up and compares one metadatum, the client adds
it, so long-lived streams pay once. (grpc.aio's client interceptor wrapper does add a generator hop
per message read, within noise next to the ~30 us a message costs on loopback.) TLS adds its
handshake per connection and encryption per byte.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from metroserve.rpc import GRPC_OPTIONS

logger = logging.getLogger(__name__)

ENV_SECRET = "METROSERVE_CLUSTER_SECRET"
SECRET_METADATA_KEY = "metroserve-cluster-secret"
_NOTHING_GIVEN = (f"no cluster credentials: set {ENV_SECRET} (or --cluster-secret-file) to the cluster's shared "
                  "secret, or give --tls-cert, --tls-key and --tls-ca for mutual TLS")


@dataclass(frozen=True)
class ClusterCredentials:
    """How this process proves itself to the other metroserve processes and checks them.

    `secret`: the shared cluster secret. `tls_cert`, `tls_key`, `tls_ca`: PEM file paths for mutual
    TLS, all three or none; `tls_server_name`: the name clients expect in servers' certificates when
    it differs from the dialed host. At least the secret or the TLS triple (ValueError otherwise).
    Immutable, so one instance may be shared by any number of servers, channels and threads; the
    secret is left out of repr so that logging the credentials cannot leak it.
    """

    secret: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        missing = [flag for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                                           ("--tls-ca", self.tls_ca)) if not path]
        if len(missing) in (1, 2):
            raise ValueError(f"mutual TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
        if self.tls_server_name and missing:
            raise ValueError("--tls-server-name applies to mutual TLS only: give --tls-cert, --tls-key and --tls-ca")
        if self.secret is not None and not _valid_secret(self.secret):
            # It travels as a gRPC metadata value, which must be printable ASCII.
            raise ValueError("the cluster secret must be non-empty printable ASCII without surrounding whitespace")
        if self.secret is None and missing:
            raise ValueError(_NOTHING_GIVEN)

    @classmethod
    def from_env(cls) -> ClusterCredentials:
        """The shared secret in METROSERVE_CLUSTER_SECRET (processes run in-process, tests); ValueError without it."""
        return cls(secret=os.environ.get(ENV_SECRET))

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)  # __post_init__: all three files or none


def _valid_secret(secret: str) -> bool:
    return bool(secret) and secret.isascii() and secret.isprintable() and secret == secret.strip()


def generate_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text) for a cluster that lives as long as its creator."""
    return secrets.token_urlsafe(32)


# -- command line ------------------------------------------------------------------------------

def add_cluster_auth_args(parser: argparse.ArgumentParser) -> None:
    """Adds --cluster-secret-file, --tls-cert, --tls-key, --tls-ca, --tls-server-name in their own group."""
    group = parser.add_argument_group(
        "cluster authentication",
        f"How this process and the other metroserve processes authenticate each other: a shared secret "
        f"(the {ENV_SECRET} environment variable or --cluster-secret-file), mutual TLS, or both. "
        "Without TLS the secret crosses the network in clear text.")
    group.add_argument("--cluster-secret-file", metavar="PATH", default=None,
                       help=f"file holding the shared cluster secret (default: the {ENV_SECRET} environment "
                            "variable); the secret itself is never taken on the command line")
    group.add_argument("--tls-cert", metavar="PEM", default=None,
                       help="this process's certificate, for mutual TLS (with --tls-key and --tls-ca)")
    group.add_argument("--tls-key", metavar="PEM", default=None, help="the private key of --tls-cert")
    group.add_argument("--tls-ca", metavar="PEM", default=None,
                       help="the CA certificate that every metroserve process's certificate must be signed by")
    group.add_argument("--tls-server-name", metavar="NAME", default=None,
                       help="the name to expect in servers' certificates when it differs from the dialed host")


def credentials_from_args(args: argparse.Namespace, *, generate: bool = False) -> ClusterCredentials:
    """The credentials that add_cluster_auth_args' flags and the environment describe.

    The secret comes from --cluster-secret-file, else from METROSERVE_CLUSTER_SECRET. TLS files
    are checked to exist and hold PEM data of the right kind, so a mistake fails here with the flag's
    name rather than later at a handshake. `generate`: when neither a secret nor any TLS flag is
    given, use a fresh secret instead of failing (`serve`, which hands it to its children).
    Raises SystemExit with a one-line reason when the credentials are missing or unusable.
    """
    try:
        if args.cluster_secret_file:
            secret = _read_secret(args.cluster_secret_file)
        else:
            secret = os.environ.get(ENV_SECRET, "").strip()
        tls = (("--tls-cert", args.tls_cert, b"-----BEGIN CERTIFICATE-----"),
               ("--tls-key", args.tls_key, b"PRIVATE KEY-----"),
               ("--tls-ca", args.tls_ca, b"-----BEGIN CERTIFICATE-----"))
        for flag, path, marker in tls:
            if path and marker not in _read_file(flag, path):
                raise ValueError(f"{flag} {path}: no PEM {'private key' if flag == '--tls-key' else 'certificate'}")
        if generate and not secret and not any(path for _, path, _ in tls):
            secret = generate_secret()
        return ClusterCredentials(secret or None, args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    except ValueError as e:
        raise SystemExit(f"cluster authentication: {e}") from None


def _read_file(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {flag} {path}: {e.strerror}") from None


def _read_secret(path: str) -> str:
    secret = _read_file("--cluster-secret-file", path).decode("ascii", errors="replace").strip()
    if not secret:
        raise ValueError(f"--cluster-secret-file {path} is empty")
    return secret


def child_process_auth(creds: ClusterCredentials) -> tuple[list[str], dict[str, str]]:
    """What a process that starts others (`serve`) passes on: (command-line flags, environment entries).

    The secret goes into the environment, which other local users cannot read, never into argv, which
    they can (ps, /proc); TLS file paths are not secret and go into argv.
    """
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in
            (("tls_cert", creds.tls_cert), ("tls_key", creds.tls_key), ("tls_ca", creds.tls_ca),
             ("tls_server_name", creds.tls_server_name)) if value]
    return argv, ({ENV_SECRET: creds.secret} if creds.secret else {})


# -- servers -----------------------------------------------------------------------------------

class ClusterSecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call, to any method known or not, whose metadata lacks the cluster secret.

    Runs once per call, before the server reads a request message: a refused call gets a
    request-streaming handler that aborts without iterating its requests, whatever the method's
    real kind, so nothing the caller sent is deserialized and no servicer code runs. Cost: one
    constant-time compare per call. Stateless after construction; one instance may guard many servers.
    """

    def __init__(self, secret: str):
        self._expected = secret.encode()

    async def intercept_service(self, continuation, handler_call_details):
        presented = _metadata_value(handler_call_details.invocation_metadata, SECRET_METADATA_KEY)
        if presented is not None and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(handler_call_details)
        reason = "no cluster secret" if presented is None else "wrong cluster secret"
        return grpc.stream_stream_rpc_method_handler(functools.partial(_refuse, handler_call_details.method, reason))


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


async def _refuse(method: str, reason: str, request_iterator, context: grpc.aio.ServicerContext) -> None:
    logger.warning("refused %s from %s: %s", method, context.peer(), reason)
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        f"{reason}: calls inside a metroserve cluster need its shared secret "
                        f"({ENV_SECRET} or --cluster-secret-file)")


def server_interceptors(creds: ClusterCredentials) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors an internal server must be built with: the secret check when there is a secret.

    Put them first (grpc.aio.server(interceptors=server_interceptors(creds) + others)) so that no
    other interceptor sees an unauthenticated call. With TLS only, the handshake does the checking.
    """
    return [ClusterSecretInterceptor(creds.secret)] if creds.secret else []


def add_server_port(server: grpc.aio.Server, address: str, creds: ClusterCredentials) -> int:
    """Listens on `address`: with mutual TLS (client certificates required) when TLS files are given,
    else in plain TCP, which only the server_interceptors guard. Returns the port like add_*_port.
    Reads the PEM files now; replacing them takes effect at the next start.
    """
    if not creds.tls:
        return server.add_insecure_port(address)
    assert creds.tls_cert and creds.tls_key and creds.tls_ca  # ClusterCredentials.tls: all three
    server_credentials = grpc.ssl_server_credentials(
        [(Path(creds.tls_key).read_bytes(), Path(creds.tls_cert).read_bytes())],
        root_certificates=Path(creds.tls_ca).read_bytes(), require_client_auth=True)
    return server.add_secure_port(address, server_credentials)


# -- clients -----------------------------------------------------------------------------------

class _AddSecret:
    """Adds the secret to a call's metadata; a copy, since the caller may reuse its Metadata object."""

    def __init__(self, secret: str):
        self._metadatum = (SECRET_METADATA_KEY, secret)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), self._metadatum))


# grpc.aio files an interceptor under the first of the four kinds it implements, so each kind needs its own.
class _UnaryUnarySecret(_AddSecret, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamSecret(_AddSecret, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamUnarySecret(_AddSecret, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamSecret(_AddSecret, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def open_channel(address: str, creds: ClusterCredentials,
                 options: Sequence[tuple[str, object]] = GRPC_OPTIONS) -> grpc.aio.Channel:
    """A channel to another metroserve process: mutual TLS when TLS files are given, else plain TCP;
    with a secret, every call on it (all four kinds) carries the secret as metadata.

    Reads the PEM files now; a channel opened later picks up replaced files. Call from a running event loop.
    """
    interceptors: list[grpc.aio.ClientInterceptor] = []
    if creds.secret:
        interceptors = [cls(creds.secret) for cls in (_UnaryUnarySecret, _UnaryStreamSecret,
                                                      _StreamUnarySecret, _StreamStreamSecret)]
    if not creds.tls:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    assert creds.tls_cert and creds.tls_key and creds.tls_ca  # ClusterCredentials.tls: all three
    channel_credentials = grpc.ssl_channel_credentials(root_certificates=Path(creds.tls_ca).read_bytes(),
                                                       private_key=Path(creds.tls_key).read_bytes(),
                                                       certificate_chain=Path(creds.tls_cert).read_bytes())
    if creds.tls_server_name:
        options = [*options, ("grpc.ssl_target_name_override", creds.tls_server_name)]
    return grpc.aio.secure_channel(address, channel_credentials, options=options, interceptors=interceptors)
