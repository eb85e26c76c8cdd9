"""The README is a front page that stays true: at most 15 KiB, its Python snippets run as written (each in a
fresh interpreter on the CPU, as a new user would paste it), its commands are the Makefile's targets, and every
file it or a guide links to exists, down to the heading an anchor names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT = 15 * 1024


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_is_a_front_page():
    # It was 102 KB: 1,299 lines, mostly measurement narrative.
    size = len(README.read_bytes())
    assert size <= LIMIT, f"README.md is {size} bytes, over {LIMIT}: move detail into docs/"
    assert len(blocks(README.read_text(), "python")) == 3


@pytest.mark.parametrize("index", range(3))
def test_readme_snippet_runs_as_written(index, tmp_path):
    code = blocks(README.read_text(), "python")[index]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    said = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"README snippet {index + 1} failed:\n{code}\n{said}"


def test_readme_commands_are_makefile_targets():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = re.findall(r"^make ([\w-]+)", "\n".join(blocks(README.read_text(), "bash")), flags=re.M)
    assert named == ["demo", "test"] and set(named) <= targets


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_numbers_link_their_results_files():
    section = README.read_text().split("## Numbers", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "bench/results/" in r]
    assert len(rows) >= 5, section
    for row in rows:
        assert re.search(r"\]\(bench/results/[\w/.-]+\.md\)", row), row
        assert row.startswith(("| simulated", "| measured")), f"say whether it is simulated: {row}"
