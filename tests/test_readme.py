"""Every ```python block of README.md and of the user docs (docs/*.md) runs, on its own, in a fresh
interpreter on the cpu platform."""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import run_in_subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    text = path.read_text()
    out = []
    for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.DOTALL | re.MULTILINE):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


BLOCKS = [(path.relative_to(ROOT).as_posix(), line, code) for path in DOCS for line, code in python_blocks(path)]


def test_readme_has_python_blocks():
    assert len(python_blocks(README)) >= 3, python_blocks(README)


def test_the_docs_that_moved_out_of_the_readme_keep_their_examples():
    # the examples of the sections that left README.md for docs/ still run (below)
    files = {name for name, _, _ in BLOCKS}
    assert {"docs/offload.md", "docs/lifetimes.md", "docs/performance.md", "docs/sharing.md"} <= files, files


@pytest.mark.parametrize("name,line,code", BLOCKS, ids=[f"{name}:{line}" for name, line, _ in BLOCKS])
def test_readme_block_runs(name, line, code):
    r = run_in_subprocess(code, env={"JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, f"{name} line {line}:\n{code}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
