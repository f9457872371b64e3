"""scripts/gpu_check.sh must work the first time it meets a GPU: its smoke mode runs every section
of the report on tiny shapes here (CPU, Triton interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for heading in ("## Attention layer: Triton vs torch backend", "## Decode tokens/s against the memory-bandwidth",
                    "## Offline throughput"):
        assert heading in report, report
    assert "failed" not in report and "GPU tests exit 0" in report
    assert {p.name for p in tmp_path.iterdir()} == {"environment.txt", "tests.log", "bench.log", "report.md",
                                                    "results.json", "throughput.json"}
