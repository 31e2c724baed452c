"""The include graph of ffi/ and the link line of CMakeLists.txt (no GPU needed).

The core is layered, each layer seeing only the ones below it:

    driver.h -> status.h -> vmm.h -> slot.h -> registry.h -> worker(s) -> tickets -> ledger, transfers ->
    (op_ring | graph_record, graph_cells -> graph_offload, graph_reload -> graph_mode) -> engine ->
    handlers -> module.cc

``config.*`` (the process-wide settings, plain atomics) sits under everything, so that any part, the
driver seam's cpu model included, reads them. ``fault.*`` sits beside the driver seam (it may include driver.h and stat_fields.h only); ``host_pool.*`` sits beside
slot (vmm.h and below), ``host_numa.cc`` (its HOST_NUMA chunks) above it and slot; ``bench.*`` may include the core up to registry.h. Files may include headers
of lower layers only; a .cc file may also include the headers of its own group. ``stat_fields.h`` (the
stats structs' field tables) includes nothing of ours. ``*.md`` files are
prose. Only module*.h/module*.cc (the bindings) see nanobind, only handlers*.cc see the XLA FFI headers,
nothing includes the CUDA runtime, and nothing links libcuda/libcudart (the driver is resolved at run time).

Every file in ffi/ must be listed in LAYERS. To add a file, add its name (or a glob) to the group it
belongs to, or add a new group with the rank of the layer it sits in.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import pathlib
import re

import pytest

from conftest import run_in_subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
FFI = ROOT / "ffi"
CMAKE = ROOT / "CMakeLists.txt"

ANY = frozenset({"*"})


@dataclasses.dataclass(frozen=True)
class Group:
    rank: int  # a file may include the headers of groups with a lower rank
    files: tuple[str, ...]  # names or globs inside ffi/
    only: frozenset[str] | None = None  # if set: the only headers (besides its own group's) it may include


# The layering table. Lower rank = lower layer.
LAYERS: dict[str, Group] = {
    "driver": Group(0, ("driver.h", "driver.cc", "driver_posix.cc", "driver_cuda.cc", "graph_words.h")),
    # hang diagnostics: every thread's native stack from a signal handler (plain POSIX, includes nothing of ours)
    "debug_stacks": Group(0, ("debug_stacks.h", "debug_stacks.cc"), only=frozenset()),
    # the stats structs' field tables (key, member): plain data, includes nothing of ours
    "stat_fields": Group(0, ("stat_fields.h",), only=frozenset()),
    "fault": Group(0, ("fault.h", "fault.cc"), only=frozenset({"driver.h", "stat_fields.h"})),  # beside the driver seam
    "status": Group(1, ("status.h", "status.cc")),
    "vmm": Group(2, ("vmm.h", "vmm.cc")),
    # the exporter's generation channel and the share counters: plain POSIX, beside vmm
    "share": Group(2, ("share.h", "share.cc"), only=frozenset({"status.h", "driver.h", "stat_fields.h"})),
    "slot": Group(3, ("slot.h", "slot.cc")),
    "registry": Group(4, ("registry.h", "registry.cc")),
    "bench": Group(5, ("bench.h", "bench.cc"),
                   only=frozenset({"registry.h", "slot.h", "vmm.h", "status.h", "driver.h"})),
    # the memory sampler: a thread reading the driver's used memory and the registry's gauges
    "sampler": Group(5, ("sampler.h", "sampler.cc"),
                     only=frozenset({"registry.h", "slot.h", "vmm.h", "status.h", "driver.h", "stat_fields.h"})),
    "host_pool": Group(3, ("host_pool.h", "host_pool.cc")),  # pinned host memory, built on vmm (beside slot)
    "bounce": Group(3, ("bounce.h", "bounce.cc")),  # pinned bounce buffers for pageable copies, built on vmm
    # the host store's host_numa chunks: vmm handles and slot's capability checks (above both)
    "host_numa": Group(4, ("host_numa.cc",), only=frozenset({"host_pool.h", "slot.h", "vmm.h", "status.h",
                                                            "driver.h"})),
    "workers": Group(5, ("worker.h", "worker.cc", "workers.h", "workers.cc")),
    # the staging area: mapped cells over registry slots (beside the workers, never above them)
    "staging": Group(5, ("staging.h", "staging.cc"),
                     only=frozenset({"registry.h", "slot.h", "config.h", "vmm.h", "status.h", "driver.h",
                                     "stat_fields.h"})),
    # tickets: plain data over the host pool and staging leases; no workers, no engine
    "tickets": Group(6, ("tickets.h", "tickets.cc"),
                     only=frozenset({"host_pool.h", "staging.h", "registry.h", "slot.h", "config.h", "vmm.h",
                                     "status.h", "driver.h"})),
    # graph-mode channels: plain data (pinned words, cell addresses) over tickets; no workers, no engine
    "channels": Group(7, ("channels.h", "channels.cc"),
                      only=frozenset({"tickets.h", "host_pool.h", "staging.h", "registry.h", "slot.h", "vmm.h",
                                      "status.h", "driver.h", "graph_words.h"})),
    # the graph-mode grant kernels: run-time loaded PTX (graph_kernels_ptx.h, generated) over the driver seam
    "graph_kernels": Group(5, ("graph_kernels.h", "graph_kernels.cc", "graph_kernels_ptx.h"),
                           only=frozenset({"vmm.h", "status.h", "driver.h"})),
    # process-wide settings (plain atomics) under everything, read by any part (the driver seam's cpu
    # model included); clamped to the channel limits of graph_words.h (plain constants)
    "config": Group(-1, ("config.h", "config.cc"), only=frozenset({"graph_words.h"})),
    # the engine's parts (DESIGN.md, "Engine parts"), each handed what it needs:
    # copies of a ticket's bytes and the graph D2H clock; the ledger (tickets, counters, errors)
    "transfers": Group(7, ("transfers.h", "transfers.cc"),
                       only=frozenset({"tickets.h", "bounce.h", "host_pool.h", "staging.h", "registry.h", "slot.h",
                                       "config.h", "vmm.h", "status.h", "driver.h"})),
    "ledger": Group(7, ("ledger.h", "ledger.cc"),
                    only=frozenset({"tickets.h", "host_pool.h", "staging.h", "registry.h", "slot.h", "vmm.h",
                                    "status.h", "driver.h", "stat_fields.h"})),
    # graph-mode round tickets' host blocks: the pool, else pageable memory and its bounce buffers, the grower
    "round_host": Group(6, ("round_host.h", "round_host.cc"),
                        only=frozenset({"bounce.h", "host_pool.h", "worker.h", "status.h", "driver.h"})),
    # the op ring and graph mode sit side by side: neither sees the other (nor the engine)
    "op_ring": Group(8, ("op_ring.h", "op_ring.cc"),
                     only=frozenset({"ledger.h", "transfers.h", "worker.h", "graph_kernels.h", "tickets.h", "bounce.h",
                                     "host_pool.h",
                                     "staging.h", "registry.h", "slot.h", "config.h", "vmm.h", "status.h",
                                     "driver.h", "stat_fields.h"})),
    # graph-mode recording: a channel's one-time setup and its rounds' recorded work (no poller, no pages)
    "graph_record": Group(8, ("graph_record.h", "graph_record.cc"),
                          only=frozenset({"channels.h", "graph_kernels.h", "graph_words.h", "tickets.h", "host_pool.h",
                                          "staging.h", "registry.h", "slot.h", "config.h", "vmm.h", "status.h",
                                          "driver.h"})),
    # graph mode's parts (DESIGN.md, "Engine parts"): what they share and the cells (pages, spares,
    # grants), under the poller's two halves (offload and reload rounds), under the part the engine sees
    "graph_cells": Group(8, ("graph_cells.h", "graph_cells.cc"),
                         only=frozenset({"ledger.h", "transfers.h", "channels.h", "graph_kernels.h", "graph_words.h",
                                         "round_host.h", "tickets.h", "host_pool.h", "staging.h", "registry.h",
                                         "slot.h", "config.h", "vmm.h", "status.h", "driver.h", "stat_fields.h"})),
    "graph_rounds": Group(9, ("graph_offload.h", "graph_offload.cc", "graph_reload.h", "graph_reload.cc"),
                          only=frozenset({"graph_cells.h", "graph_record.h", "ledger.h", "transfers.h", "channels.h",
                                          "graph_kernels.h", "graph_words.h", "round_host.h", "tickets.h",
                                          "host_pool.h", "staging.h", "registry.h", "slot.h", "config.h", "vmm.h",
                                          "status.h", "driver.h"})),
    "graph_mode": Group(10, ("graph_mode.h", "graph_mode.cc"),
                        only=frozenset({"graph_offload.h", "graph_reload.h", "graph_cells.h", "graph_record.h",
                                        "ledger.h", "transfers.h", "channels.h", "graph_kernels.h", "graph_words.h",
                                        "round_host.h", "tickets.h", "host_pool.h", "staging.h",
                                        "registry.h", "slot.h", "config.h", "vmm.h", "status.h", "driver.h"})),
    # the offload engine: owns the parts and hands each call to the part that serves it
    "engine": Group(11, ("engine.h", "engine.cc")),
    # capture and replay of engine work without XLA (tests): the driver seam only
    "replay": Group(5, ("replay.h", "replay.cc"), only=frozenset({"vmm.h", "status.h", "driver.h"})),
    "handlers": Group(12, ("handlers*.h", "handlers*.cc")),
    # the bindings (jaxvmm._jaxvmm), its test hooks (module_testing.cc) and what they share (module.h)
    "module": Group(13, ("module*.h", "module*.cc"), only=ANY),
}

# Files in ffi/ that are not code (no includes to check).
DOCS = ("*.md",)

# Who may include which external headers (matched against the include path).
NANOBIND_OK = ("module*.h", "module*.cc")
XLA_FFI_OK = ("handlers*.cc",)

INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)


# ---------------------------------------------------------------------------------------------------
# the checker
# ---------------------------------------------------------------------------------------------------
def strip_c_comments(text: str) -> str:
    """Removes // and /* */ comments (keeping newlines), leaving string and char literals alone."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def includes(text: str) -> list[tuple[str, str]]:
    """(delimiter, path) of every #include outside comments."""
    return INCLUDE_RE.findall(strip_c_comments(text))


def group_of(name: str) -> str | None:
    for group, g in LAYERS.items():
        if any(fnmatch.fnmatchcase(name, pat) for pat in g.files):
            return group
    return None


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def check_tree(files: dict[str, str]) -> list[str]:
    """Violations of the layering rules in ``files`` (name in ffi/ -> contents)."""
    problems: list[str] = []
    for name in sorted(files):
        if matches(name, DOCS):
            continue
        group = group_of(name)
        if group is None:
            problems.append(
                f"ffi/{name} is not in the layering table: add it to LAYERS in tests/test_layering.py")
            continue
        if not name.endswith((".h", ".cc")):
            problems.append(
                f"ffi/{name}: only .h and .cc files belong in ffi/ (or extend tests/test_layering.py)")
            continue
        g = LAYERS[group]
        for delim, path in includes(files[name]):
            where = f"ffi/{name} includes {delim}{path}{'>' if delim == '<' else delim}"
            base = path.rsplit("/", 1)[-1]
            if re.match(r"cuda_runtime", base):
                problems.append(f"{where}: the CUDA runtime is never used (driver API through the seam only)")
            if path.startswith("nanobind/") or base.startswith("nanobind"):
                if not matches(name, NANOBIND_OK):
                    problems.append(f"{where}: only module*.h/module*.cc may include nanobind")
                continue
            if path.startswith("xla/ffi"):
                if not matches(name, XLA_FFI_OK):
                    problems.append(f"{where}: only handlers*.cc may include the XLA FFI headers")
                continue
            if delim == "<":
                continue  # system, standard library, cuda.h / cudaTypedefs.h
            # a quoted include must be one of ours
            if "/" in path or (path not in files and group_of(path) is None):
                problems.append(f"{where}: not a file of ffi/ (quoted includes are for ffi/ headers)")
                continue
            if not path.endswith(".h"):
                problems.append(f"{where}: only headers may be included")
                continue
            target = group_of(path)
            if target is None:
                problems.append(f"{where}: ffi/{path} is not in the layering table")
                continue
            if path == name:
                problems.append(f"{where}: a file cannot include itself")
                continue
            own_group = target == group and name.endswith(".cc")
            if g.only is not None:
                ok = own_group or g.only == ANY or path in g.only
            else:
                ok = own_group or LAYERS[target].rank < g.rank
            if not ok:
                problems.append(
                    f"{where}: {group} (rank {g.rank}) may not depend on {target} "
                    f"(rank {LAYERS[target].rank}); the layering is driver -> status -> vmm -> slot -> "
                    "registry -> workers -> engine -> handlers -> module"
                )
    return problems


def strip_cmake_comments(text: str) -> str:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif c == "#":
            m = re.match(r"#\[(=*)\[", text[i:])
            if m:
                end = text.find("]" + m.group(1) + "]", i)
                end = n if end < 0 else end + len(m.group(1)) + 2
            else:
                end = text.find("\n", i)
                end = n if end < 0 else end
            out.append("\n" * text.count("\n", i, end))
            i = end
        else:
            out.append(c)
            i += 1
    return "".join(out)


CMAKE_FORBIDDEN = [
    (re.compile(r"CUDA::cuda_driver\b"), "CUDA::cuda_driver"),
    (re.compile(r"CUDA::cudart\w*"), "CUDA::cudart"),
    (re.compile(r"\bcudart\w*"), "cudart"),
    (re.compile(r"-lcuda\w*"), "-lcuda"),
    (re.compile(r"\blibcuda\w*\.(so|a)\b"), "libcuda"),
]
LINK_COMMAND_RE = re.compile(
    r"\b(target_link_libraries|link_libraries|target_link_options|find_library)\s*\(([^)]*)\)", re.IGNORECASE)


def check_cmake(text: str) -> list[str]:
    code = strip_cmake_comments(text)
    problems = [f"CMakeLists.txt links {what}: {m.group(0)!r}"
                for rx, what in CMAKE_FORBIDDEN for m in rx.finditer(code)]
    for m in LINK_COMMAND_RE.finditer(code):
        for token in m.group(2).split():
            if token.strip('"').lower() == "cuda":
                problems.append(f"CMakeLists.txt: {m.group(1)} names the CUDA driver library: {m.group(0)!r}")
    return problems


def ffi_files() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(FFI.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------------------
# the real tree
# ---------------------------------------------------------------------------------------------------
def test_ffi_include_graph_is_layered():
    files = ffi_files()
    assert "driver.h" in files and "module.cc" in files, "ffi/ not found where expected"
    problems = check_tree(files)
    assert not problems, "\n".join(problems)


def test_every_ffi_file_is_in_the_table():
    unknown = [n for n in ffi_files() if group_of(n) is None and not matches(n, DOCS)]
    assert not unknown, f"add these ffi/ files to LAYERS in tests/test_layering.py: {unknown}"


def test_import_jaxvmm_binds_no_test_hooks():
    """The test, replay, bench and fault hooks (ffi/module_testing.cc) are bound by jaxvmm.testing only."""
    proc = run_in_subprocess("import sys, jaxvmm\n"
                             "print('testing' in dir(jaxvmm), 'jaxvmm.testing' in sys.modules,\n"
                             "      hasattr(jaxvmm._native.lib, '_testing'))\n"
                             "import jaxvmm.testing\n"
                             "print(jaxvmm.testing.hooks is jaxvmm._native.lib._testing)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False", "True"], proc.stdout


def test_cmake_does_not_link_the_cuda_libraries():
    problems = check_cmake(CMAKE.read_text())
    assert not problems, "\n".join(problems)


def test_jax_internals_are_used_in_the_compat_module_only():
    """Every use of JAX's private modules (``jax._src``) is named in jaxvmm/_jax_compat.py, which says the
    JAX versions it is tested on; no other file of the package imports them."""
    package = ROOT / "jaxvmm"
    users = sorted(str(p.relative_to(ROOT)) for p in package.rglob("*.py")
                   if re.search(r"\bjax\._src\b|from jax import _src", p.read_text()))
    assert users == ["jaxvmm/_jax_compat.py"], users


def test_layering_of_the_table_itself():
    ranks = {name: LAYERS[name].rank for name in ("driver", "status", "vmm", "slot", "registry", "workers",
                                                   "engine", "handlers", "module")}
    assert list(ranks.values()) == sorted(ranks.values()) and len(set(ranks.values())) == len(ranks), ranks
    # every pattern belongs to exactly one group
    patterns = [p for g in LAYERS.values() for p in g.files]
    assert len(patterns) == len(set(patterns))


# ---------------------------------------------------------------------------------------------------
# the checker catches what it should (so the tests above can fail)
# ---------------------------------------------------------------------------------------------------
GOOD_TREE = {
    "driver.h": "#include <cuda.h>\n#include <cudaTypedefs.h>\n",
    "driver.cc": '#include "driver.h"\n#include <dlfcn.h>\n',
    "fault.h": '#include "driver.h"\n',
    "fault.cc": '#include "fault.h"\n#include "driver.h"\n',
    "status.h": '#include "driver.h"\n',
    "vmm.h": '#include "driver.h"\n#include "status.h"\n',
    "slot.h": '#include "vmm.h"\n',
    "registry.h": '#include "slot.h"\n',
    "registry.cc": ('#include "registry.h"\n// #include "module.cc" in a comment is fine\n'
                    "/* #include <nanobind/nanobind.h> */\n"),
    "bench.h": '#include "driver.h"\n#include "status.h"\n',
    "bench.cc": '#include "bench.h"\n#include "registry.h"\n#include "vmm.h"\n',
    "workers.h": '#include "registry.h"\n#include "fault.h"\n',
    "engine.h": '#include "host_pool.h"\n#include "registry.h"\n#include "workers.h"\n',
    "handlers.cc": '#include "engine.h"\n#include "xla/ffi/api/ffi.h"\n',
    "handlers_offload.cc": '#include "workers.h"\n#include <xla/ffi/api/api.h>\n',
    "module.cc": '#include <nanobind/nanobind.h>\n#include "bench.h"\n#include "handlers.h"\n',
    "handlers.h": '#include "workers.h"\n',
    "host_pool.h": '#include "status.h"\n',
    "host_pool.cc": '#include "host_pool.h"\n#include "vmm.h"\n',
    "DESIGN.md": '#include "module.cc" (prose is not checked)\n',
}


def test_checker_accepts_a_good_tree():
    assert check_tree(GOOD_TREE) == []


@pytest.mark.parametrize(
    "name, text, expect",
    [
        ("status.h", '#include "slot.h"\n', "may not depend on slot"),
        ("driver.h", '#include "status.h"\n', "may not depend on status"),
        ("driver.h", '#include "fault.h"\n', "may not depend on fault"),
        ("fault.h", '#include "status.h"\n', "may not depend on status"),
        ("vmm.h", '#include "registry.h"\n', "may not depend on registry"),
        ("registry.h", '#include "workers.h"\n', "may not depend on workers"),
        ("workers.h", '#include "handlers.h"\n', "may not depend on handlers"),
        ("workers.h", '#include "engine.h"\n', "may not depend on engine"),
        ("engine.h", '#include "handlers.h"\n', "may not depend on handlers"),
        ("staging.h", '#include "engine.h"\n', "may not depend on engine"),
        ("staging.cc", '#include "tickets.h"\n', "may not depend on tickets"),
        ("staging.h", '#include "worker.h"\n', "staging"),
        ("tickets.h", '#include "engine.h"\n', "may not depend on engine"),
        ("tickets.cc", '#include "worker.h"\n', "tickets"),
        ("engine.h", '#include "xla/ffi/api/ffi.h"\n', "only handlers*.cc"),
        ("workers.h", '#include "bench.h"\n', "may not depend on bench"),
        ("host_pool.h", '#include "slot.h"\n', "may not depend on slot"),
        ("slot.h", '#include "host_pool.h"\n', "may not depend on host_pool"),
        ("bench.cc", '#include "workers.h"\n', "may not depend on workers"),
        ("slot.h", '  #  include "registry.h"\n', "may not depend on registry"),
        ("vmm.cc", "#include <nanobind/nanobind.h>\n", "only module*.h/module*.cc may include nanobind"),
        ("handlers.cc", "#include <nanobind/stl/string.h>\n", "only module*.h/module*.cc may include nanobind"),
        ("slot.cc", '#include "xla/ffi/api/ffi.h"\n', "only handlers*.cc"),
        ("handlers.h", '#include "xla/ffi/api/ffi.h"\n', "only handlers*.cc"),
        ("registry.h", "#include <cuda_runtime_api.h>\n", "CUDA runtime"),
        ("module.cc", '#include "cuda_runtime.h"\n', "CUDA runtime"),
        ("slot.cc", '#include "nope.h"\n', "not a file of ffi/"),
        ("slot.cc", '#include "registry.cc"\n', "only headers"),
        ("mystery.cc", '#include "driver.h"\n', "not in the layering table"),
        ("notes.txt", "", "not in the layering table"),
    ],
)
def test_checker_rejects(name, text, expect):
    tree = dict(GOOD_TREE)
    tree[name] = tree.get(name, "") + text
    problems = check_tree(tree)
    assert any(expect in p for p in problems), problems


def test_checker_unknown_file_message_says_how_to_fix():
    (problem,) = check_tree({**GOOD_TREE, "memory_pool.h": '#include "driver.h"\n'})
    assert "ffi/memory_pool.h" in problem and "add it to LAYERS" in problem


@pytest.mark.parametrize(
    "snippet",
    [
        "target_link_libraries(jaxvmm_core PUBLIC CUDA::cuda_driver)",
        "target_link_libraries(jaxvmm_core PUBLIC CUDA::cudart)",
        "target_link_libraries(_jaxvmm PRIVATE cudart_static)",
        'target_link_options(_jaxvmm PRIVATE "-lcuda")',
        "target_link_libraries(_jaxvmm PRIVATE cuda)",
        "link_libraries(/usr/lib/x86_64-linux-gnu/libcuda.so)",
    ],
)
def test_cmake_checker_rejects(snippet):
    good = CMAKE.read_text()
    assert check_cmake(good) == []
    assert check_cmake(good + "\n" + snippet + "\n")


def test_cmake_checker_ignores_comments():
    text = '# never link libcudart or -lcuda\n#[[ CUDA::cuda_driver ]]\nmessage(STATUS "#not a comment")\n'
    assert check_cmake(text) == []
    assert check_cmake('message(STATUS "x") # fine\ntarget_link_libraries(x cudart) # bad\n')


# ---- the Python package: no import circle ----
PKG = ROOT / "jaxvmm"


def python_imports(path: pathlib.Path, package: str) -> set[str]:
    """The jaxvmm modules ``path`` imports (at module level or inside functions: a lazy import that
    closes a circle is still a circle), as dotted names."""
    import ast

    here = package.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                found.add(mod)
            else:  # from . import x, y: each may be a module of that package
                found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxvmm"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("jaxvmm"))
    return found


def python_graph(pkg: pathlib.Path = PKG) -> dict[str, set[str]]:
    modules = {}
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = name if rel.name == "__init__" else name.rsplit(".", 1)[0]
        modules[name] = (path, package)
    return {name: {m for m in python_imports(path, package) if m in modules and m != name}
            for name, (path, package) in modules.items()}


def python_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle among the package's modules (the package's __init__ excepted as a target:
    importing a submodule runs it first, but a submodule importing its own package is what a circle
    through __init__ looks like, and that is counted)."""
    cycles, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return cycles


def test_python_package_has_no_import_circle():
    assert python_cycles(python_graph()) == []


def test_python_cycle_checker_finds_a_lazy_circle(tmp_path):
    pkg = tmp_path / "jaxvmm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    assert python_cycles(python_graph(pkg)) == [["jaxvmm.a", "jaxvmm.b", "jaxvmm.a"]]
