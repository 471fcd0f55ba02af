"""bi_core's modules import each other without a circle, lazy (function-level) imports included:
every ``import`` and ``from ... import`` in every module, wherever it sits, is an edge to the
module it names (``from a import b``: to ``a.b`` when that is a submodule, else to ``a``), and
the graph of those edges must have no cycle. Imports under ``if TYPE_CHECKING:`` count too: a
type a module only names is still a dependency of its design. Importing ``a.b`` runs
``a/__init__`` first, but that is no edge: a package importing its own submodules closes a
circle only where one of them imports the package's names (``from a import x``), which is an
edge. Names imported by string (``importlib.import_module``: plugins, worker extensions) are
not seen. And no two modules share a name unless the layout means it (``repeated_names``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "bi_core"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name -> file (a package is its __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import (``from .x import y`` in ``module``)."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            # ``from a import b``: the submodule a.b when there is one, else a name in a
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # ``import a.b.c`` of a name inside a module: its module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    files = module_files(root, package)
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_bi_core_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def repeated_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Module names used more than once where the layout does not mean it. Meant: an op family's
    name (``ops/attention.py``) names its backends' files and its kernels' (``kernels/``); backend
    folders mirror one another (``builders.py``); a package's contract is its ``base.py``; every
    package has an ``__init__``."""
    ops = {name.rpartition(".")[2] for name in modules if name.startswith(f"{PACKAGE}.ops.")}
    by_stem: dict[str, list[str]] = defaultdict(list)
    for name, path in modules.items():
        if path.name != "__init__.py":
            by_stem[path.stem].append(name)
    repeated = {}
    for stem, names in by_stem.items():
        mirrors = stem in ops
        outside = [n for n in names if not n.startswith(f"{PACKAGE}.backends.")
                   and not (mirrors and n in (f"{PACKAGE}.ops.{stem}", f"{PACKAGE}.kernels.{stem}"))]
        if len(names) > 1 and stem != "base" and outside:
            repeated[stem] = sorted(names)
    return repeated


def test_module_names_say_what_they_do():
    """Two modules share a name only where the layout means it (rl/ and serve/ each had a
    ``worker.py``, a ``control.py`` and a ``protocol.py``, of different things)."""
    modules = module_files()
    assert repeated_names(modules) == {}
    # negative controls: a second worker.py outside the backends; a kernel named like a backend's file
    extra = {**modules, "bi_core.serve.worker": ROOT / "bi_core/serve/worker.py",
             "bi_core.rl.worker": ROOT / "bi_core/rl/worker.py",
             "bi_core.backends.reference.gemm": ROOT / "bi_core/backends/reference/gemm.py"}
    assert repeated_names(extra) == {"gemm": ["bi_core.backends.reference.gemm", "bi_core.kernels.gemm"],
                                     "worker": ["bi_core.rl.worker", "bi_core.serve.worker"]}


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, cycle", [
    # a lazy import inside a function closes the circle
    ({"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
      "pkg/b.py": "def f():\n    from pkg import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    # a package's __init__ re-exporting a submodule that imports the package
    ({"pkg/__init__.py": "from pkg.a import x\n", "pkg/a.py": "from pkg import y\n"}, ["pkg", "pkg.a", "pkg"]),
    # relative imports, and one under TYPE_CHECKING
    ({"pkg/__init__.py": "", "pkg/sub/__init__.py": "", "pkg/sub/a.py": "from ..b import f\n",
      "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import a\n"},
     ["pkg.b", "pkg.sub.a", "pkg.b"]),
])
def test_the_search_finds_a_cycle(tmp_path, files, cycle):
    """The negative controls: each package has one circle, which the test names."""
    assert find_cycle(import_graph(_package(tmp_path, files), "pkg")) == cycle


def test_the_search_passes_a_layered_package(tmp_path):
    root = _package(tmp_path, {"pkg/__init__.py": "from pkg.a import x\n", "pkg/a.py": "import os\nfrom pkg.b import y\n",
                               "pkg/b.py": "def f():\n    import pkg.c\n", "pkg/c.py": ""})
    graph = import_graph(root, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": set()}
    assert find_cycle(graph) is None
