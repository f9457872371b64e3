#!/usr/bin/env bash
# The project's test command: installs what is missing or changed (scripts/setup.sh: a no-op pip-wise
# when pyproject.toml is unchanged, and it builds the CPU kernels once), then runs the suite. Extra
# args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
