"""No import cycles among the metroserve modules (scripts/import_cycles.py, static: torch is never imported)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "import_cycles.py"


def run_script(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def test_the_code_base_has_no_import_cycles():
    result = run_script(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("0 import cycle(s)")


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_finds_planted_cycles_and_ignores_lazy_imports(tmp_path):
    write(tmp_path, {
        "pyproject.toml": '[tool.setuptools.package-dir]\n"pkg" = "src"\n"pkg.sub" = "other"\n',
        "src/__init__.py": "from pkg.lazy import f\n",  # a package importing its submodule: no cycle
        "src/a.py": "from pkg.b import x\n",
        "src/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\nx = 1\n",
        "src/self_import.py": "import pkg.self_import\n",
        "src/rel_one.py": "from . import rel_two\n",
        "src/rel_two.py": "from .rel_one import y\n",
        "src/lazy.py": "from pkg.sub.back import z\ndef f():\n    from pkg import lazy_user\n",
        "other/__init__.py": "",
        "other/back.py": "from ..lazy_user import w\nz = 0\n",
        "src/lazy_user.py": "w = 0\nclass C:\n    def m(self):\n        from pkg import lazy\n",
    })
    result = run_script(tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "cycle: pkg.a, pkg.b",
        "cycle: pkg.rel_one, pkg.rel_two",
        "cycle: pkg.self_import",
        "3 import cycle(s)",
    ]
