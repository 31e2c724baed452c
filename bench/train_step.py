"""What offloading remat residuals costs a training step: save-on-device, full remat, JAX's native host
offload and jaxvmm, on an MLP-block scan and a GPT-style block stack.

    python bench/train_step.py                        # full shapes on GPU, tiny ones (--small) on cpu
    python bench/train_step.py --small --steps 3      # tiny shapes anywhere: checks the harness
    python bench/train_step.py --models mlp --targets mlp_hidden --variants save,jaxvmm --steps 30
    python bench/train_step.py --models mlp --targets mlp_hidden --mlp-shape 256,512,64 --variants save,jaxvmm \
        --repeat 5 --autotune-cache /tmp/autotune   # five alternating runs of each, the same GEMM algorithms

Models (bf16, layers stacked and run by ``lax.scan``; loss = mean(y**2) in float32; plain SGD):

  mlp   ``x + W2 gelu(W1 x)``, hidden 4D: B=8192, D=4096, L=24  (--small: B=64, D=128, L=4)
  gpt   pre-norm block: causal attention, 32 heads of 128, then an MLP with hidden 4D; batch 2,
        sequence 2048, width 4096, L=16  (--small: batch 2, sequence 64, width 128, 4 heads of 32, L=4)

Targets: each layer names its input ``checkpoint_name(x, "block_input")`` at the top and its MLP hidden
activation ``checkpoint_name(gelu(...), "mlp_hidden")``; a target is the name the variants save/offload.

Variants, all wrapping the same layer function:

  save     jax.checkpoint(layer, policy=save_only_these_names(target))            the baseline
  remat    jax.checkpoint(layer, policy=nothing_saveable)
  native   jax.checkpoint(layer, policy=save_and_offload_only_these_names(
               names_which_can_be_saved=[], names_which_can_be_offloaded=[target],
               offload_src="device", offload_dst="pinned_host"))
  jaxvmm   jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_only_these_names(target))

Each (model, target, variant) runs in a fresh subprocess (this script with --child), which compiles the
jitted ``value_and_grad`` + SGD step (parameters donated) before allocating anything, then reports:
median step time over --steps steps after --warmup steps (block_until_ready each step), XLA temp bytes
(``memory_analysis().temp_size_in_bytes``), peak device bytes (GPU: ``peak_bytes_in_use`` of XLA's
allocator + jaxvmm's ``peak_mapped_bytes``; n/a on cpu), host bytes (jaxvmm: pinned pool in use at peak
/ pool size; native: XLA's ``host_temp_size_in_bytes``) and jaxvmm's prefetch hits/misses. A variant
that fails is recorded in the table, not fatal.

--repeat N runs every variant's process N times, alternating (save, jaxvmm, save, jaxvmm, ...), and
reports the median run of each (its step time the median of the N); a note lists each offload variant's
N ratios to the save-on-device run next to it and their median. A process's step time varies from one
process to the next by several percent on small rows (each compiles and autotunes its own GEMMs);
--autotune-cache DIR has every child share XLA's autotune results (--xla_gpu_per_fusion_autotune_cache_dir;
the first process to compile a fusion tunes it, the others load its choice), so both sides of a ratio
run the same algorithms.

Goals (offload variants, against save-on-device of the same model and target): step time <= 1.02x when
block inputs are offloaded, <= 1.05x for MLP hidden activations; device memory reduced by >= 95% of the
bytes offloaded per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

# Children must leave device memory to jaxvmm's staging slots (and report honest peaks): no preallocation.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

MiB = 1 << 20
GiB = 1 << 30
MODELS = ("mlp", "gpt")
TARGETS = ("block_input", "mlp_hidden")
VARIANTS = ("save", "remat", "native", "jaxvmm")
VARIANT_LABEL = {"save": "save on device", "remat": "full remat", "native": "JAX native offload",
                 "jaxvmm": "jaxvmm offload"}
GOAL_TIME = {"block_input": 1.02, "mlp_hidden": 1.05}
GOAL_MEM = 0.95
LR = 1e-3
RESULT_TAG = "@@TRAIN_STEP_RESULT "
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "train_step.md")


@dataclasses.dataclass(frozen=True)
class Shapes:
    batch: int
    seq: int  # 1 for the mlp model (x is [batch, width])
    width: int
    layers: int
    heads: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


FULL = {"mlp": Shapes(batch=8192, seq=1, width=4096, layers=24),
        "gpt": Shapes(batch=2, seq=2048, width=4096, layers=16, heads=32)}
SMALL = {"mlp": Shapes(batch=64, seq=1, width=128, layers=4),
         "gpt": Shapes(batch=2, seq=64, width=128, layers=4, heads=4)}
ITEMSIZE = 2  # bf16


def shapes_for(model: str, small: bool, gpt_batch: int | None, mlp_shape: str | None = None) -> Shapes:
    s = (SMALL if small else FULL)[model]
    if model == "gpt" and gpt_batch:
        s = dataclasses.replace(s, batch=gpt_batch)
    if model == "mlp" and mlp_shape:
        b, d, n = (int(v) for v in mlp_shape.split(","))
        s = dataclasses.replace(s, batch=b, width=d, layers=n)
    return s


def param_shapes(model: str, s: Shapes) -> dict[str, tuple[int, ...]]:
    L, D = s.layers, s.width
    if model == "mlp":
        return {"w1": (L, D, 4 * D), "w2": (L, 4 * D, D)}
    return {"wqkv": (L, D, 3 * D), "wo": (L, D, D), "w1": (L, D, 4 * D), "w2": (L, 4 * D, D)}


def residual_bytes(target: str, s: Shapes) -> int:
    """Bytes save-on-device keeps per step for the target: one named value per layer."""
    per_token = s.width if target == "block_input" else 4 * s.width
    return s.layers * s.tokens * per_token * ITEMSIZE


def describe(model: str, s: Shapes) -> str:
    n_params = sum(_prod(v) for v in param_shapes(model, s).values())
    if model == "mlp":
        what = f"MLP-block scan: B={s.batch}, D={s.width}, hidden {4 * s.width}, L={s.layers}"
    else:
        what = (f"GPT block: batch {s.batch}, seq {s.seq}, width {s.width}, {s.heads} heads of "
                f"{s.width // s.heads}, MLP hidden {4 * s.width}, L={s.layers}")
    return f"{what}; {n_params / 1e6:,.1f} M params ({human(n_params * ITEMSIZE)} bf16)"


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def human(n) -> str:
    if n is None:
        return "n/a"
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:,.2f} {unit}"
    return f"{sign}{n} B"


# ---------------------------------------------------------------- child: one (model, target, variant)


def _norm(x):
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mu).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)


def _attention(q, k, v, impl: str):
    """q, k, v: [B, S, H, Dh]; causal."""
    import jax
    import jax.numpy as jnp

    if impl in ("xla", "cudnn"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    S, dh = q.shape[1], q.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / (dh ** 0.5)
    mask = jnp.tril(jnp.ones((S, S), jnp.bool_))
    p = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def make_layer(model: str, s: Shapes, attn_impl: str):
    import jax
    from jax.ad_checkpoint import checkpoint_name

    if model == "mlp":
        def layer(x, w):
            x = checkpoint_name(x, "block_input")
            h = checkpoint_name(jax.nn.gelu(x @ w["w1"]), "mlp_hidden")
            return x + h @ w["w2"]
        return layer

    H, D = s.heads, s.width

    def layer(x, w):  # x: [B, S, D]
        x = checkpoint_name(x, "block_input")
        B, S, _ = x.shape
        qkv = (_norm(x) @ w["wqkv"]).reshape(B, S, 3, H, D // H)
        a = _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attn_impl)
        x = x + a.reshape(B, S, D) @ w["wo"]
        h = checkpoint_name(jax.nn.gelu(_norm(x) @ w["w1"]), "mlp_hidden")
        return x + h @ w["w2"]
    return layer


def wrap(layer, variant: str, target: str):
    import jax

    cp = jax.checkpoint_policies
    if variant == "save":
        return jax.checkpoint(layer, policy=cp.save_only_these_names(target))
    if variant == "remat":
        return jax.checkpoint(layer, policy=cp.nothing_saveable)
    if variant == "native":
        return jax.checkpoint(layer, policy=cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[target],
            offload_src="device", offload_dst="pinned_host"))
    if variant == "jaxvmm":
        import jaxvmm

        return jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_only_these_names(target))
    raise ValueError(f"unknown variant {variant!r}")


def build_step(model: str, target: str, variant: str, s: Shapes, attn_impl: str):
    return build_step_from_body(wrap(make_layer(model, s, attn_impl), variant, target))


def build_step_from_body(body):
    """The jitted training step (value_and_grad of mean(y**2) over a lax.scan of ``body``, then SGD,
    parameters donated) around a wrapped layer function (bench/capacity.py wraps its own policies)."""
    import jax
    import jax.numpy as jnp

    def loss_fn(params, x):
        y, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, params)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    def train_step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        new = jax.tree.map(lambda p, g: (p.astype(jnp.float32) - LR * g.astype(jnp.float32)).astype(p.dtype),
                           params, grads)
        return loss, new

    return jax.jit(train_step, donate_argnums=0)


def init_arrays(model: str, s: Shapes):
    import jax
    import jax.numpy as jnp

    pshapes = param_shapes(model, s)
    x_shape = (s.batch, s.width) if model == "mlp" else (s.batch, s.seq, s.width)

    @jax.jit
    def init(key):
        keys = jax.random.split(key, len(pshapes) + 1)
        params = {}
        for k, (name, shape) in zip(keys[1:], sorted(pshapes.items())):
            fan_in = shape[1]
            # The residual branch shrinks with depth beyond the default 24 layers, so deep small-activation
            # stacks (--mlp-shape ...,64) train as stably as the default ones.
            std = (1.0 if name != "w2" else 0.5 * min(1.0, (24 / s.layers) ** 0.5)) / fan_in ** 0.5
            params[name] = (jax.random.normal(k, shape, jnp.float32) * std).astype(jnp.bfloat16)
        x = jax.random.normal(keys[0], x_shape, jnp.float32).astype(jnp.bfloat16)
        return params, x

    return init(jax.random.key(0))


def specs(model: str, s: Shapes):
    import jax
    import jax.numpy as jnp

    p = {k: jax.ShapeDtypeStruct(v, jnp.bfloat16) for k, v in param_shapes(model, s).items()}
    x_shape = (s.batch, s.width) if model == "mlp" else (s.batch, s.seq, s.width)
    return p, jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)


def run_child(args) -> dict:
    model, target, variant = args.child
    import warnings

    warnings.filterwarnings("ignore", message=".*[Dd]onat.*")  # cpu cannot donate every buffer; harmless
    import jax

    on_gpu = jax.default_backend() == "gpu"
    small = args.small if args.small is not None else not on_gpu
    s = shapes_for(model, small, args.gpt_batch, args.mlp_shape)
    res: dict = {"model": model, "target": target, "variant": variant, "small": small,
                 "offloaded_bytes": residual_bytes(target, s)}

    # Compile before anything is allocated: autotuning scratch cannot raise the peak above the run's.
    attn = args.attention
    if attn == "auto":
        attn = "cudnn" if on_gpu else "xla"
    p_spec, x_spec = specs(model, s)
    tried = []
    while True:
        try:
            compiled = build_step(model, target, variant, s, attn).lower(p_spec, x_spec).compile()
            break
        except Exception as e:  # noqa: BLE001
            if model == "gpt" and args.attention == "auto" and attn == "cudnn":
                tried.append(f"cudnn failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
                attn = "xla"
                continue
            raise
    if model == "gpt":
        res["attention"] = attn + (f" ({'; '.join(tried)})" if tried else "")
    mem = compiled.memory_analysis()
    res["temp_bytes"] = int(mem.temp_size_in_bytes) if mem is not None else None
    host_temp = getattr(mem, "host_temp_size_in_bytes", None) if mem is not None else None
    res["xla_host_temp_bytes"] = int(host_temp) if host_temp is not None else None

    vmm = None
    if variant == "jaxvmm":
        import jaxvmm as vmm

    import contextlib

    timeline = contextlib.nullcontext()
    if args.timeline:
        import jaxvmm

        timeline = jaxvmm.memory_timeline(jax.devices()[0])
    tl_start_ns = time.monotonic_ns()  # the timeline's times count from (about) here
    with timeline as tl:
        params, x = init_arrays(model, s)
        jax.block_until_ready((params, x))
        losses, times = [], []
        before = None
        timed_from_ns = None
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if vmm is not None:
                    vmm.synchronize()
                    before = _engine_totals(vmm)
                timed_from_ns = time.monotonic_ns() - tl_start_ns
            t0 = time.perf_counter()
            loss, params = compiled(params, x)
            jax.block_until_ready((loss, params))
            dt = time.perf_counter() - t0
            losses.append(float(loss))
            if i >= args.warmup:
                times.append(dt)
    if tl is not None:
        # One moment's total: driver-level used memory (XLA's live buffers with the platform allocator,
        # jaxvmm's pages, parameters and inputs) above what was in use before the arrays were made.
        res["driver_peak_bytes"] = tl.peak_used_bytes - tl.first_used_bytes
        res["driver_internal_at_peak_bytes"] = tl.internal_at_peak_bytes
        res["timeline_source"] = tl.source
        # The same over the timed steps alone (the warm-up steps include the first execution, whose
        # ops run uncaptured, and the recording of command buffers).
        a = tl.series()
        timed = a[a[:, 0] >= timed_from_ns] if timed_from_ns is not None else a[:0]
        if len(timed):
            k = int(timed[:, 1].argmax())
            res["driver_peak_timed_bytes"] = int(timed[k, 1]) - tl.first_used_bytes
            res["driver_internal_at_timed_peak_bytes"] = int(timed[k, 3])
    res["step_s"] = statistics.median(times)
    res["step_s_min"] = min(times)
    res["loss_first"], res["loss_last"] = losses[0], losses[-1]
    if not all(l == l and abs(l) != float("inf") for l in losses):  # noqa: E741
        raise FloatingPointError(f"non-finite loss: {losses}")

    dev = jax.devices()[0]
    ms = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    xla_peak = int(ms["peak_bytes_in_use"]) if ms and "peak_bytes_in_use" in ms else None
    res["xla_peak_bytes"] = xla_peak
    res["mapped_peak_bytes"] = 0
    if vmm is not None:
        vmm.synchronize()
        vmm.check()  # raises the first asynchronous engine error, if any
        after = _engine_totals(vmm)
        st = vmm.stats()
        res["mapped_peak_bytes"] = int(st["peak_mapped_bytes"])
        res["mapped_end_bytes"] = int(st["mapped_bytes"])
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        # Graph mode (calls captured into XLA's command buffers): rounds served by the poller.
        res["prefetch_hits"] = d["prefetch_hits"] + d.get("graph_hits", 0)
        res["prefetch_misses"] = d["prefetch_misses"] + d.get("graph_misses", 0)
        res["offloads_per_step"] = d["offloads"] / args.steps
        res["reloads_per_step"] = d["reloads"] / args.steps  # graph-mode rounds included (engine_stats)
        res["graph_rounds_per_step"] = (d.get("graph_offload_rounds", 0) + d.get("graph_reload_rounds", 0)) / args.steps
        # Rounds that took their grant on the device (no poller round trip on the device's path).
        res["graph_device_grants_per_step"] = d.get("graph_grants_device", 0) / args.steps
        # Spare cells (graph_spares): offload cells swapped for a spare while their D2H was queued; held
        # cells (kept unarmed until their D2H is done); reloads copied device to device from either.
        res["graph_lends_per_step"] = d.get("graph_lends", 0) / args.steps
        res["graph_holds_per_step"] = d.get("graph_holds", 0) / args.steps
        res["graph_lent_reads_per_step"] = d.get("graph_lent_reads", 0) / args.steps
        res["graph_kept_reads_per_step"] = d.get("graph_kept_reads", 0) / args.steps
        res["graph_spare_peak_bytes"] = after.get("graph_spare_bytes_peak", 0)  # graph_spare_budget caps it
        res["pinned_bytes"] = after["pinned_bytes"]
        res["pinned_peak_in_use_bytes"] = after["pinned_peak_in_use_bytes"]
        res["tickets_live"] = after["tickets_live"]
        res["engine_errors"] = after["errors"]
        # The median covers the engine's last 4096 ring-path calls: meaningful only if the timed steps
        # made such calls (in graph mode replays make none).
        res["handler_calls_per_step"] = d.get("handler_calls", 0) / args.steps
        res["handler_median_us"] = after.get("handler_median_ns", 0) / 1e3 if d.get("handler_calls", 0) else 0.0
        res["staging_peak_bytes"] = after.get("staging_peak_bytes", 0)
    res["device_bytes"] = None if xla_peak is None else xla_peak + res["mapped_peak_bytes"]
    res["layers"] = s.layers
    return res


def _engine_totals(vmm) -> dict:
    tot: dict = {}
    for st in vmm.engine_stats().values():
        for k, v in st.items():
            if isinstance(v, int) and not isinstance(v, bool):  # counters (host_store names a store)
                tot[k] = tot.get(k, 0) + v
    for k in ("prefetch_hits", "prefetch_misses", "offloads", "reloads", "pinned_bytes",
              "pinned_peak_in_use_bytes", "tickets_live", "errors"):
        tot.setdefault(k, 0)
    return tot


def run_probe() -> dict:
    import jax

    dev = jax.devices()[0]
    out = {"backend": jax.default_backend(), "device": str(dev), "kind": dev.device_kind,
           "jax": jax.__version__, "n_devices": jax.device_count()}
    try:
        import jaxvmm

        out["jaxvmm"] = jaxvmm.__version__
        free, total = jaxvmm.driver_memory_info(dev)
        out["mem_free"], out["mem_total"] = free, total
        out["knobs"] = jaxvmm.configure()
    except Exception as e:  # noqa: BLE001
        out["jaxvmm_error"] = f"{type(e).__name__}: {e}"
    return out


# ---------------------------------------------------------------- parent


def child_cmd(args, extra: list[str]) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), *extra, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--attention", args.attention]
    if args.small is True:
        cmd.append("--small")
    elif args.small is False:
        cmd.append("--full")
    if args.gpt_batch:
        cmd += ["--gpt-batch", str(args.gpt_batch)]
    if args.mlp_shape:
        cmd += ["--mlp-shape", args.mlp_shape]
    if args.timeline:
        cmd.append("--timeline")
    return cmd


def spawn(cmd: list[str], timeout: float, autotune_cache: str | None = None) -> dict:
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if autotune_cache:
        flag = f"--xla_gpu_per_fusion_autotune_cache_dir={autotune_cache}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    if "--timeline" in cmd:
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
            res["wall_s"] = wall
            return res
    lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines() if ln.strip()]
    errs = [ln for ln in lines if ("Error" in ln or "error" in ln) and not ln.startswith(("File ", "^"))]
    why = (errs or lines or [f"exit status {proc.returncode}, no output"])[-1]
    return {"error": f"exit {proc.returncode}: {why}", "wall_s": wall, "stderr_tail": proc.stderr[-4000:]}


def median_run(rs: list[dict]) -> dict:
    """The run of median step time among the successful ones (its other figures with it), its step time
    the median of them all; the first failure when none succeeded."""
    ok = sorted((r for r in rs if "error" not in r), key=lambda r: r["step_s"])
    if not ok:
        return rs[0]
    out = dict(ok[(len(ok) - 1) // 2])
    out["step_s"] = statistics.median(r["step_s"] for r in ok)
    out["runs"] = len(ok)
    return out


def repeat_notes(runs: dict, models, targets, variants) -> list[str]:
    """With --repeat: each offload variant's step-time ratio to the save-on-device process run just
    before it, per repetition, and their median."""
    notes = []
    for m in models:
        for t in targets:
            base = runs.get((m, t, "save"), [])
            for v in variants:
                if v == "save":
                    continue
                ratios = [r["step_s"] / b["step_s"] for b, r in zip(base, runs.get((m, t, v), []))
                          if "error" not in b and "error" not in r]
                if ratios:
                    notes.append(f"{m}/{t}/{v}: per-run ratios to save on device "
                                 + ", ".join(f"{x:.3f}x" for x in ratios)
                                 + f" (median {statistics.median(ratios):.3f}x, {len(ratios)} pairs)")
    return notes


def mem_measure(r: dict) -> int | None:
    """Device memory a row is judged by: runtime peak (XLA + jaxvmm's pages) when the platform reports
    one, else XLA's planned temp + jaxvmm's peak mapped pages."""
    if "error" in r:
        return None
    if r.get("driver_peak_bytes") is not None:
        return r["driver_peak_bytes"]
    if r.get("device_bytes") is not None:
        return r["device_bytes"]
    if r.get("temp_bytes") is None:
        return None
    return r["temp_bytes"] + r.get("mapped_peak_bytes", 0)


HEADERS = ["model", "target", "variant", "step ms", "vs save", "XLA temp", "peak device", "host",
           "offloaded/step", "device saved: % of offloaded (bytes)", "prefetch hit/miss", "goals"]
RIGHT = {3, 4, 5, 6, 7, 8, 9, 10}


def render(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(HEADERS) + " |",
           "|" + "|".join("---:" if i in RIGHT else "---" for i in range(len(HEADERS))) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def evaluate(results: dict, model: str, target: str, variant: str) -> tuple[list[str], dict]:
    r = results[(model, target, variant)]
    base = results.get((model, target, "save"))
    ok_base = base is not None and "error" not in base
    verdict: dict = {}
    if "error" in r:
        err = r["error"]
        return [model, target, VARIANT_LABEL[variant], "FAILED", "", "", "", "", "", "", "",
                "error: " + (err if len(err) <= 160 else err[:157] + "...")], verdict
    ratio = r["step_s"] / base["step_s"] if ok_base else None
    m, mb = mem_measure(r), (mem_measure(base) if ok_base else None)
    off = r["offloaded_bytes"]
    saved = (mb - m) if (m is not None and mb is not None) else None
    if variant == "native":
        host = human(r["xla_host_temp_bytes"]) if r.get("xla_host_temp_bytes") is not None else "n/a"
    elif variant == "jaxvmm":
        host = f"{human(r['pinned_peak_in_use_bytes'])} / {human(r['pinned_bytes'])}"
    else:
        host = ""
    goals = ""
    if variant in ("native", "jaxvmm") and ok_base:
        g = GOAL_TIME[target]
        verdict["time"] = ratio <= g
        goals = f"time <= {g:.2f}x {'PASS' if verdict['time'] else 'MISS'}"
        if saved is not None:
            verdict["mem"] = saved >= GOAL_MEM * off
            goals += f"; memory >= {GOAL_MEM:.0%} {'PASS' if verdict['mem'] else 'MISS'}"
    elif variant == "save":
        goals = "baseline"
    hits = ""
    if variant == "jaxvmm":
        hits = f"{r['prefetch_hits']}/{r['prefetch_misses']}"
        if r.get("handler_median_us"):
            hits += f", handler {r['handler_median_us']:.1f} us"
        if r.get("graph_rounds_per_step"):
            hits += f", {r['graph_rounds_per_step']:.0f} graph rounds/step"
            if r.get("graph_device_grants_per_step"):
                hits += f" ({r['graph_device_grants_per_step']:.0f} granted on the device)"
            if r.get("graph_lends_per_step") or r.get("graph_holds_per_step") or r.get("graph_lent_reads_per_step"):
                hits += (f", {r['graph_lends_per_step']:.0f} lends/{r.get('graph_holds_per_step', 0):.0f} holds/"
                         f"{r['graph_lent_reads_per_step']:.0f} lent reads ({r.get('graph_kept_reads_per_step', 0):.0f} "
                         f"after their D2H) per step")
            if r.get("graph_spare_peak_bytes"):
                hits += f", spares mapped at most {human(r['graph_spare_peak_bytes'])}"
            if not r.get("handler_calls_per_step"):
                hits += " (no handler call)"
    peak = human(r["device_bytes"]) if r.get("device_bytes") is not None else "n/a"
    if r.get("driver_peak_bytes") is not None:
        peak = human(r["driver_peak_bytes"])
        if variant == "jaxvmm":
            peak += f" (jaxvmm {human(r['driver_internal_at_peak_bytes'])} at peak)"
        if r.get("driver_peak_timed_bytes") is not None and (
                r["driver_peak_timed_bytes"], r.get("driver_internal_at_timed_peak_bytes")) != (
                r["driver_peak_bytes"], r.get("driver_internal_at_peak_bytes")):
            peak += f"; timed steps {human(r['driver_peak_timed_bytes'])}"
            if variant == "jaxvmm":
                peak += f" (jaxvmm {human(r['driver_internal_at_timed_peak_bytes'])})"
    elif r.get("mapped_peak_bytes"):
        how = "incl." if r.get("device_bytes") is not None else "+"
        peak += f" ({how} {human(r['mapped_peak_bytes'])} staging)"
    if variant == "save":
        saved_cell = ""
    elif saved is None:
        saved_cell = "n/a"
    elif variant == "remat":
        saved_cell = human(saved)  # nothing offloaded: just the difference
    else:
        saved_cell = f"{saved / off:.0%} ({human(saved)})"
    return [model, target, VARIANT_LABEL[variant], f"{r['step_s'] * 1e3:,.2f}",
            f"{ratio:.3f}x" if ratio is not None else "n/a", human(r["temp_bytes"]), peak, host,
            human(off) if variant in ("native", "jaxvmm") else "", saved_cell, hits, goals], verdict


def plot(results: dict, models, targets, variants, path: str, mem_label: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return f"no plot: matplotlib not importable ({type(e).__name__})"
    groups = [(m, t) for m in models for t in targets]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 3 * len(groups)) + 4, 4.5))
    width = 0.8 / max(1, len(variants))
    peak_mem = max([mem_measure(r) or 0 for r in results.values()] + [0])
    unit, scale = ("GiB", GiB) if peak_mem >= GiB else ("MiB", MiB)
    for vi, v in enumerate(variants):
        ratios, mems = [], []
        for (m, t) in groups:
            r, b = results.get((m, t, v), {}), results.get((m, t, "save"), {})
            ok = "error" not in r and r and b and "error" not in b
            ratios.append(r["step_s"] / b["step_s"] if ok else 0.0)
            mm = mem_measure(r) if r else None
            mems.append((mm or 0) / scale)
        xs = [i + (vi - (len(variants) - 1) / 2) * width for i in range(len(groups))]
        axes[0].bar(xs, ratios, width, label=VARIANT_LABEL[v])
        axes[1].bar(xs, mems, width, label=VARIANT_LABEL[v])
    for ax in axes:
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{m}\n{t}" for m, t in groups])
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("step time / save-on-device")
    axes[0].set_title("step time ratio (0 = failed)")
    axes[1].set_ylabel(f"{unit} ({mem_label})")
    axes[1].set_title("device memory")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def csv_choice(allowed):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)} (got {text!r})")
        return items
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=csv_choice(MODELS), default=list(MODELS),
                    help="comma-separated: mlp,gpt")
    ap.add_argument("--targets", type=csv_choice(TARGETS), default=list(TARGETS),
                    help="comma-separated: block_input,mlp_hidden")
    ap.add_argument("--variants", type=csv_choice(VARIANTS), default=list(VARIANTS),
                    help="comma-separated: save,remat,native,jaxvmm (save is always run: it is the baseline)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per row (default 20 on GPU, 5 on cpu)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", dest="small", action="store_const", const=True, default=None,
                      help="tiny shapes (B=64, D=128, L=4, seq 64); the default on cpu")
    size.add_argument("--full", dest="small", action="store_const", const=False,
                      help="full shapes even on cpu (slow)")
    ap.add_argument("--gpt-batch", type=int, default=None, help="gpt batch size (default 2)")
    ap.add_argument("--mlp-shape", default=None, metavar="B,D,L",
                    help="mlp batch, width and layers instead of the defaults (small activations: 256,512,64)")
    ap.add_argument("--attention", choices=("auto", "xla", "cudnn", "einsum"), default="auto",
                    help="gpt attention: jax.nn.dot_product_attention(implementation=xla|cudnn) or a plain "
                         "einsum; auto = cudnn on GPU (xla if it fails to compile), xla on cpu")
    ap.add_argument("--timeline", action="store_true",
                    help="peak device = driver-level used memory sampled every 100 us (jaxvmm.memory_timeline), "
                         "children run with XLA_PYTHON_CLIENT_ALLOCATOR=platform so XLA returns what it frees")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per child process (default 900)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="processes per variant, alternating variants; the median run of each is reported (default 1)")
    ap.add_argument("--autotune-cache", default=None, metavar="DIR",
                    help="children share XLA's autotune results through DIR (--xla_gpu_per_fusion_autotune_cache_dir)")
    ap.add_argument("--out", default=DEFAULT_OUT,
                    help="markdown output (default bench/results/train_step.md)")
    ap.add_argument("--plot", default=None, help="PNG output (default: --out with .png)")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "TARGET", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.probe:
        print(RESULT_TAG + json.dumps(run_probe()), flush=True)
        return 0
    if args.child:
        if args.steps is None:
            args.steps = 5
        if args.child[0] not in MODELS or args.child[1] not in TARGETS or args.child[2] not in VARIANTS:
            ap.error(f"bad --child {args.child}")
        print(RESULT_TAG + json.dumps(run_child(args)), flush=True)
        return 0

    probe = spawn([sys.executable, os.path.abspath(__file__), "--probe"], args.timeout)
    if "error" in probe:
        print(f"probe failed: {probe['error']}\n{probe.get('stderr_tail', '')}", file=sys.stderr)
        return 1
    on_gpu = probe["backend"] == "gpu"
    if args.small is None:
        args.small = not on_gpu
    if args.steps is None:
        args.steps = 20 if on_gpu else 5
    if args.steps < 1 or args.warmup < 0 or args.repeat < 1:
        ap.error("--steps and --repeat must be >= 1 and --warmup >= 0")
    variants = ["save"] + [v for v in VARIANTS if v in args.variants and v != "save"]

    header = [f"jaxvmm {probe.get('jaxvmm', '?')} training step: remat residuals saved, recomputed or "
              f"offloaded (one fresh process per row)",
              f"device:     {probe['device']} ({probe['kind']}), jax {probe['jax']}"
              + (f", {probe['mem_total'] / GiB:,.1f} GiB" if 'mem_total' in probe else "")]
    for m in args.models:
        header.append(f"{m + ':':11s} {describe(m, shapes_for(m, args.small, args.gpt_batch, args.mlp_shape))}")
    header.append(f"timing:     median of {args.steps} steps after {args.warmup} warm-up steps "
                  f"(jitted value_and_grad + SGD, params donated, block_until_ready each step)"
                  + (f"; median of {args.repeat} alternating processes per variant" if args.repeat > 1 else "")
                  + (f"; children share XLA autotune results ({args.autotune_cache})" if args.autotune_cache else ""))
    if args.timeline:
        header.append("memory:     driver-level timeline (jaxvmm.memory_timeline, cuMemGetInfo every 100 us), "
                      "children run with XLA_PYTHON_CLIENT_ALLOCATOR=platform and XLA_PYTHON_CLIENT_PREALLOCATE=false")
    if "knobs" in probe:
        k = probe["knobs"]
        header.append(f"jaxvmm:     host pool limit {k['host_pool_limit'] / GiB:,.1f} GiB, prefetch depth "
                      f"{k['prefetch_depth']}")
    print("\n".join(header), flush=True)

    runs: dict = {}
    for m in args.models:
        for t in args.targets:
            for i in range(args.repeat):
                for v in variants:
                    tag = f" #{i + 1}" if args.repeat > 1 else ""
                    print(f"  {m} / {t} / {v}{tag} ...", end="", file=sys.stderr, flush=True)
                    r = spawn(child_cmd(args, ["--child", m, t, v]), args.timeout, args.autotune_cache)
                    runs.setdefault((m, t, v), []).append(r)
                    msg = r["error"] if "error" in r else f"{r['step_s'] * 1e3:,.2f} ms"
                    print(f" {msg} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    results = {key: median_run(rs) for key, rs in runs.items()}

    rows, notes, verdicts = [], [], []
    if args.repeat > 1:
        notes += repeat_notes(runs, args.models, args.targets, variants)
    failed_required = False
    for m in args.models:
        for t in args.targets:
            for v in variants:
                row, verdict = evaluate(results, m, t, v)
                rows.append(row)
                r = results[(m, t, v)]
                if "error" in r:
                    notes.append(f"{m}/{t}/{v} failed: {r['error']}")
                    if v != "native":
                        failed_required = True
                    continue
                if verdict:
                    verdicts.append(((m, t, v), verdict))
                if v == "jaxvmm":
                    bad = []
                    if r["engine_errors"]:
                        bad.append(f"{r['engine_errors']} engine errors")
                    if r["tickets_live"]:
                        bad.append(f"{r['tickets_live']} tickets live after the run")
                    if r["offloads_per_step"] != r["layers"] or r["reloads_per_step"] != r["layers"]:
                        bad.append(f"{r['offloads_per_step']:g} offloads / {r['reloads_per_step']:g} reloads "
                                   f"per step (expected {r['layers']}, one per layer)")
                    if bad:
                        failed_required = True
                        notes.append(f"{m}/{t}/jaxvmm: " + "; ".join(bad))
            # every variant computes the same function from the same parameters: same first loss
            ok = [(v, results[(m, t, v)]) for v in variants if "error" not in results[(m, t, v)]]
            if ok:
                ref = ok[0][1]["loss_first"]
                off = [f"{v} {r['loss_first']:.6g}" for v, r in ok
                       if abs(r["loss_first"] - ref) > 1e-2 * max(1.0, abs(ref))]
                if off:
                    failed_required = True
                    notes.append(f"{m}/{t}: first-step loss differs between variants (save {ref:.6g}; "
                                 + ", ".join(off) + ")")
            if (m, t, "native") in results and "error" not in results[(m, t, "native")] \
                    and "error" not in results[(m, t, "save")]:
                rn, rs = results[(m, t, "native")], results[(m, t, "save")]
                if not on_gpu and rn["temp_bytes"] >= rs["temp_bytes"] and not rn.get("xla_host_temp_bytes"):
                    notes.append(f"{m}/{t}/native: same XLA temp as save-on-device and no host temp: on cpu "
                                 "there is no separate pinned_host memory space, so the native policy moves "
                                 "nothing (the row only shows that it compiles and runs)")

    gpt_attn = {r.get("attention") for (m, _, _), r in results.items() if m == "gpt" and r.get("attention")}
    if gpt_attn:
        notes.append("gpt attention: " + ", ".join(sorted(gpt_attn)))
    any_peak = any(r.get("device_bytes") is not None for r in results.values())
    mem_label = ("driver-level peak" if args.timeline else "peak device") if any_peak or args.timeline \
        else "XLA temp + staging"
    notes.append("offloaded/step: bytes save-on-device keeps for the target (one named value per layer, "
                 "L x per-layer size); the memory goal compares the offload row's device memory with "
                 "save-on-device's: (save - row) >= 95% of that.")
    if args.timeline:
        notes.append("peak device (--timeline): the most device memory in use at any one moment of the timed "
                     "run, driver-level (cuMemGetInfo: total - free, sampled every 100 us by "
                     "jaxvmm.memory_timeline; cpu: jaxvmm's mapped bytes only), above what was in use before "
                     "the parameters were made; children ran with XLA_PYTHON_CLIENT_ALLOCATOR=platform, so "
                     "XLA's freed buffers go back to the driver and the figure is XLA's live bytes plus "
                     "jaxvmm's pages at the same moment, not a sum of two peaks. '(jaxvmm X at peak)': "
                     "jaxvmm's staging and graph-mode pages mapped at that moment.")
    elif any_peak:
        notes.append("peak device: XLA allocator's peak_bytes_in_use over the child's life (parameters, "
                     "gradients and input included; compiled before anything was allocated) + jaxvmm's "
                     "peak_mapped_bytes (staging pages live outside XLA's allocator; the two peaks need not "
                     "coincide, so the sum is an upper bound).")
    else:
        notes.append("peak device: n/a (this platform's memory_stats() reports nothing); the memory goal "
                     "uses XLA temp + jaxvmm's peak mapped staging bytes instead.")
    notes.append("host: jaxvmm = pinned pool bytes in use at peak / pinned pool size; JAX native = XLA's "
                 "host_temp_size_in_bytes from memory_analysis (n/a where not exposed).")
    notes.append("prefetch hit/miss: jaxvmm reloads over the timed steps whose H2D copy the engine started "
                 "ahead of need / that it did not.")
    notes.append("block_input: a checkpointed scan body keeps its inputs as residuals, so full remat and "
                 "save-on-device both hold every layer's input; offloading the named input is what frees it.")
    if not on_gpu:
        notes.append("cpu platform: the time and memory goals are for GPUs; the POSIX backend copies "
                     "synchronously inside the call and tiny shapes are dominated by overheads, so cpu runs "
                     "check the harness, not the goals.")
    if args.small:
        notes.append("--small shapes: XLA temp is dominated by buffers unrelated to the residuals; memory "
                     "ratios at these sizes are not meaningful.")
    n_pass = sum(all(v.values()) for _, v in verdicts)
    notes.append(f"goals: offload step time <= {GOAL_TIME['block_input']}x save-on-device for block_input, "
                 f"<= {GOAL_TIME['mlp_hidden']}x for mlp_hidden; device memory reduced by >= "
                 f"{GOAL_MEM:.0%} of the offloaded bytes. {n_pass}/{len(verdicts)} offload rows meet all "
                 "their goals.")

    table = render(rows)
    footer = ["- " + n for n in notes]
    print()
    print(table)
    print()
    print("\n".join(footer))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join("    " + h for h in header) + "\n\n" + table + "\n\n" + "\n".join(footer) + "\n")
    print(f"wrote {args.out}")
    plot_path = args.plot or os.path.splitext(args.out)[0] + ".png"
    print(plot(results, args.models, args.targets, variants, plot_path, mem_label))
    return 1 if failed_required else 0


if __name__ == "__main__":
    sys.exit(main())
