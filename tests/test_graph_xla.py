"""Graph mode under XLA on a GPU: the offload and remat paths in every command-buffer mode.

Each mode runs in a fresh process (XLA reads its flags once). The program is a layer scan trained for
a few steps under ``jaxvmm.checkpoint`` (offloading the hidden activation), plus an eager
offload/reload round trip across jit calls; values must equal ``jax.checkpoint``'s bit for bit. Where
XLA captures the calls, ``engine_stats()`` shows it: recordings (``graph_captures``) are few, rounds
many, and the ring path (``offloads`` through execute) is not used for them.
"""

from __future__ import annotations

import os
import json
import pathlib
import tempfile
import textwrap

import pytest

from conftest import run_in_subprocess

pytestmark = pytest.mark.gpu


def _train_prelude(L: int, STEPS: int, B: int = 256, D: int = 512) -> str:
    """A subprocess script's start: an L-layer scan of checkpointed tanh/gelu layers (B x D, f32)
    and train(ckpt), STEPS SGD steps of its jitted value_and_grad -> (losses, final weights)."""
    return textwrap.dedent(f"""
    import json, jax, jax.numpy as jnp, numpy as np, jaxvmm
    from jax.ad_checkpoint import checkpoint_name
    P = jaxvmm.policies
    L, B, D, STEPS = {L}, {B}, {D}, {STEPS}

    def layer(h, w):
        return jnp.tanh(checkpoint_name(jax.nn.gelu(h @ w), "hidden") @ w.T)

    def loss(ws, x, ckpt):
        f = ckpt(layer)
        h, _ = jax.lax.scan(lambda h, w: (f(h, w), None), x, ws)
        return jnp.sum(h * h)

    def train(ckpt):
        step = jax.jit(lambda ws, x: jax.value_and_grad(loss)(ws, x, ckpt))
        ws = jax.random.normal(jax.random.key(0), (L, D, D), jnp.float32) / D ** 0.5
        x = jax.random.normal(jax.random.key(1), (B, D), jnp.float32)
        out = []
        for i in range(STEPS):
            l, g = step(ws, x)
            ws = ws - 0.01 * g
            out.append(float(l))
        return out, np.asarray(ws)

    def REF(f):
        return jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("hidden"))

    def VMM(f):
        return jaxvmm.checkpoint(f, policy=P.offload_only_these_names("hidden"))

    def against(ref):  # trains under jaxvmm (VMM): equality with `ref` (losses, weights), the stat deltas
        ref_l, ref_w = ref
        before = jaxvmm.engine_stats().get("cuda:0", {{}})
        got_l, got_w = train(VMM)
        jaxvmm.synchronize()
        jaxvmm.check()
        s = jaxvmm.engine_stats()["cuda:0"]
        d = {{k: v - before.get(k, 0) for k, v in s.items() if isinstance(v, int)}}
        return dict(losses_equal=ref_l == got_l, weights_equal=bool(np.array_equal(ref_w, got_w)),
                    max_weight_diff=float(np.max(np.abs(ref_w - got_w))), stats=d, tickets_live=s["tickets_live"])
    """)


SCRIPT = _train_prelude(L=6, STEPS=12) + textwrap.dedent("""

    ref_l, ref_w = train(lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("hidden")))
    ref2_l, _ = train(lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("hidden")))
    assert ref_l == ref2_l, "the reference itself is not deterministic"
    before = jaxvmm.engine_stats()["cuda:0"] if "cuda:0" in jaxvmm.engine_stats() else {}
    got_l, got_w = train(lambda f: jaxvmm.checkpoint(f, policy=P.offload_only_these_names("hidden")))
    # Tickets that cross jit calls, under the same mode.
    off = jax.jit(jaxvmm.offload)
    rel = jax.jit(lambda t: jaxvmm.reload(t))
    xs = [jax.random.normal(jax.random.key(10 + i), (B, D)) for i in range(6)]
    ts = [off(x) for x in xs]
    eager_ok = all(bool(jnp.array_equal(rel(t), x)) for t, x in zip(reversed(ts), reversed(xs)))
    jaxvmm.synchronize()
    jaxvmm.check()
    s = jaxvmm.engine_stats()["cuda:0"]
    print("RESULT", json.dumps(dict(
        losses_equal=ref_l == got_l, weights_equal=bool(np.array_equal(ref_w, got_w)), eager_ok=eager_ok,
        max_weight_diff=float(np.max(np.abs(ref_w - got_w))),
        stats={k: v - before.get(k, 0) for k, v in s.items() if isinstance(v, int)},
        tickets_live=s["tickets_live"])))
""")

MODES = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "min_graph_size_1": "--xla_gpu_graph_min_graph_size=1",
    "while": "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1",
    "while_unrolled": "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true "
                      "--xla_gpu_graph_min_graph_size=1",
    "skip_temp": "--xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_update_mode=SKIP_TEMP",
    # Commands with no data between them become parallel branches of one graph (XLA's default, LHS,
    # keeps the execution order): jaxvmm's rounds must not rely on stream order.
    "concurrent": "--xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
    "while_concurrent": "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1 "
                        "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
    # Unrolled iterations in one graph: two rounds of one call site ordered only by XLA's buffer uses.
    "while_unrolled_concurrent": "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true "
                                 "--xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_scheduling_mode=CONCURRENT",
}


# cuBLAS algorithms are picked by timing when each program compiles, so two programs with the same dots
# may round differently; without autotuning both take the same algorithms and must agree bit for bit.
DETERMINISTIC = "--xla_gpu_autotune_level=0"


WATCHDOG = pathlib.Path(__file__).resolve().parent.parent / "tools" / "watchdog.py"


def _result(script: str, mode: str, timeout: int, **env) -> dict:
    """Runs `script` in a fresh process under the XLA flags of `mode` (deterministic autotuning) and the
    extra environment; returns the JSON of its last RESULT line. The script runs under tools/watchdog.py:
    still running 15 s before `timeout`, it prints every Python and native thread's stack and the
    engine's stats and exits 3, so a hang fails with its diagnosis rather than a bare timeout."""
    flags = f"{MODES[mode]} {DETERMINISTIC}".strip()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    runner = (f"import runpy, sys; sys.argv = ['watchdog.py', '{timeout - 15}', {f.name!r}]; "
              f"runpy.run_path({str(WATCHDOG)!r}, run_name='__main__')")
    try:
        proc = run_in_subprocess(runner, env={"XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env},
                                 timeout=timeout)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    tail = 60000 if proc.returncode == 3 else 6000  # the watchdog's stacks whole
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-tail:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("mode", list(MODES))
def test_train_steps_bit_exact_in_every_command_buffer_mode(mode):
    r = _result(SCRIPT, mode, 240)
    print(mode, r["stats"])
    assert r["losses_equal"] and r["weights_equal"], r
    assert r["eager_ok"], r
    assert r["tickets_live"] == 0, r
    s = r["stats"]
    if mode == "off":
        assert s["graph_captures"] == 0, s
    elif mode != "default":
        # XLA captured the calls and replayed them: far more rounds than recordings.
        assert s["graph_captures"] > 0, s
        assert s["graph_offload_rounds"] + s["graph_reload_rounds"] > 2 * s["graph_captures"], s


# A pipelined scan: each iteration reloads the array the previous one offloaded and offloads a new one,
# with no data between the two calls, so XLA may run them side by side (CONCURRENT scheduling makes
# them parallel branches of the iteration's graph). A reload whose ticket no reload cell guessed reads
# the offload cell that still holds it where XLA keeps the recorded order (the offload call site's next
# round cannot refill that cell meanwhile), and not under CONCURRENT scheduling. The outputs must equal
# the same program with the identity for offload and reload.
PIPELINE = textwrap.dedent("""
    import json, jax, jax.numpy as jnp, numpy as np, jaxvmm
    L, B, D, STEPS = 32, 256, 512, 4

    def run(vmm):
        off = jaxvmm.offload if vmm else (lambda a: a)
        rel = jaxvmm.reload if vmm else (lambda t: t)

        @jax.jit
        def f(xs):
            def body(c, x):
                t_prev, acc = c
                y = rel(t_prev)
                t = off(x * 2.0 + acc)
                return (t, acc + y), None
            (t, acc), _ = jax.lax.scan(body, (off(xs[0] * 2.0), jnp.zeros_like(xs[0])), xs[1:])
            return acc + rel(t)

        return [np.asarray(f(jax.random.normal(jax.random.key(s), (L, B, D), jnp.float32))) for s in range(STEPS)]

    ref = run(False)
    before = jaxvmm.engine_stats().get("cuda:0", {})
    got = run(True)
    jaxvmm.synchronize()
    jaxvmm.check()
    s = jaxvmm.engine_stats()["cuda:0"]
    print("RESULT", json.dumps(dict(
        equal=[bool(np.array_equal(a, b)) for a, b in zip(ref, got)],
        stats={k: v - before.get(k, 0) for k, v in s.items() if isinstance(v, int)}, tickets_live=s["tickets_live"])))
""")


@pytest.mark.parametrize("mode", list(MODES))
def test_a_pipelined_scan_of_reloads_beside_offloads_is_bit_exact(mode):
    r = _result(PIPELINE, mode, 180)
    s = r["stats"]
    print(mode, {k: s[k] for k in ("graph_captures", "graph_offload_rounds", "graph_reload_rounds", "graph_misses",
                                   "graph_offload_cell_reads")})
    assert all(r["equal"]), r
    assert r["tickets_live"] == 0, r
    if mode not in ("off", "default"):
        assert s["graph_captures"] > 0 and s["graph_offload_rounds"] >= 31, s
        # Misses read the offload cell device to device where XLA keeps the recorded order, and never
        # under CONCURRENT scheduling (the engine reads XLA_FLAGS).
        if "concurrent" in mode:
            assert s["graph_offload_cell_reads"] == 0, s
        else:
            assert s["graph_offload_cell_reads"] > 0, s


# A 32-iteration layer scan trained under jaxvmm.checkpoint with K = 2 cells per channel: bit-exact
# against jax.checkpoint, and most rounds take their grant on the device (the poller arms each cell
# behind its own D2H, and prefetches the next two predictions into the reload cells).
SCAN32 = _train_prelude(L=32, STEPS=6) + textwrap.dedent("""
    assert jaxvmm.configure()["graph_cells"] == 2

    print("RESULT", json.dumps(against(train(REF))))
""")


@pytest.mark.parametrize("mode", ["min_graph_size_1", "while"])
def test_scan_of_32_with_two_cells_takes_most_grants_on_the_device(mode):
    r = _result(SCAN32, mode, 240, JAXVMM_GRAPH_CELLS="2")
    s = r["stats"]
    rounds = s["graph_offload_rounds"] + s["graph_reload_rounds"]
    print(mode, {k: s[k] for k in ("graph_offload_rounds", "graph_reload_rounds", "graph_grants_device",
                                   "graph_grants_host", "graph_hits", "graph_misses", "graph_captures")})
    assert r["losses_equal"] and r["weights_equal"], r
    assert r["tickets_live"] == 0, r
    assert s["graph_captures"] > 0 and rounds >= 32, s
    assert s["graph_grants_device"] + s["graph_grants_host"] == rounds, s
    assert s["graph_grants_device"] >= rounds // 2, s


# Rounds of K = 1, 2, 3 cells per call site in one process (configure(graph_cells=K), then a fresh layer
# function so the program is traced again and its call sites get new channels). With K > 1 each round
# is a take, a copy and a publish kernel; K = 1 records the single-cell nodes. The activation is
# 129 x 509 f32 (262644 bytes: not a multiple of 16, so the copy's tail runs). Every K must match
# jax.checkpoint bit for bit.
SCAN_K = _train_prelude(L=16, STEPS=4, B=129, D=509) + textwrap.dedent("""
    _layer = layer
    ref = train(REF)
    out = {}
    for K in (1, 2, 3):
        jaxvmm.configure(graph_cells=K)
        layer = lambda h, w: _layer(h, w)  # a new function: traced again, new call sites
        out[K] = against(ref)
    jaxvmm.collect()
    print("RESULT", json.dumps(dict(out=out, tickets_live=jaxvmm.engine_stats()["cuda:0"]["tickets_live"],
                                    graph_kernels=jaxvmm.engine_stats()["cuda:0"]["graph_kernels"],
                                    sm90=float(jax.devices()[0].compute_capability) >= 9.0)))
""")


@pytest.mark.parametrize("mode", ["default", "while"])
def test_rounds_of_one_to_three_cells_are_bit_exact(mode):
    r = _result(SCAN_K, mode, 180)
    assert r["graph_kernels"] == 1, r
    for k, got in r["out"].items():
        s = got["stats"]
        keys = ("graph_captures", "graph_early_captures", "graph_offload_rounds",
                "graph_reload_rounds", "graph_grants_device", "graph_grants_host", "graph_cells")
        print(mode, "K", k, {key: s[key] for key in keys})
        assert got["losses_equal"] and got["weights_equal"], (k, got)
        if mode == "while":
            assert s["graph_captures"] > 0 and s["graph_offload_rounds"] >= 16, (k, s)
            assert s["graph_cells"] >= 2 * int(k) and s["graph_cells"] % int(k) == 0, (k, s)  # K per channel
        # On sm_90 (an H100/H200) every round in kernels launches its copy and publish early, and these
        # rounds matched jax.checkpoint with it.
        if r["sm90"]:
            if int(k) > 1 and s["graph_captures"] > 0:
                assert s["graph_early_captures"] > 0, (k, s)
        else:
            assert s["graph_early_captures"] == 0, (k, s)
    assert r["tickets_live"] == 0, r


# Spare cells under XLA: a 64-layer scan whose 8 MiB activations come faster than PCIe carries them
# (B x D = 8192 x 256 f32: ~160 us of D2H each on an H200 against a few us of matmul; at 1024 x 1024
# the layer's compute kept up with PCIe and no cell was ever lent, and at 4096 x 256 one default-mode
# run lent none either: there the host launches each iteration's command buffer, ~80 us of D2H
# was not always more than that), with 2 cells and 32 spares per call site. Offload cells are lent while
# their D2H is queued (the cell's address in the device words changes under the recorded kernels), the
# first reloads of the backward copy from lent cells, and the training matches jax.checkpoint bit for bit.
SPARES = _train_prelude(L=64, STEPS=4, B=8192, D=256) + textwrap.dedent("""
    import jaxvmm.testing
    assert jaxvmm.testing.configure_debug()["graph_spares"] == 32
    print("RESULT", json.dumps(against(train(REF))))
""")


@pytest.mark.parametrize("mode", ["default", "while"])
def test_spare_cells_under_xla_are_bit_exact(mode):
    r = _result(SPARES, mode, 240, JAXVMM_GRAPH_CELLS="2", JAXVMM_DEBUG_GRAPH_SPARES="32")
    s = r["stats"]
    print(mode, {k: s[k] for k in ("graph_offload_rounds", "graph_reload_rounds", "graph_lends", "graph_lent_reads",
                                   "graph_grants_device", "graph_grants_host", "graph_captures")})
    assert r["losses_equal"] and r["weights_equal"], r
    assert r["tickets_live"] == 0, r
    assert s["graph_captures"] > 0 and s["graph_lends"] > 0, s
