"""Graph-mode rounds of large arrays (the pageable-fallback test's shape) under variants, reporting for
each wrong reload where its bytes differ and whose bytes they are. Usage (one variant per process):

    python3 -P tools/probe_reload_race.py [--device cuda:0] [--n 8M] [--rounds 40] [--fault] [--forward]

The environment picks the variant (JAXVMM_GRAPH_CELLS, JAXVMM_DEBUG_PREDICT, JAXVMM_GRAPH_FUSED)."""
import argparse
import itertools
import sys

import numpy as np

import jaxvmm
from jaxvmm._devices import target_of
from jaxvmm._native import lib
from jaxvmm.testing import Replay

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda:0")
p.add_argument("--n", default="8M")
p.add_argument("--rounds", type=int, default=40)
p.add_argument("--fault", action="store_true", help="every cuMemHostAlloc fails (pageable fallback)")
p.add_argument("--forward", action="store_true", help="reload oldest first")
a = p.parse_args()
n = int(a.n[:-1]) << {"K": 10, "M": 20}[a.n[-1]] if a.n[-1] in "KM" else int(a.n)
sites = itertools.count(1 << 41)
data = lambda i: np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)  # noqa: E731
x, y, tok = (jaxvmm.Slot(s, device=a.device) for s in (n, n, 8))
t = target_of(a.device)
bad = []
with Replay(a.device) as r:
    off, rel = next(sites), next(sites)
    r.prepare(off, r.OFFLOAD, n)
    r.prepare(rel, r.RELOAD, n)
    with r.capture() as fwd:
        r.offload(off, x.address, n, tok.address)
    with r.capture() as bwd:
        r.reload(rel, tok.address, y.address, n)
    ctx = jaxvmm.testing.fault("cuMemHostAlloc", times=-1, device=a.device) if a.fault else None
    if ctx:
        ctx.__enter__()
    tokens = []
    for i in range(a.rounds):
        x.write(data(i))
        r.launch(fwd[0])
        r.synchronize()
        tokens.append(bytes(tok.read()))
    order = range(a.rounds) if a.forward else reversed(range(a.rounds))
    for i in order:
        tok.write(np.frombuffer(tokens[i], np.uint8))
        r.launch(bwd[0])
        r.synchronize()
        got, want = np.frombuffer(bytes(y.read()), np.uint8), data(i)
        if not np.array_equal(got, want):
            diff = np.nonzero(got != want)[0]
            owners = {}
            for j in range(a.rounds):
                if j != i:
                    m = np.count_nonzero(got[diff] == data(j)[diff])
                    if m > len(diff) // 2:
                        owners[j] = m
            bad.append(i)
            print(f"ticket {i}: {len(diff)} bytes differ, first {diff[0]} last {diff[-1]}, "
                  f"contiguous={diff[-1] - diff[0] + 1 == len(diff)}, mostly from tickets {owners}")
    if ctx:
        ctx.__exit__(None, None, None)
    jaxvmm.synchronize()
s = lib.engine_stats(t.backend, t.ordinal)
keys = ("graph_host_fallbacks", "graph_bounce_copies", "graph_hits", "graph_misses", "errors", "tickets_live")
print("RESULT", "bad=%d/%d" % (len(bad), a.rounds), {k: s.get(k) for k in keys})
sys.exit(0)
