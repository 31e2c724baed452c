"""JAX's own ``jax.checkpoint`` tests (``RematTest`` in JAX's ``tests/api_test.py``) with ``jax.checkpoint``
and ``jax.remat`` replaced by ``jaxvmm.checkpoint`` (docs/remat.md, *JAX's own remat tests*).

    python3 tools/remat_test.py --api-test /path/to/jax/tests/api_test.py            # the tests' own policies
    python3 tools/remat_test.py --api-test /path/to/jax/tests/api_test.py --forced   # every saved value offloaded

``--forced`` turns every policy answer that saves (``True``/``Saveable``) into ``Offloadable`` and a
missing policy into ``jaxvmm.policies.offload_everything_saveable(min_bytes=0)``, so that what the tests
save goes through jaxvmm. ``--values`` (with ``--forced``) also turns off the assertions that say *how*
a value is obtained, recomputed rather than saved (`` sin ``/`` cos `` in a backward jaxpr, evaluation
counts, the residual log of a policy-less checkpoint, the name stack count; from JAX 0.11, the count of
XLA's host memory space in a jaxpr), so that the value checks
after them (``check_grads`` of order 2 among them) run too. The file is written to ``--out`` (default: a temporary directory) and run with
pytest; arguments after ``--`` go to pytest. Needs absl-py (JAX's test utilities import it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

FORCING = '''
import jaxvmm
from jax._src.interpreters.partial_eval import Offloadable as _Off, Saveable as _Sav
_real_ckpt = jaxvmm.checkpoint
def _offloading(policy):
    if policy is None:
        return jaxvmm.policies.offload_everything_saveable(min_bytes=0)
    def p(prim, *a, **k):
        r = policy(prim, *a, **k)
        return _Off("device", "pinned_host") if (r is True or r is _Sav) else r
    return p
def _vmm_ckpt(fun=None, *, policy=None, **kw):
    return _real_ckpt(fun, policy=_offloading(policy), **kw)
class _NS: pass
_vmm = _NS(); _vmm.checkpoint = _vmm_ckpt; _vmm.policies = jaxvmm.policies
'''


# --values: an assertion about recomputation -> a call that checks nothing (the arguments still run)
_NOOP = "(lambda *a, **k: None)("
STRUCTURE = [
    (r"self\.assert(?:Not)?In\((' (?:sin|cos) ')", _NOOP + r"\1"),
    (r"self\.assert(?:Not)?In\(substr, jaxpr_text\)", _NOOP + "substr, jaxpr_text)"),
    (r"self\.assertEqual\(len\((sin|cos)_calls\)", _NOOP + r"len(\1_calls)"),
    (r"assert num_evals - start == n\b", "pass"),
    (r"self\.assertEqual\(s\.count\('rematted_computation'\), 1\)", "pass"),
    (r"self\.assertTrue\(any\('remat-decorated function saving inputs", _NOOP + "any('remat-decorated function saving inputs"),
    (r"self\.assertFalse\(any\('intermediates'", _NOOP + "any('intermediates'"),
    # JAX >= 0.11: XLA's own offload (device_put to MemorySpace.Host) in the jaxpr; jaxvmm offloads instead
    (r"self\.assertEqual\(jaxpr_text\.count\('MemorySpace\.", _NOOP + "jaxpr_text.count('MemorySpace."),
    (r"self\.assertIn\('<host>", _NOOP + "'<host>"),
]


def values_only(body: str) -> str:
    for pat, rep in STRUCTURE:
        body, n = re.subn(pat, rep, body)
        if not n:
            print(f"--values: no match for {pat!r} (a different api_test.py?)", file=sys.stderr)
    return body


def extract(src: str, forced: bool, values: bool = False) -> str:
    lines = src.splitlines(keepends=True)
    start = next(i for i, l in enumerate(lines) if l.startswith("class RematTest("))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("class "))
    while end > start and lines[end - 1].startswith("@"):  # the next class's decorators
        end -= 1
    first_class = next(i for i, l in enumerate(lines) if l.startswith("class "))
    head = "".join(lines[:first_class])
    body = "".join(lines[start:end])
    main = "".join(lines[next(i for i, l in enumerate(lines) if l.startswith("if __name__")):])
    name = "_vmm.checkpoint" if forced else "jaxvmm.checkpoint"
    body = re.sub(r"\bjax\.(?:remat|checkpoint)\b(?!_)", name, body)
    if values:
        body = values_only(body)
    prelude = FORCING if forced else "\nimport jaxvmm\n"
    return head + prelude + body + "\n" + main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api-test", required=True, help="JAX's tests/api_test.py (same version as the jax installed)")
    ap.add_argument("--forced", action="store_true", help="offload every value the tests save")
    ap.add_argument("--values", action="store_true",
                    help="turn off the assertions that a value is recomputed (not saved), keep the value checks")
    ap.add_argument("--out", default=None, help="where to write the test file (default: a temporary directory)")
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    with open(a.api_test) as f:
        text = extract(f.read(), a.forced, a.values)
    out = a.out or tempfile.mkdtemp(prefix="jaxvmm_remattest_")
    path = os.path.join(out, ("test_jax_remat_offload" if a.forced else "test_jax_remat")
                        + ("_values" * a.values) + ".py")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", flush=True)
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, *a.pytest_args])


if __name__ == "__main__":
    sys.exit(main())
