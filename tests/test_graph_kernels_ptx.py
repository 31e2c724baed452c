"""The grant kernels' PTX (ffi/graph_kernels_ptx.h) is what tools/gen_ptx.sh makes from
ffi/kernels/graph_kernels.cu, assembles for sm_90, and is what the extension loads. No GPU needed;
the nvcc/ptxas checks skip where the CUDA toolkit is absent."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "ffi" / "graph_kernels_ptx.h"


def ptx_of(header_text: str) -> str:
    m = re.search(r'R"ptx\((.*)\)ptx"', header_text, re.S)
    assert m, "no raw PTX string in the header"
    return m.group(1)


def test_ptx_is_loadable_by_a_cuda_13_driver():
    ptx = ptx_of(HEADER.read_text())
    version = re.search(r"^\.version (\d+)\.(\d+)$", ptx, re.M)
    assert version and (int(version.group(1)), int(version.group(2))) <= (9, 0), "PTX ISA newer than CUDA 13.0 (driver 580) JITs"
    assert re.search(r"^\.target sm_80$", ptx, re.M), "compute_80 PTX covers sm_80 and newer (H100/H200) by JIT"
    for name in ("jaxvmm_take_offload", "jaxvmm_take_reload", "jaxvmm_revoke", "jaxvmm_cell_copy", "jaxvmm_fused_offload",
                 "jaxvmm_fused_reload", "jaxvmm_publish", "jaxvmm_copy"):
        assert f".entry {name}(" in ptx


def test_the_extension_loads_the_checked_in_ptx():
    from jaxvmm._native import lib

    assert lib.graph_kernels_ptx() == ptx_of(HEADER.read_text())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_header_is_what_gen_ptx_makes(tmp_path):
    out = tmp_path / "h.h"
    subprocess.run(["bash", str(ROOT / "tools" / "gen_ptx.sh"), str(out)], check=True, timeout=300)
    assert out.read_text() == HEADER.read_text(), "ffi/graph_kernels_ptx.h is stale: run tools/gen_ptx.sh"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
def test_ptx_assembles_for_sm_90(tmp_path):
    src = tmp_path / "k.ptx"
    src.write_text(ptx_of(HEADER.read_text()))
    subprocess.run(["ptxas", "-arch=sm_90", "-o", str(tmp_path / "k.cubin"), str(src)], check=True, timeout=300)
