"""`python -m metroserve.services.healthcheck HOST:PORT`: exit 0 when the gRPC server there reports SERVING.

Container health checks run this against the scheduler and the workers, which serve the standard
grpc.health.v1 service: the slim image has no grpc_health_probe binary, and this imports only grpc,
so a check costs well under a second. The scheduler's port requires the cluster secret: it is sent
when METROSERVE_CLUSTER_SECRET is set (compose sets it in every metroserve container).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 3.0) -> str | None:
    """None when `service` at `target` is SERVING, else a short reason (status or RPC error)."""
    request = health_pb2.HealthCheckRequest(service=service)
    # Names from metroserve.rpc.auth, spelled out: importing it would load the generated stubs too.
    secret = os.environ.get("METROSERVE_CLUSTER_SECRET")
    metadata = (("metroserve-cluster-secret", secret),) if secret else None
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as error:
        return f"{error.code().name}: {' '.join(str(error.details()).split())}"  # one line
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metroserve.services.healthcheck",
                                     description="Exit 0 when a gRPC server reports SERVING (grpc.health.v1), "
                                                 "else 1 with one line on stderr.")
    parser.add_argument("target", metavar="HOST:PORT", help="the server to ask, e.g. 127.0.0.1:50051")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    reason = check(args.target, args.service, args.timeout)
    if reason is None:
        return 0
    print(f"healthcheck: {args.target} {args.service or '(server)'}: {reason}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
