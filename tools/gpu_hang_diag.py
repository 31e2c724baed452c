"""GPU diagnostic for the storm hang (fwd offloads 32 x 64 MiB in a captured scan; bwd, called right after
without a block, reloads them). Each experiment runs in its own subprocess with a time limit and reports
PASS or HANG; on a hang the native stacks of every thread are written to $OUT/stacks_<name>.txt (gdb,
eu-stack or py-spy, whichever exists) and the frames that matter are printed.

The hypothesis it tests (ffi/DESIGN.md, "Graph mode", limits): loading a CUDA module (XLA does it on the
first run of every executable, GpuExecutable::ResolveConstantGlobals -> LoadModule) or lazily loading a
kernel on its first launch waits for the device to drain *while holding the context's lock*. The device
cannot drain: fwd's remaining rounds wait for grants only the poller writes, and the poller's next CUDA
call (cuStreamWriteValue64, cuMemcpyDtoHAsync, cuEventRecord/Query, cuMemHostAlloc) queues behind that
lock, with GraphMode::mu_ held (so engine_stats() hangs too).

    python3 tools/gpu_hang_diag.py [names...]     (default: all, in the order below)

With jaxvmm's fix (jaxvmm/_module_loads.py: every backend compile waits for the device once call sites
were captured; the grant kernels are warmed at the first initialize stage):
  storm                  fwd then bwd without a block (the reported hang): expect PASS
  fresh_jit              fwd (no block), then a *new* unrelated jit: expect PASS
With the module-load barrier taken out (DIAG_NO_BARRIER=1), the hypothesis says:
  storm_nobarrier        expect HANG (the reported bug)
  fresh_jit_nobarrier    expect HANG (no reload, no capture of ours: any first run behind pending rounds)
  warm_bwd_nobarrier     both executables loaded by a blocked pair first, then fwd + bwd unblocked: expect PASS
  eager_nobarrier        CUDA_MODULE_LOADING=EAGER: expect HANG (a module load, not a lazy kernel load)
  host_grants_nobarrier  JAXVMM_GRAPH_KERNELS=0 (no jaxvmm kernels at all): expect HANG
"""
import os
import shutil
import subprocess
import sys
import textwrap
import time

LIMIT = float(os.environ.get("DIAG_LIMIT", "40"))
OUT = os.environ.get("OUT", "out")

PRELUDE = textwrap.dedent("""
    import os, sys, threading, time, faulthandler
    import jax, jax.numpy as jnp
    from jax import lax
    import jaxvmm
    print("PID", os.getpid(), flush=True)
    try:  # let the parent's gdb/eu-stack attach under kernel.yama.ptrace_scope=1 (PR_SET_PTRACER, ANY)
        import ctypes
        ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)
    except Exception:
        pass
    jaxvmm.configure(prefetch_depth=2)
    KEYS = ("offloads", "reloads", "graph_captures", "graph_offload_rounds", "graph_reload_rounds",
            "graph_prepares", "handler_calls", "seq_issued", "seq_completed", "errors", "graph_kernels")
    def show(tag):
        s = jaxvmm.engine_stats().get("cuda:0", {})
        print(f"{tag}:", {k: s.get(k) for k in KEYS}, flush=True)
    def watchdog(after):
        def run():
            time.sleep(after)
            print("child watchdog: stuck; python stacks:", flush=True)
            faulthandler.dump_traceback(all_threads=True)
            t = threading.Thread(target=lambda: show("stats (late)"), daemon=True)
            t.start(); t.join(5)
            if t.is_alive(): print("engine_stats() blocked too (an engine lock is held)", flush=True)
        threading.Thread(target=run, daemon=True).start()
    watchdog(float(os.environ.get("CHILD_WATCHDOG", "20")))
    if os.environ.get("DIAG_NO_BARRIER") == "1":
        # Take jaxvmm's module-load barrier out (jaxvmm/_module_loads.py) to see the bare behaviour.
        try:
            from jax._src import monitoring as _mon
            from jaxvmm import _module_loads
            _mon._event_duration_secs_listeners.remove(_module_loads._on_duration)
            print("module-load barrier removed", flush=True)
        except Exception as e:
            print("RESULT INVALID: could not remove the module-load barrier:", repr(e), flush=True)
            sys.exit(2)
    n = int(os.environ.get("DIAG_N", 16 << 20))  # 64 MiB of float32 per offload
    h = jnp.ones((n,), jnp.float32)
    fwd = jax.jit(lambda h: lax.scan(lambda h, _: (h + 1, jaxvmm.offload(h)), h, None, length=32)[1])
    bwd = jax.jit(lambda ts: lax.scan(lambda c, t: (c + jaxvmm.reload(t)[0], None), 0.0, ts, reverse=True)[0])
    WANT = float(sum(range(1, 33)))
""")

BARE_PRELUDE = (PRELUDE.split("jaxvmm.configure(prefetch_depth=2)")[0].replace("import jax, jax.numpy as jnp", "import jax")
                + PRELUDE[PRELUDE.index("KEYS = "):PRELUDE.index('if os.environ.get("DIAG_NO_BARRIER")')])
# Bodies run under several environments (with and without the barrier, ...).
# fwd, then bwd right behind it without a block (the reported hang).
STORM = """
        ts = fwd(h)
        show("after fwd (no block)")
        total = bwd(ts)
        print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
    """
# fwd (no block), then a new unrelated program: its module is loaded while fwd's rounds are pending.
FRESH_JIT = """
        ts = fwd(h)
        show("after fwd (no block)")
        y = jax.jit(lambda x: x * 3.0 + 1.0)(h)   # a new executable: its module is loaded now
        show("after the fresh jit was enqueued")
        print("fresh", float(y[0]), flush=True)
        jax.block_until_ready(ts)
        print("RESULT PASS", flush=True)
    """
# The storm test's exact sequence (tests/test_engine.py).
STORM3 = """
    for i in range(2):
        total = bwd(fwd(h))
        show(f"{i}: after bwd (no block)")
    print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
"""
NB = {"DIAG_NO_BARRIER": "1"}
BARE = {"DIAG_BARE": "1"}  # a minimal prelude: jax is not initialized before the body runs
EXPERIMENTS = {
    # tests/test_graph.py::test_cells_of_a_site_never_captured_go_back_when_idle (engine entry points
    # before jax initializes; no capture, no round)
    "never_captured": (BARE, """
        from jaxvmm.testing import Replay
        from jaxvmm._native import lib
        jaxvmm.configure(staging_idle_ms=50)
        def mapped(tag):
            print(tag, "synchronize...", flush=True); jaxvmm.synchronize()
            print(tag, "stats...", flush=True); s = lib.engine("cuda", 0).stats()
            print(tag, {k: s[k] for k in ("graph_mapped_bytes", "graph_kernels", "graph_channels")}, flush=True)
            return s["graph_mapped_bytes"]
        with Replay("cuda:0") as r:
            print("prepare offload", flush=True); r.prepare(1 << 40, r.OFFLOAD, 12388)
            print("prepare reload", flush=True); r.prepare((1 << 40) + 1, r.RELOAD, 12388)
            assert mapped("first") > 0
            deadline = time.monotonic() + 10
            while mapped("poll") and time.monotonic() < deadline:
                time.sleep(0.2)
            print("RESULT", "PASS" if mapped("last") == 0 else "FAIL still mapped", flush=True)
    """),
    # tests/test_engine.py::test_gpu_idle_engine_returns_staging_pages_to_the_driver
    "idle_engine": (BARE, """
        import jax.numpy as jnp
        jaxvmm.configure(staging_idle_ms=1000)
        x = jnp.arange(64 << 20, dtype=jnp.float32)
        step = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)))
        for i in range(3):
            y = step(x); print("step", i, flush=True)
        print("equal", bool(jnp.array_equal(y, x)), flush=True)
        jaxvmm.synchronize(); show("after synchronize")
        s = jaxvmm.engine_stats()["cuda:0"]
        print({k: v for k, v in s.items() if "staging" in k or "graph" in k}, flush=True)
        deadline = time.time() + 10
        while jaxvmm.engine_stats()["cuda:0"]["staging_mapped_bytes"] and time.time() < deadline:
            time.sleep(0.05)
        s = jaxvmm.engine_stats()["cuda:0"]
        print({k: v for k, v in s.items() if "staging" in k or "graph" in k}, flush=True)
        print("RESULT", "PASS" if s["staging_mapped_bytes"] == 0 else "FAIL still mapped", flush=True)
    """),
    "storm": ({}, STORM),
    # tests/test_engine.py::test_gpu_offload_storm_stays_within_depth_cells: the pair twice (XLA records
    # its command buffers on a program's second run)
    "storm2": ({}, """
        for i in range(2):
            ts = fwd(h)
            show(f"{i}: after fwd (no block)")
            total = bwd(ts)
            show(f"{i}: after bwd (no block)")
            print(i, "total", float(total), flush=True)
        print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
    """),
    "storm2_nobarrier": (NB, """
        for i in range(2):
            ts = fwd(h)
            total = bwd(ts)
            show(f"{i}: after bwd (no block)")
            print(i, "total", float(total), flush=True)
        print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
    """),
    # the test itself: iteration 2's fwd (its first command-buffer recording) is enqueued while
    # iteration 1's bwd (first run: ring path, no capture) still waits for its reloads
    "storm3": ({}, STORM3),
    "storm3_eager": ({"CUDA_MODULE_LOADING": "EAGER"}, STORM3),
    "storm3_nograph": ({"JAXVMM_GRAPH": "0"}, STORM3),
    "fresh_jit": ({}, FRESH_JIT),
    "storm_nobarrier": ({"DIAG_NO_BARRIER": "1"}, STORM),
    "fresh_jit_nobarrier": ({"DIAG_NO_BARRIER": "1"}, FRESH_JIT),
    "warm_bwd_nobarrier": ({"DIAG_NO_BARRIER": "1"}, """
        ts = fwd(h); jax.block_until_ready(ts)
        assert float(bwd(ts)) == WANT
        jaxvmm.synchronize()
        show("after the blocked warm-up pair")
        ts = fwd(h)
        total = bwd(ts)
        show("after fwd + bwd enqueued (no block)")
        print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
    """),
    "eager_nobarrier": ({"CUDA_MODULE_LOADING": "EAGER", "DIAG_NO_BARRIER": "1"}, """
        ts = fwd(h)
        total = bwd(ts)
        print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
    """),
    "host_grants_nobarrier": ({"JAXVMM_GRAPH_KERNELS": "0", "DIAG_NO_BARRIER": "1"}, """
        ts = fwd(h)
        total = bwd(ts)
        show("after")
        print("RESULT", "PASS" if float(total) == WANT else f"WRONG {float(total)}", flush=True)
    """),
}

INTERESTING = ("libcuda", "jaxvmm", "Engine", "xla::", "stream_executor", "LoadModule", "ModuleLoad", "LibraryLoad",
               "pthread_mutex", "__lll_lock_wait", "futex_wait", "condition_variable", "nanosleep", "sched_yield")


def native_stacks(pid: int) -> str:
    for cmd in (["gdb", "-p", str(pid), "-batch", "-ex", "set pagination off", "-ex", "thread apply all bt 30"],
                ["eu-stack", "-p", str(pid)],
                ["py-spy", "dump", "--native", "--pid", str(pid)]):
        if shutil.which(cmd[0]):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                return f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr[-2000:]}"
            except Exception as e:  # noqa: BLE001  (diagnostics only)
                return f"{cmd[0]} failed: {e}"
    lines = ["no gdb/eu-stack/py-spy; per-thread kernel wait channels:"]
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            wchan = open(f"/proc/{pid}/task/{tid}/wchan").read().strip()
            lines.append(f"  {tid} {comm:20s} {wchan}")
        except OSError:
            pass
    return "\n".join(lines)


def summarize(stacks: str) -> str:
    # Keep, per thread, its header and the frames naming CUDA, jaxvmm or XLA's load/execute path.
    out, keep = [], []
    for line in stacks.splitlines():
        if line.startswith("Thread ") or line.startswith("TID ") or line.startswith("Thread 0x"):
            if keep:
                out.extend(keep[:14])
            keep = [line]
        elif line.lstrip().startswith("#") and any(k in line for k in INTERESTING):
            keep.append("    " + line.strip()[:220])
    if keep:
        out.extend(keep[:14])
    return "\n".join(out[:400])


def run(name: str) -> str:
    env_extra, body = EXPERIMENTS[name]
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               CHILD_WATCHDOG=str(LIMIT - 15), **env_extra)
    code = (BARE_PRELUDE if env_extra.get("DIAG_BARE") else PRELUDE) + textwrap.dedent(body)
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-P", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out, _ = p.communicate(timeout=LIMIT)
        verdict = "PASS" if "RESULT PASS" in out else ("FAIL rc=%d" % p.returncode)
    except subprocess.TimeoutExpired:
        stacks = native_stacks(p.pid)
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, f"stacks_{name}.txt"), "w") as f:
            f.write(stacks)
        p.kill()
        out, _ = p.communicate()
        verdict = "HANG"
        out += "\n--- native stacks (filtered; full text in $OUT/stacks_%s.txt) ---\n%s" % (name, summarize(stacks))
    dt = time.monotonic() - t0
    tail = "\n".join(l for l in out.splitlines() if "site-packages" not in l or "jaxvmm" in l)[-6000:]
    return f"===== {name} ({', '.join(f'{k}={v}' for k, v in env_extra.items()) or 'default env'}): {verdict} in {dt:.1f} s\n{tail}\n"


if __name__ == "__main__":
    names = sys.argv[1:] or list(EXPERIMENTS)
    verdicts = []
    for n in names:
        text = run(n)
        print(text, flush=True)
        verdicts.append(text.splitlines()[0])
    print("\n".join(["SUMMARY"] + verdicts))
