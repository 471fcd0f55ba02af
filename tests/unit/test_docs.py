"""The user docs hold together: every relative link in the README, docs/, dev/, benchmarks/ and the
example plugins' READMEs resolves (files and #anchors), every raw log a doc names exists, the README
opens with the quickstart whose test command CI runs, and docs/ holds no journal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("dev/*.md"), ROOT / "benchmarks" / "README.md",
                *ROOT.glob("plugins/*/README.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TEST_COMMAND = ('pip install "torch==2.13.0" -e ".[test]" && pip install ./plugins/bi-engine-example-backend && '
                "python -m pytest -q tests")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))  # no code
    return [m.group(1) for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m.group(1))]


def broken_links(page: Path) -> list[str]:
    bad = []
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{link}: no heading with anchor #{anchor}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    """Negative control for the test above."""
    (tmp_path / "a.md").write_text("# Top\n\n[ok](#top) [gone](missing.md) [bad](#nowhere) [web](https://x.org)\n")
    assert broken_links(tmp_path / "a.md") == ["missing.md: no such file", "#nowhere: no heading with anchor #nowhere"]


def test_headings_slug_as_github_does():
    assert slug("Decode: Qwen3.5-35B-A3B") == "decode-qwen35-35b-a3b"
    assert slug("Serving, RL, scale-out, start-up") == "serving-rl-scale-out-start-up"
    assert slug("`model.random`") == "modelrandom"


def test_every_raw_log_named_exists():
    names = {p.name for p in (ROOT / "dev" / "results").iterdir()}
    for page in PAGES:
        for name in re.findall(r"dev/results/([A-Za-z0-9_.\-]+\.(?:log|jsonl|json|txt))\b", page.read_text()):
            assert name in names, f"{page.relative_to(ROOT)} names dev/results/{name}, which does not exist"


def test_readme_opens_with_the_quickstart_whose_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 16_000
    assert re.findall(r"^## (.+)$", readme, flags=re.M)[0] == "Quickstart"
    assert "pip install \"torch==2.13.0\" -e . && bi-engine --config configs/cpu_reference.yaml" in readme
    assert TEST_COMMAND in readme and TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_docs_hold_no_journal_and_no_diffs():
    assert sorted(p.suffix for p in (ROOT / "docs").iterdir() if p.suffix != ".md") == []
    for page in ROOT.glob("docs/*.md"):
        for heading in re.findall(r"^#{1,6} (.+)$", page.read_text(), flags=re.M):
            assert not re.search(r"\d{4}-\d{2}-\d{2}|session", heading, flags=re.I), f"{page.name}: {heading}"
