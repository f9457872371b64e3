#!/usr/bin/env bash
# Regenerate the gRPC stubs in proto/metroserve_rpc from the .proto files beside them.
# The stubs are committed; tests/test_proto.py fails when they drift from the .proto files.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-proto}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Iproto --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
    proto/metroserve_rpc/generation.proto proto/metroserve_rpc/cluster.proto
