#!/usr/bin/env bash
# Regenerate the gRPC stubs in proto/metroserve/rpc from the .proto files beside them.
# The stubs are committed; tests/test_proto.py fails when they drift from the .proto files.
# The .proto files sit at metroserve/rpc/ under proto/, so the stubs import as `metroserve.rpc`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-proto}
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -Iproto --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
    proto/metroserve/rpc/generation.proto proto/metroserve/rpc/cluster.proto
