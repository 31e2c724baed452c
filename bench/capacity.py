"""Capacity under a fixed device budget: the largest model (layer count, or batch) that trains one step
with each way of handling remat residuals, and how fast it trains at that size.

    python bench/capacity.py                                  # GPU: 24 GiB budget, GPT block scan
    python bench/capacity.py --quick                          # ~2 minutes on an H200
    python bench/capacity.py --markdown --out capacity.md --plot capacity.png
    python bench/capacity.py --budget 16M                     # cpu: tiny shapes (the default there)

Budget. On a GPU, each trial first holds ``free - budget`` bytes of device memory (``jaxvmm.Ballast``,
made before jax initializes), so XLA and jaxvmm share one limit of ``--budget`` bytes. Trials run with
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` and, by default, ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (XLA
returns each buffer to the driver when it frees it, so memory it no longer needs is there for jaxvmm's
staging pages; ``--allocator bfc`` uses XLA's default pool instead). A size fits if it compiles and
runs ``--warmup + --steps`` steps without running out of memory. On the cpu platform there is no device
memory to run out of: a size fits if XLA's planned memory for the step (``memory_analysis``: arguments +
outputs + temporaries - donated aliases) plus jaxvmm's peak staging bytes is within the budget, so cpu
runs check the harness and the search, not capacity.

Search. For each policy: from ``--start``, double (or halve) until a size fits and a larger one does
not (within ``[--min, --max]``), then bisect until the two are ``--precision`` apart. Every trial is a
fresh process (an OOM cannot poison the next one). Policies advance in rounds (one trial each per
round) and the table so far is printed after every round, so a ``--time-limit`` cut still leaves a
bracket for each policy. Afterwards, full remat is timed at each other policy's largest size (if time
is left and remat fits there) for the "vs remat" column.

Policies (each wraps the same layer of bench/train_step.py; ``--names`` are the offloaded names):

  save           jax.checkpoint(policy=dots_with_no_batch_dims_saveable): every matmul output saved on
                 device (nothing recomputed but cheap elementwise work)
  remat          jax.checkpoint(policy=nothing_saveable): full recompute
  native         jax.checkpoint(policy=save_and_offload_only_these_names(names_which_can_be_saved=[],
                 names_which_can_be_offloaded=NAMES, offload_src="device", offload_dst="pinned_host"))
  jaxvmm-hidden  jaxvmm.checkpoint(policy=jaxvmm.policies.offload_only_these_names(*NAMES))
  jaxvmm-dots    jaxvmm.checkpoint(policy=jaxvmm.policies.offload_dot_with_no_batch_dims())
  (extra, not run by default: native-dots = jax's offload_dot_with_no_batch_dims to pinned_host;
   save-hidden = save_only_these_names(*NAMES))
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common
import train_step as ts  # the model builders: make_layer, init_arrays, specs, shapes

MiB, GiB = _common.MiB, _common.GiB
POLICIES = ("save", "remat", "native", "jaxvmm-hidden", "jaxvmm-dots", "native-dots", "save-hidden")
DEFAULT_POLICIES = ("save", "remat", "native", "jaxvmm-hidden", "jaxvmm-dots")
LABEL = {"save": "save on device (dots)", "remat": "full remat", "native": "JAX native offload (names)",
         "jaxvmm-hidden": "jaxvmm offload (names)", "jaxvmm-dots": "jaxvmm offload (dots)",
         "native-dots": "JAX native offload (dots)", "save-hidden": "save on device (names)"}
RESULT_TAG = "@@CAPACITY_RESULT "
OOM_WORDS = ("RESOURCE_EXHAUSTED", "out of memory", "OutOfMemory", "OUT_OF_MEMORY", "Out of memory")


def human(n) -> str:
    return ts.human(n)


# ---------------------------------------------------------------- child: one trial


def wrap_policy(layer, policy: str, names: list[str]):
    import jax

    cp = jax.checkpoint_policies
    if policy == "save":
        return jax.checkpoint(layer, policy=cp.dots_with_no_batch_dims_saveable)
    if policy == "save-hidden":
        return jax.checkpoint(layer, policy=cp.save_only_these_names(*names))
    if policy == "remat":
        return jax.checkpoint(layer, policy=cp.nothing_saveable)
    if policy == "native":
        return jax.checkpoint(layer, policy=cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
            offload_src="device", offload_dst="pinned_host"))
    if policy == "native-dots":
        return jax.checkpoint(layer, policy=cp.offload_dot_with_no_batch_dims("device", "pinned_host"))
    import jaxvmm

    if policy == "jaxvmm-hidden":
        return jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_only_these_names(*names))
    if policy == "jaxvmm-dots":
        return jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_dot_with_no_batch_dims())
    raise ValueError(f"unknown policy {policy!r}")


def shapes(args, n: int, small: bool):
    import dataclasses

    s = ts.shapes_for(args.model, small, None)
    if args.width:
        s = dataclasses.replace(s, width=args.width, heads=max(1, args.width // 128) if args.model == "gpt" else 0)
    if args.seq and args.model == "gpt":
        s = dataclasses.replace(s, seq=args.seq)
    if args.batch:
        s = dataclasses.replace(s, batch=args.batch)
    elif args.model == "gpt" and not small:
        s = dataclasses.replace(s, batch=4)  # the GPT shape: 4 x 2048 tokens
    if args.layers:
        s = dataclasses.replace(s, layers=args.layers)
    if args.search == "layers":
        s = dataclasses.replace(s, layers=n)
    else:
        s = dataclasses.replace(s, batch=n * batch_unit(args, small))
    return s


def batch_unit(args, small: bool) -> int:
    if args.batch_unit:
        return args.batch_unit
    return 1 if args.model == "gpt" else (16 if small else 1024)


def is_oom(text: str) -> bool:
    return any(w in text for w in OOM_WORDS)


def run_probe() -> dict:
    import jax

    dev = jax.devices()[0]
    out = {"backend": jax.default_backend(), "device": str(dev), "kind": dev.device_kind, "jax": jax.__version__}
    try:
        import jaxvmm

        out["jaxvmm"] = jaxvmm.__version__
        if out["backend"] == "gpu":
            free, total = jaxvmm.driver_memory_info(dev)
            out["mem_free"], out["mem_total"] = free, total
    except Exception as e:  # noqa: BLE001
        out["jaxvmm_error"] = f"{type(e).__name__}: {e}"
    return out


def run_trial(args, policy: str, n: int) -> dict:
    res: dict = {"policy": policy, "n": n, "budget": args.budget}
    ballast = None
    base_used = None
    import jaxvmm

    first_platform = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    on_gpu = first_platform in ("", "cuda", "gpu") and bool(jaxvmm.cuda_available())
    if on_gpu:
        t0 = time.perf_counter()
        ballast = jaxvmm.Ballast(args.budget)  # before jax initializes: XLA and jaxvmm share the rest
        res["ballast_s"] = time.perf_counter() - t0
        if ballast.nbytes == 0:
            res["note"] = (f"no ballast: only {human(ballast.free_before_bytes)} free, not more than the budget "
                           f"{human(args.budget)}")
        res["ballast_bytes"] = ballast.nbytes
        res["free_after_ballast"] = ballast.free_after_bytes
        base_used = ballast.total_bytes - ballast.free_after_bytes
    import warnings

    warnings.filterwarnings("ignore", message=".*[Dd]onat.*")
    import jax

    on_gpu = jax.default_backend() == "gpu"
    small = args.small if args.small is not None else not on_gpu
    s = shapes(args, n, small)
    res["shape"] = {"batch": s.batch, "seq": s.seq, "width": s.width, "layers": s.layers, "heads": s.heads}
    names = [x for x in args.names.split(",") if x]
    attn = args.attention if args.attention != "auto" else ("cudnn" if on_gpu else "xla")
    p_spec, x_spec = ts.specs(args.model, s)
    stage = "compile"
    try:
        while True:
            try:
                body = wrap_policy(ts.make_layer(args.model, s, attn), policy, names)
                compiled = ts.build_step_from_body(body).lower(p_spec, x_spec).compile()
                break
            except Exception as e:  # noqa: BLE001
                if args.model == "gpt" and args.attention == "auto" and attn == "cudnn" and not is_oom(str(e)):
                    attn = "xla"
                    continue
                raise
        if args.model == "gpt":
            res["attention"] = attn
        mem = compiled.memory_analysis()
        if mem is not None:
            planned = (int(mem.argument_size_in_bytes) + int(mem.output_size_in_bytes)
                       + int(mem.temp_size_in_bytes) - int(mem.alias_size_in_bytes))
            res["planned_bytes"] = planned
            host_temp = getattr(mem, "host_temp_size_in_bytes", None)
            res["xla_host_temp_bytes"] = int(host_temp) if host_temp else 0
        stage = "run"
        dev = jax.devices()[0]
        if args.reserve_host and policy.startswith("jaxvmm"):
            jaxvmm.reserve_host(args.reserve_host, dev)  # a step's worth pinned before the first step
        times, every, losses, pinned, staging = [], [], [], [], []
        with jaxvmm.memory_timeline(dev, interval_us=args.interval_us) as tl:
            params, x = ts.init_arrays(args.model, s)
            jax.block_until_ready((params, x))
            for i in range(args.warmup + args.steps):
                jaxvmm.reset_peaks()
                t0 = time.perf_counter()
                loss, params = compiled(params, x)
                jax.block_until_ready((loss, params))
                dt = time.perf_counter() - t0
                jaxvmm.synchronize()
                jaxvmm.check()
                h = jaxvmm.host_stats()
                pinned.append(h["window_peak_in_use_bytes"])
                staging.append(h["staging_window_peak_bytes"])
                losses.append(float(loss))
                every.append(dt)
                if i >= args.warmup:
                    times.append(dt)
            del params, x
        if not all(math.isfinite(v) for v in losses):
            raise FloatingPointError(f"non-finite loss: {losses}")
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
        first = next((ln for ln in msg.splitlines() if ln.strip()), msg)[:300]
        res.update(status="oom" if is_oom(msg) else "error", stage=stage, error=first)
        return res
    finally:
        if ballast is not None:
            ballast.close()
    res["step_s"] = statistics.median(times)
    res["every_step_s"] = [round(t, 4) for t in every]  # warm-up steps first
    res["steps"] = len(times)
    res["pinned_step_peak_bytes"] = max(pinned) if pinned else 0
    res["staging_step_peak_bytes"] = max(staging) if staging else 0
    res["timeline_samples"] = tl.samples_taken
    res["internal_at_peak_bytes"] = tl.internal_at_peak_bytes
    # What a slow trial's engine did (graph mode): rounds that waited for the poller, cells that got host
    # pages because the device was full, round tickets in pageable memory.
    eng = {}
    for d in jaxvmm.engine_stats().values():
        for k in ("graph_grants_device", "graph_grants_host", "graph_cells_host", "graph_host_fallbacks",
                  "graph_lends", "graph_misses"):
            eng[k] = eng.get(k, 0) + int(d.get(k, 0))
    res["engine"] = eng
    if on_gpu:
        # driver-level, above what was in use after the ballast (no ballast: at the timeline's start)
        res["device_peak_bytes"] = tl.peak_used_bytes - (base_used if base_used is not None else tl.first_used_bytes)
        res["status"] = "fit"
    else:
        # cpu: no device memory to run out of; fit = planned XLA memory + jaxvmm's staging peak <= budget
        need = res.get("planned_bytes", 0) + res["staging_step_peak_bytes"]
        res["device_peak_bytes"] = need
        res["status"] = "fit" if need <= args.budget else "oom"
        if res["status"] == "oom":
            res["error"] = f"planned {human(need)} > budget {human(args.budget)}"
    return res


# ---------------------------------------------------------------- parent: search


class Search:
    """Doubling, then bisection, over n in [lo_bound, hi_bound] until the largest size known to fit and
    the smallest known not to are `precision` apart. With `budget`, the measured peaks of the sizes that
    fit guide the next size (memory grows linearly with the layer count of a scan): a line through them
    (or, with one point, peak/n per layer, which overestimates the slope) predicts the largest size
    within the budget, and the next trial is that prediction, kept inside the current bracket and at
    least `precision` past the largest fit (so a wrong prediction costs a trial, never the search)."""

    def __init__(self, start: int, lo_bound: int, hi_bound: int, precision: int, budget: int | None = None):
        self.start, self.min, self.max, self.precision = start, lo_bound, hi_bound, precision
        self.budget = budget
        self.fit = 0        # largest n known to fit (0: none)
        self.fail = None    # smallest n known not to fit
        self.trials: dict[int, dict] = {}

    def predict(self) -> int | None:
        pts = sorted((n, r["device_peak_bytes"]) for n, r in self.trials.items()
                     if r.get("status") == "fit" and r.get("device_peak_bytes"))
        if not self.budget or not pts:
            return None
        if len(pts) == 1:
            n, peak = pts[0]
            return int(n * self.budget // peak)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        if b <= 0:
            return None
        return int((self.budget - (my - b * mx)) // b)

    def next(self) -> int | None:
        if self.fit == 0 and self.fail is None:
            return self.start
        if self.fail is None and self.fit >= self.max:
            return None
        if self.fit == 0:
            return None if self.fail <= self.min else max(self.min, self.fail // 2)
        if self.fail is not None and self.fail - self.fit <= self.precision:
            return None
        hi = self.max if self.fail is None else self.fail - 1
        blind = min(self.max, self.fit * 2) if self.fail is None else (self.fit + self.fail) // 2
        est = self.predict()
        if est is None:
            return blind
        return max(self.fit + 1, min(hi, max(est, self.fit + self.precision)))

    def record(self, n: int, r: dict) -> None:
        self.trials[n] = r
        if r.get("status") == "fit":
            self.fit = max(self.fit, n)
        else:
            self.fail = n if self.fail is None else min(self.fail, n)

    @property
    def done(self) -> bool:
        return self.next() is None

    def bracket(self) -> str:
        if self.fit == 0:
            return f"< {self.fail}" if self.fail is not None else "?"
        if self.fail is None:
            return f">= {self.fit} (cap)" if self.fit >= self.max else f">= {self.fit}"
        return f"{self.fit}" if self.fail == self.fit + 1 else f"{self.fit} (< {self.fail})"


def spawn(cmd: list[str], env_extra: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(1.0, timeout),
                              check=False)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            r = json.loads(line[len(RESULT_TAG):])
            r["wall_s"] = wall
            return r
    text = proc.stderr + "\n" + proc.stdout
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ("Error" in ln or "error" in ln) and not ln.startswith(("File ", "^"))]
    why = (errs or lines or [f"exit status {proc.returncode}, no output"])[-1][:300]
    return {"status": "oom" if is_oom(text) else "error", "error": f"exit {proc.returncode}: {why}", "wall_s": wall}


def child_env(args) -> dict:
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if args.allocator != "bfc":
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = args.allocator
    return env


def fmt_ms(s) -> str:
    return "" if s is None else f"{s * 1e3:,.1f}"


def table(args, searches: dict, remat_at: dict, on_gpu: bool) -> tuple[list[str], list[list[str]], set]:
    unit = "L" if args.search == "layers" else "batch"
    headers = ["policy", f"max {unit}", f"step ms at max {unit}", f"vs full remat at same {unit}",
               "pinned host peak/step", "device peak" + (" (driver)" if on_gpu else " (planned)"),
               "jaxvmm mapped at peak", "trials"]
    rows = []
    for p, sr in searches.items():
        r = sr.trials.get(sr.fit) if sr.fit else None
        step = r.get("step_s") if r else None
        vs = ""
        if r and p != "remat":
            rm = remat_at.get(sr.fit)
            if rm is None:
                vs = "not run"
            elif rm.get("status") == "fit":
                vs = f"{step / rm['step_s']:.3f}x" + (" (~)" if rm.get("interpolated") else "")
            else:
                vs = "remat does not fit"
        elif r:
            vs = "1.000x"
        host = ""
        if r:
            if p.startswith("jaxvmm"):
                host = human(r.get("pinned_step_peak_bytes", 0))
            elif p.startswith("native"):
                host = f"{human(r['xla_host_temp_bytes'])} (XLA)" if r.get("xla_host_temp_bytes") else "n/a"
        peak = human(r["device_peak_bytes"]) if r and r.get("device_peak_bytes") is not None else ""
        if peak and args.budget:
            peak += f" ({r['device_peak_bytes'] / args.budget:.0%})"
        mapped = human(r.get("internal_at_peak_bytes", 0)) if r and p.startswith("jaxvmm") else ""
        ntr = len(sr.trials)
        rows.append([LABEL[p], sr.bracket(), fmt_ms(step), vs, host, peak, mapped, str(ntr)])
    return headers, rows, {1, 2, 3, 4, 5, 6, 7}


def render(headers, right, rows, markdown: bool) -> str:
    """Markdown, or aligned plain text (one line per policy)."""
    if markdown:
        return _common.render(headers, right, rows, True)
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def interpolate_remat(sr: Search, n: int) -> dict | None:
    """Remat step time at n from a least-squares line through remat's timed trials (>= 2 sizes that fit)."""
    pts = sorted((k, v["step_s"]) for k, v in sr.trials.items() if v.get("status") == "fit" and v.get("step_s"))
    if len(pts) < 2 or (sr.fail is not None and n >= sr.fail):
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return {"status": "fit", "step_s": my + b * (n - mx), "interpolated": True}


def plot(args, searches: dict, remat_at: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    labels = [LABEL[p] for p in searches]
    maxes = [sr.fit for sr in searches.values()]
    ratios = []
    for p, sr in searches.items():
        r, rm = sr.trials.get(sr.fit), remat_at.get(sr.fit)
        ok = r and rm and rm.get("status") == "fit" and r.get("step_s")
        ratios.append(r["step_s"] / rm["step_s"] if ok else 0.0)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].barh(labels, maxes)
    axes[0].set_xlabel(f"largest {'layer count' if args.search == 'layers' else 'batch'} that trains "
                       f"within {human(args.budget)}")
    axes[1].barh(labels, ratios)
    axes[1].axvline(1.0, color="gray", lw=0.8)
    axes[1].set_xlabel("step time / full remat at the same size (0: n/a)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=ts.MODELS, default="gpt", help="gpt (default) or mlp (bench/train_step.py)")
    ap.add_argument("--search", choices=("layers", "batch"), default="layers",
                    help="what grows: the layer count (default) or the batch (--batch-unit rows per step of n)")
    ap.add_argument("--policies", type=ts.csv_choice(POLICIES), default=list(DEFAULT_POLICIES),
                    help="comma-separated: " + ",".join(POLICIES))
    ap.add_argument("--names", default="block_input,mlp_hidden",
                    help="names the 'native' and 'jaxvmm-hidden' policies offload (default block_input,mlp_hidden)")
    ap.add_argument("--budget", type=_common.parse_size, default=None,
                    help="device budget (default 24G on GPU, 16M on cpu), e.g. 24G, 512M")
    ap.add_argument("--min", type=int, default=None, help="smallest n tried (default 4 layers / 1 batch unit)")
    ap.add_argument("--max", type=int, default=64, help="largest n tried (default 64)")
    ap.add_argument("--start", type=int, default=None, help="first n tried (default 16 layers / 4 batch units)")
    ap.add_argument("--precision", type=int, default=None, help="stop bisecting at this gap (default 1: the exact largest size; --quick 8)")
    ap.add_argument("--no-guide", dest="guide", action="store_false",
                    help="plain doubling and bisection (default: the measured peaks guide the next size)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per trial (default 3; --quick 2)")
    # Three: near the budget the pinned pool is still growing over the first steps (round tickets
    # beyond it go to pageable memory, each copied by the poller), which the first timed steps measured.
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--reserve-host", default=None, metavar="SIZE",
                    help="jaxvmm policies: jaxvmm.reserve_host(SIZE) before the first step (e.g. 14G)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds for the whole run (default 320; --quick 130); the last trials are cut short")
    ap.add_argument("--quick", action="store_true", help="coarse search, fewer steps: ~2 minutes on an H200")
    ap.add_argument("--allocator", choices=("platform", "bfc", "cuda_async"), default="platform",
                    help="XLA_PYTHON_CLIENT_ALLOCATOR for the trials (bfc: XLA's default pool)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--small", dest="small", action="store_const", const=True, default=None,
                      help="tiny shapes (bench/train_step.py --small); the default on cpu")
    size.add_argument("--full", dest="small", action="store_const", const=False, help="full shapes even on cpu")
    ap.add_argument("--width", type=int, default=None, help="model width (gpt: heads of 128)")
    ap.add_argument("--seq", type=int, default=None, help="gpt sequence length")
    ap.add_argument("--batch", type=int, default=None, help="batch when searching layers (gpt default 4)")
    ap.add_argument("--layers", type=int, default=None, help="layers when searching the batch")
    ap.add_argument("--batch-unit", type=int, default=None, help="rows per batch step (gpt 1, mlp 1024)")
    ap.add_argument("--attention", choices=("auto", "xla", "cudnn", "einsum"), default="auto")
    ap.add_argument("--interval-us", type=float, default=100.0, help="memory timeline sampling interval")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--out", default=None, help="also write header, table and notes to this file")
    ap.add_argument("--json", default=None, help="also write every trial's raw result (JSON)")
    ap.add_argument("--plot", default=None, help="PNG: largest size and step-time ratio per policy (matplotlib)")
    ap.add_argument("--trial", nargs=2, metavar=("POLICY", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.probe:
        print(RESULT_TAG + json.dumps(run_probe()), flush=True)
        return 0
    if args.quick:
        args.precision = args.precision or 8
        args.steps = args.steps or 2
        args.time_limit = args.time_limit or 130.0
    args.precision = max(1, args.precision or 1)
    args.steps = args.steps or 3
    args.time_limit = args.time_limit or 320.0
    layers = args.search == "layers"
    args.min = args.min or (4 if layers else 1)
    args.start = args.start or (16 if layers else 4)
    if args.trial:
        pol, n = args.trial[0], int(args.trial[1])
        if args.budget is None:
            ap.error("--trial needs --budget")
        print(RESULT_TAG + json.dumps(run_trial(args, pol, n)), flush=True)
        return 0
    if not 1 <= args.min <= args.start <= args.max:
        ap.error("need 1 <= --min <= --start <= --max")

    t_start = time.monotonic()
    deadline = t_start + args.time_limit
    me = [sys.executable, os.path.abspath(__file__)]
    probe = spawn(me + ["--probe"], child_env(args), max(30.0, min(120.0, args.time_limit / 3)))
    if "backend" not in probe:
        print(f"probe failed: {probe.get('error')}", file=sys.stderr)
        return 1
    on_gpu = probe["backend"] == "gpu"
    if args.budget is None:
        args.budget = 24 * GiB if on_gpu else 16 * MiB
    if args.small is None:
        args.small = not on_gpu
    fwd = [a for a in argv if a not in ("--markdown",)]
    if "--budget" not in " ".join(fwd):
        fwd += ["--budget", f"{args.budget // 1024}K"]  # (a bare number would be MiB)
    fwd += ["--small" if args.small else "--full"] if "--small" not in fwd and "--full" not in fwd else []

    s_lo = shapes(args, args.min, args.small)
    unit = "layers" if layers else f"batch units of {batch_unit(args, args.small)}"
    model_line = ts.describe(args.model, s_lo)
    model_line = model_line.replace(f"L={s_lo.layers}", "L=n") if layers else model_line
    guided = " (guided by the measured peaks)" if args.guide else ""
    header = [
        f"jaxvmm {probe.get('jaxvmm', '?')} capacity: the largest {'layer count' if layers else 'batch'} that "
        f"trains one step within a {human(args.budget)} device budget",
        f"device:    {probe['device']} ({probe['kind']}), jax {probe['jax']}"
        + (f", {probe['mem_total'] / GiB:,.1f} GiB" if probe.get("mem_total") else ""),
        f"model:     {model_line}" + ("" if layers else f" (batch = n x {batch_unit(args, args.small)})"),
        f"search:    n in [{args.min}, {args.max}] {unit}, start {args.start}, doubling then bisection to "
        f"{args.precision}{guided}; {args.warmup} warm-up + {args.steps} timed steps per trial; "
        f"time limit {args.time_limit:.0f} s",
        ("budget:    jaxvmm.Ballast holds free - budget before jax starts; XLA_PYTHON_CLIENT_PREALLOCATE=false, "
         f"XLA_PYTHON_CLIENT_ALLOCATOR={args.allocator if args.allocator != 'bfc' else '(default: bfc)'}; "
         "device peak = driver-level used memory (cuMemGetInfo every "
         f"{args.interval_us:g} us, jaxvmm.memory_timeline) above what was used after the ballast")
        if on_gpu else
        ("budget:    cpu platform: no device memory to run out of; a size fits if XLA's planned memory "
         "(memory_analysis) + jaxvmm's peak staging bytes <= budget (checks the harness, not capacity)"),
        f"offloaded names (native, jaxvmm-hidden): {args.names}",
    ]
    print("\n".join(header), flush=True)

    guide = args.budget if args.guide else None
    searches = {p: Search(args.start, args.min, args.max, args.precision, guide) for p in args.policies}
    remat_at: dict[int, dict] = {}
    all_trials: list[dict] = []
    cut = False

    def run(policy: str, n: int) -> dict | None:
        nonlocal cut
        left = deadline - time.monotonic()
        if left < 5:
            cut = True
            return None
        print(f"  {policy} n={n} ...", end="", file=sys.stderr, flush=True)
        r = spawn(me + fwd + ["--trial", policy, str(n)], child_env(args), left)
        r.setdefault("policy", policy)
        r.setdefault("n", n)
        if r.get("status") == "timeout" and deadline - time.monotonic() < 5:
            cut = True
            print(f" cut by the time limit ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            return None
        all_trials.append(r)
        what = (f"fits, {r['step_s'] * 1e3:,.1f} ms/step, peak {human(r.get('device_peak_bytes'))}"
                if r.get("status") == "fit" else f"{r.get('status')}: {r.get('error', '')[:160]}")
        print(f" {what} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        return r

    def show(final: bool) -> str:
        h, rows, right = table(args, searches, remat_at, on_gpu)
        body = render(h, right, rows, args.markdown)
        if not final:
            print("\n" + body + "\n", flush=True)
        return body

    rnd = 0
    while not cut and any(not sr.done for sr in searches.values()):
        rnd += 1
        for p, sr in searches.items():
            n = sr.next()
            if n is None or cut:
                continue
            r = run(p, n)
            if r is None:
                break
            sr.record(n, r)
            if p == "remat":
                remat_at[n] = r
        if not cut and any(not sr.done for sr in searches.values()):
            print(f"after round {rnd} ({time.monotonic() - t_start:.0f} s):", flush=True)
            show(final=False)

    # Full remat at each other policy's largest size, for the ratio column.
    rsr = searches.get("remat")
    for p, sr in searches.items():
        if p == "remat" or not sr.fit or sr.fit in remat_at:
            continue
        if rsr is not None and rsr.fail is not None and sr.fit >= rsr.fail:
            remat_at[sr.fit] = {"status": "oom"}
            continue
        r = None if cut else run("remat", sr.fit)
        if r is not None:
            remat_at[sr.fit] = r
            if rsr is not None:
                rsr.record(sr.fit, r)
        elif rsr is not None:
            est = interpolate_remat(rsr, sr.fit)
            if est is not None:
                remat_at[sr.fit] = est

    notes = [
        f"max {'L' if layers else 'batch'}: largest size that trained (compile + {args.warmup + args.steps} steps) "
        "within the budget; '(< k)': k did not fit and the bisection stopped there; '>= n (cap)': n = --max "
        "fit (raise --max to look further); '< n': even the smallest size tried failed.",
        "step ms: median of the timed steps at that size (jitted value_and_grad + SGD, params donated, "
        "block_until_ready each step).",
        "vs full remat: step time / full remat's step time at the same size ('(~)': remat's time interpolated "
        "from its other trials because the time limit came first; 'remat does not fit': remat ran out of "
        "memory at that size).",
        "pinned host peak/step: jaxvmm's pinned host bytes in use, peak within one step (jaxvmm.reset_peaks() "
        "before each step, jaxvmm.host_stats()['window_peak_in_use_bytes'] after), the most of any step; "
        "native: XLA's host_temp_size_in_bytes.",
        ("device peak (driver): the most device memory in use at any moment of the run (parameters, gradients, "
         "XLA's buffers and jaxvmm's pages together), above what was in use after the ballast; % of the budget."
         if on_gpu else
         "device peak (planned): XLA's planned bytes for the step + jaxvmm's staging peak (cpu: no driver-level "
         "measurement)."),
        "jaxvmm mapped at peak: jaxvmm's own pages (staging and graph-mode cells) mapped at the moment of the "
        "device peak.",
    ]
    if cut:
        notes.append(f"the time limit ({args.time_limit:.0f} s) cut the search: brackets are as far as it got.")
    errs = [t for t in all_trials if t.get("status") not in ("fit", "oom")]
    for t in errs[:8]:
        notes.append(f"{t['policy']} n={t['n']}: {t.get('status')}: {t.get('error', '')[:200]} "
                     "(counted as not fitting)")
    notes.extend(sorted({t["note"] for t in all_trials if t.get("note")}))
    if not on_gpu:
        notes.append("cpu platform: JAX native offload has no separate host memory space here (it moves "
                     "nothing); times are dominated by overheads. GPU figures are what this bench is for.")
    notes.append(f"wall time {time.monotonic() - t_start:.0f} s, {len(all_trials)} trials.")
    body = show(final=True)
    _common.emit(header, body, notes, args.markdown, args.out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"probe": probe, "trials": all_trials}, f, indent=1)
    if args.plot:
        made = plot(args, searches, remat_at, args.plot)
        if made:
            print(f"plot: {made}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
