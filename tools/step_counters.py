"""Which graph-mode rounds of a step wait for the poller (GPU): bench/train_step.py's MLP-scan row
(`--shape B,D,L`, default the 1 MiB row 256,512,64) with jaxvmm, and per step the engine counters that
changed. With --watch, a thread samples engine_stats() as fast as it can through one step and prints
each change of the host-granted rounds and misses with the offload and reload rounds served by then
(which round of the step it was).

    python tools/step_counters.py --steps 6 --watch
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

KEYS = ("graph_grants_host", "graph_misses", "graph_offload_rounds", "graph_reload_rounds", "graph_revokes",
        "graph_offload_cell_reads")


def device_stats(jaxvmm) -> dict:
    st = jaxvmm.engine_stats()
    return next(iter(v for k, v in st.items() if not k.startswith("cpu")), {}) if st else {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="256,512,64")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--watch", action="store_true")
    args = ap.parse_args()
    import jax

    import jaxvmm
    import train_step as ts

    s = ts.shapes_for("mlp", False, None, args.shape)
    step = ts.build_step("mlp", "mlp_hidden", "jaxvmm", s, "auto")
    params, x = ts.init_arrays("mlp", s)
    prev = device_stats(jaxvmm)
    for i in range(args.steps):
        watch = args.watch and i == args.steps - 1
        seen, stop = [], threading.Event()
        base = {k: prev.get(k, 0) for k in KEYS}

        def sample() -> None:
            last = None
            t0 = time.perf_counter()
            while not stop.is_set():
                d = device_stats(jaxvmm)
                cur = tuple(d.get(k, 0) - base[k] for k in KEYS)
                if last is None or cur[:2] != last[:2]:
                    seen.append((time.perf_counter() - t0, cur))
                last = cur

        th = threading.Thread(target=sample) if watch else None
        if th:
            th.start()
        loss, params = step(params, x)
        jax.block_until_ready((loss, params))
        jaxvmm.synchronize()
        if th:
            stop.set()
            th.join()
        cur = device_stats(jaxvmm)
        delta = {k: cur[k] - prev.get(k, 0) for k in cur
                 if isinstance(cur[k], (int, float)) and not isinstance(cur[k], bool) and cur[k] != prev.get(k, 0)}
        print(f"step {i}: " + ", ".join(f"{k}={v:+}" for k, v in sorted(delta.items())
                                       if k.startswith(("graph_", "staging_pages", "staging_direct", "misses", "hits"))))
        for t, c in seen:
            print(f"   {t * 1e3:8.3f} ms  " + "  ".join(f"{k.removeprefix('graph_')}={v}" for k, v in zip(KEYS, c)))
        prev = cur
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
