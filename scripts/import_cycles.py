"""Count import cycles among the metroserve modules; exit 1 if there is any.

    python scripts/import_cycles.py [ROOT]    (ROOT: the repository, default this script's)

Static: every .py under the folders that pyproject.toml's [tool.setuptools.package-dir] maps into
the namespace is parsed with ast, never imported (no torch). An edge is an import that runs when
the module is imported, or that a type checker follows: module level, class bodies and
`if TYPE_CHECKING:` blocks. Imports inside functions are skipped: they are the deliberately lazy
ones. `from a.b import c` points at module a.b.c when that is a module, else at a.b; importing a
submodule does not count as importing its parent package. A cycle is a strongly connected
component of more than one module, or a module that imports itself.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from pathlib import Path


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every package folder mapped in pyproject.toml."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    modules: dict[str, Path] = {}
    for package, folder in package_dir.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def eager_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements outside function bodies (module level, class bodies, if/try/with blocks)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                stack.append(child)
    return found


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom,
                   modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {t for alias in node.names if (t := _known_prefix(alias.name, modules))}
    base = node.module or ""
    if node.level:  # relative: from the module's own package, one level up per extra dot
        package = module if is_package else module.rpartition(".")[0]
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
    targets = set()
    for alias in node.names:
        target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _known_prefix(base, modules)
        if target:
            targets.add(target)
    return targets


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = set()
        for node in eager_imports(tree):
            graph[name] |= import_targets(name, is_package, node, modules)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on long import chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def import_cycles(root: Path) -> list[list[str]]:
    graph = import_graph(module_files(root))
    return sorted(c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]])


def main() -> int:
    parser = argparse.ArgumentParser(description="Count import cycles among the metroserve modules "
                                     "(static, nothing is imported); exit 1 if there is any.")
    parser.add_argument("root", nargs="?", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository (default: this script's)")
    cycles = import_cycles(parser.parse_args().root)
    for cycle in cycles:
        print("cycle: " + ", ".join(cycle))
    print(f"{len(cycles)} import cycle(s)")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
