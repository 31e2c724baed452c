"""The grant kernels' PTX (ffi/graph_kernels_ptx.h: a compute_80 module and a compute_90 one) is what
tools/gen_ptx.sh makes from ffi/kernels/graph_kernels.cu, assembles for sm_90, and is what the extension
loads. No GPU needed; the nvcc/ptxas checks skip where the CUDA toolkit is absent."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = ROOT / "ffi" / "graph_kernels_ptx.h"
ENTRIES = ("jaxvmm_take_offload", "jaxvmm_take_reload", "jaxvmm_revoke", "jaxvmm_cell_copy", "jaxvmm_publish",
           "jaxvmm_copy", "jaxvmm_ring_reload")


def modules(header_text: str) -> dict[str, str]:
    """{arch: PTX} of the header's modules (kGraphKernelsPtx: "80", kGraphKernelsPtx90: "90")."""
    found = dict(re.findall(r'kGraphKernelsPtx(\d*)\[\] = R"ptx\((.*?)\)ptx"', header_text, re.S))
    assert set(found) == {"", "90"}, f"modules in the header: {sorted(found)}"
    return {"80": found[""], "90": found["90"]}


def entry_body(ptx: str, name: str) -> str:
    m = re.search(rf"\.entry {name}\((.*?)\n}}\n", ptx, re.S)
    assert m, name
    return m.group(1)


@pytest.mark.parametrize("arch", ["80", "90"])
def test_ptx_is_loadable_by_a_cuda_13_driver(arch):
    ptx = modules(HEADER.read_text())[arch]
    version = re.search(r"^\.version (\d+)\.(\d+)$", ptx, re.M)
    assert version and (int(version.group(1)), int(version.group(2))) <= (9, 0), "PTX ISA newer than CUDA 13.0 (driver 580) JITs"
    assert re.search(rf"^\.target sm_{arch}$", ptx, re.M), "compute_80 PTX covers sm_80 and newer by JIT; compute_90 sm_90 and newer"
    for name in ENTRIES:
        assert f".entry {name}(" in ptx


def test_only_the_sm90_round_kernels_wait_for_the_kernel_before_them():
    """Early-launched kernels (a round's copy and publish, on sm_90 and later) must wait on the device for
    the kernel before them (griddepcontrol.wait) before they read what it wrote; the take kernels let
    them be scheduled (launch_dependents). compute_80 has neither instruction."""
    m = modules(HEADER.read_text())
    assert "griddepcontrol" not in m["80"]
    for name in ("jaxvmm_cell_copy", "jaxvmm_publish"):
        body = entry_body(m["90"], name)
        assert "griddepcontrol.wait;" in body, name
    # The publish loads `publish` and writes its flag only after the wait; the copy loads `ptr` (its only
    # volatile load: the early loads of XLA's buffer are plain) only after it.
    for name in ("jaxvmm_cell_copy", "jaxvmm_publish"):
        body = entry_body(m["90"], name)
        assert body.index("griddepcontrol.wait;") < body.index("ld.volatile"), name
    for name in ("jaxvmm_take_offload", "jaxvmm_take_reload"):
        assert "griddepcontrol.launch_dependents;" in entry_body(m["90"], name), name


def test_the_extension_loads_the_checked_in_ptx():
    from jaxvmm.testing import hooks

    assert hooks.graph_kernels_ptx() == modules(HEADER.read_text())["80"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_header_is_what_gen_ptx_makes(tmp_path):
    out = tmp_path / "h.h"
    subprocess.run(["bash", str(ROOT / "tools" / "gen_ptx.sh"), str(out)], check=True, timeout=300)
    assert out.read_text() == HEADER.read_text(), "ffi/graph_kernels_ptx.h is stale: run tools/gen_ptx.sh"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not installed")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_ptx_assembles_for_sm_90(tmp_path, arch):
    src = tmp_path / "k.ptx"
    src.write_text(modules(HEADER.read_text())[arch])
    subprocess.run(["ptxas", "-arch=sm_90", "-o", str(tmp_path / "k.cubin"), str(src)], check=True, timeout=300)
