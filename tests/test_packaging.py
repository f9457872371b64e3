"""`pip install .` adds one import package, `metroserve`, holding every package folder of the repo."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every folder with an __init__.py under the mapped roots, by the module name it installs as."""
    folders = {}
    for name, folder in _setuptools_config()["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            folders[".".join([name, *relative.parts])] = init.parent
    return folders


def test_every_package_folder_is_listed_once():
    listed = _setuptools_config()["packages"]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(_package_folders())


def test_the_wheel_installs_only_the_metroserve_package(tmp_path):
    # Built from a copy of the tracked files: an in-tree build would leave build/ behind.
    source = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "wheel").glob("metroserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        paths = [line.split(",", 1)[0] for line in zf.read(record).decode().splitlines() if line]
    top_level = {p.split("/", 1)[0] for p in paths}
    assert top_level == {"metroserve", record.split("/", 1)[0]}
    for module in ("metroserve/worker/engine.py", "metroserve/rpc/generation_pb2.py", "metroserve/common/stop_rules.py",
                   "metroserve/worker/csrc/vec.h", "metroserve/worker/attention/cpu.py"):
        assert module in paths, module
