"""bi_core's comments and docstrings carry no measured figures and cite no benchmark sections:
there they go stale. A comment says why in words and points to docs/performance.md or
dev/benchmarks-history.md, where figures are kept with their dates and machines.
``bi_core/kernels/`` is left out: each shipped compile manifest records its kernel files' hashes."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FROZEN = ROOT / "bi_core" / "kernels"
# a benchmark section, a time per call or step, a rate: what a measurement says
MEASURED = re.compile(r"\bsections? \d+|benchmarks section|\d(\.\d+)? ?(ms|µs|us)\b|\d ?(tok|tokens|GB|TB)/s\b")


def texts(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def figures(root: Path) -> list[str]:
    """``path:line: figure`` for every measured figure in the comments and docstrings under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if FROZEN in path.parents:
            continue
        for line, text in sorted(texts(path.read_text())):
            found += [f"{path.relative_to(root)}:{line}: {m.group(0)!r}" for m in MEASURED.finditer(text)]
    return found


def test_no_measured_figure_in_comments_or_docstrings():
    assert figures(ROOT / "bi_core") == []


def test_the_check_sees_a_comment_and_a_docstring(tmp_path):
    """Negative control: a citation in a docstring and a figure in a comment are found, a string
    the code uses is not."""
    (tmp_path / "m.py").write_text('"""Fast (benchmarks section 12)."""\nX = 1  # 2.5 ms a step\nS = "3 ms"\n')
    assert figures(tmp_path) == ["m.py:1: 'benchmarks section'", "m.py:2: '2.5 ms'"]
