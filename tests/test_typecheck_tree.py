"""typecheck/metroserve/ mirrors pyproject's package-dir with symlinks, so that mypy (which follows
neither package-dir nor the editable install's import hook) sees the one `metroserve` namespace.
A package-dir entry without its link would make every import of that package silently Any."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "typecheck"


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes `package` from: its nearest mapped ancestor's folder plus the rest."""
    parts = package.split(".")
    for n in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:n]))
        if mapped is not None:
            return ROOT / mapped / Path(*parts[n:])
    return ROOT / Path(*parts)


def test_every_package_resolves_to_its_folder_in_the_tree():
    setuptools = _setuptools()
    for package in setuptools["packages"]:
        if "." not in package:  # the root is a real folder of links (the next test)
            continue
        source = _source_dir(package, setuptools["package-dir"])
        mirrored = TREE / Path(*package.split("."))
        assert mirrored.resolve() == source.resolve(), f"{package}: typecheck/ has {mirrored}, setuptools {source}"


def test_the_root_package_modules_are_all_linked():
    root_package = ROOT / "metroserve"
    modules = {p.name for p in root_package.glob("*.py")}
    linked = {p.name for p in (TREE / "metroserve").glob("*.py")}
    assert modules == linked, "link the new module into typecheck/metroserve/ (or remove the stale link)"
    for name in modules:
        assert (TREE / "metroserve" / name).resolve() == (root_package / name).resolve()


def test_no_link_in_the_tree_dangles():
    for path in (TREE / "metroserve").iterdir():
        assert path.exists(), f"{path} points at {path.readlink()}, which is gone"
