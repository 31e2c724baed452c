"""Every ```python block of README.md runs, on its own, in a fresh interpreter on the cpu platform."""

from __future__ import annotations

import pathlib
import re

import pytest

from conftest import run_in_subprocess

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    out = []
    for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, re.DOTALL | re.MULTILINE):
        out.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return out


BLOCKS = python_blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3, BLOCKS


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
    r = run_in_subprocess(code, env={"JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, f"README.md line {line}:\n{code}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
