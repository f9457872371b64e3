#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU: the GPU tests, then benchmarks/gpu_check.py
# (Triton vs torch attention timings, decode tokens/s with CUDA graphs on and off against the
# memory-bandwidth roofline, the offline throughput benchmark), all written to one folder:
#   environment.txt  tests.log  bench.log  report.md  results.json  throughput.json
# Sized to finish in about 6 minutes, under 8 at worst (tests <= 210 s: a fresh machine compiles
# every kernel variant the tests launch, about 60; benchmarks <= 215 s, a
# section skipped when its estimate would end past 200 s), so that a 15-minute GPU lease can run it
# once and rerun it once. The report is rewritten after every measurement, so a run stopped early
# still leaves its numbers. Order: kernels, the default model's decode (graphs on, off), the
# throughput benchmark, then the 1B model's decode while time is left.
#
#   bash scripts/gpu_check.sh [--smoke] [OUT_DIR]     (default OUT_DIR: benchmarks/results/gpu_check)
#
# --smoke checks the script on any machine: tiny shapes, CPU tensors in Triton's interpreter.
# It uses $PYTHON, else python3 when that has torch (a GPU image's own), else .venv/bin/python;
# it installs nothing from a registry (only this checkout, editable, where it is not installed).
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=()
if [[ "${1:-}" == "--smoke" ]]; then
  smoke=(--smoke)
  shift
fi
out=${1:-benchmarks/results/gpu_check}
mkdir -p "$out"
rm -f "$out"/{environment.txt,tests.log,bench.log,report.md,results.json,throughput.json}  # no stale results

py=${PYTHON:-}
if [[ -z "$py" ]]; then
  if python3 -c "import torch" 2>/dev/null; then py=python3; else py=.venv/bin/python; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The package's folders are mapped by pyproject.toml's package-dir, so a bare checkout does not import
# as `metroserve.worker`: where it is not installed, install it editable with no dependencies (no
# registry needed; a GPU image brings torch, triton and transformers, and its Python may be newer
# than the 3.11 the project pins for its own venv).
if ! "$py" -c "import metroserve.worker.config, metroserve.benchmarks" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --no-build-isolation --ignore-requires-python -e . 2>&1 | tail -n 3
fi
# Every model is a local folder; offline mode keeps a hub lookup from waiting on an unreachable network.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
start=$(date +%s)

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
  "$py" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__,
'| gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
  # Triton builds a small C launcher on first use: without a C compiler and Python.h every kernel fails.
  echo "C compiler: $(command -v cc || command -v gcc || echo MISSING)"
  "$py" -c "import os, sysconfig; h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); print('Python.h:', h if os.path.exists(h) else 'MISSING')"
} 2>&1 | tee "$out/environment.txt"

tests=(tests/test_gpu.py tests/test_triton_attention.py)
[[ ${#smoke[@]} -gt 0 ]] && tests=(tests/test_gpu.py)  # the interpreter cases already run in the CPU suite
timeout -k 10 210 "$py" -m pytest -q -p no:cacheprovider --durations=15 "${tests[@]}" 2>&1 | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}

# Sections are skipped when their estimate would end past the deadline; the timeout is the backstop
# (SIGTERM: the report is written on the way out; SIGKILL 15 s later if a kernel hangs).
deadline=$(( $(date +%s) + 200 ))
timeout -k 15 215 "$py" benchmarks/gpu_check.py --out "$out" --deadline "$deadline" "${smoke[@]}" 2>&1 \
  | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}

summary="GPU tests exit $tests_rc ($(tail -n 1 "$out/tests.log")); benchmarks exit $bench_rc; $(( $(date +%s) - start )) s in all."
echo "$summary"
if [[ -f "$out/report.md" ]]; then
  printf '\n%s\n' "$summary" >> "$out/report.md"
fi
[[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
