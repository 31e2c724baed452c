"""Device time of graph-mode rounds (a take kernel, a copy kernel, a publish kernel; on sm_90 and later
the copy and the publish are launched early), measured in one process without XLA.

    python bench/graph_rounds.py                      # 64 offload rounds of 1 MiB per replay, 30 replays
    python bench/graph_rounds.py --rounds 128 --size 256K --reps 50

One graph (``jaxvmm.testing.Replay``) holds ``rounds`` offload rounds, each of its own call site (a
channel of K = 2 cells, so every round takes a grant armed ahead of time and never waits for the host
or for a copy). Each replay is timed from launch to the end of its stream, after a pause that lets the
poller arm every cell again. Reports the median time per round and how many rounds had to wait for the
host (should be 0). On cpu (the POSIX backend) it runs too, as a smoke test; the numbers mean nothing
there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jaxvmm  # noqa: E402
from jaxvmm._devices import target_of  # noqa: E402
from jaxvmm._native import lib  # noqa: E402
from jaxvmm.testing import Replay  # noqa: E402

from _common import parse_size  # noqa: E402  (bench/ is on sys.path when run as a script)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="jaxvmm device (default: cuda:0 if jax has a GPU, else cpu)")
    ap.add_argument("--rounds", type=int, default=64, help="offload rounds per replay (one call site each)")
    ap.add_argument("--size", default="1M", help="bytes per round (default 1M)")
    ap.add_argument("--reps", type=int, default=30, help="timed replays")
    ap.add_argument("--pause-ms", type=float, default=5.0, help="pause before each replay (the poller re-arms)")
    args = ap.parse_args()
    if args.device is None:
        import jax
        args.device = "cuda:0" if any(d.platform == "gpu" for d in jax.devices()) else "cpu"
    n = parse_size(args.size)
    t = target_of(args.device)
    assert jaxvmm.configure()["graph_cells"] >= 2, "needs K >= 2 cells per call site (JAXVMM_GRAPH_CELLS)"
    x = jaxvmm.Slot(n, device=args.device)
    toks = [jaxvmm.Slot(8, device=args.device) for _ in range(args.rounds)]
    sites = [(1 << 44) + i for i in range(args.rounds)]
    st = lambda: (jaxvmm.synchronize(), lib.engine(t.backend, t.ordinal).stats())[1]
    try:
        with Replay(args.device) as r:
            for s in sites:  # the first loads and warms the kernels
                r.prepare(s, r.OFFLOAD, n)
            before = st()
            with r.capture() as g:
                for s, tok in zip(sites, toks):
                    r.offload(s, x.address, n, tok.address)
            after = st()
            early = bool(after["graph_early_launch"])
            assert after["graph_early_captures"] - before["graph_early_captures"] == (args.rounds if early else 0)
            for _ in range(2):  # the first replay knocks; then every cell is armed
                r.launch(g[0])
                r.synchronize()
                st()
                time.sleep(args.pause_ms / 1e3)
            times, waited = [], 0
            for i in range(args.reps):
                b = st()
                time.sleep(args.pause_ms / 1e3)
                t0 = time.perf_counter()
                r.launch(g[0])
                r.synchronize()
                times.append(time.perf_counter() - t0)
                waited += st()["graph_grants_host"] - b["graph_grants_host"]
                if i % 8 == 7:
                    jaxvmm.collect()  # the rounds' tickets (no reload takes them)
    finally:
        jaxvmm.collect()
    print(f"device {args.device}, {args.rounds} offload rounds of {n} bytes per replay, {args.reps} replays")
    print("| rounds | median replay | per round | rounds that waited for the host |")
    print("|---|---|---|---|")
    med = statistics.median(times)
    launch = "early launches" if early else "plain launches"
    print(f"| {launch} | {med * 1e6:.1f} us | {med * 1e6 / args.rounds:.2f} us | {waited} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
