"""bench/capacity.py on the cpu platform: the search logic (pure Python) and one end-to-end run with tiny
shapes (a few fresh trial processes; well under a minute)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def capacity():
    sys.path.insert(0, str(BENCH))
    try:
        import capacity as mod
    finally:
        sys.path.remove(str(BENCH))
    return mod


@pytest.mark.parametrize("limit", [4, 5, 13, 16, 17, 40, 63, 64, 100])
def test_search_brackets_the_limit(capacity, limit):
    s = capacity.Search(start=16, lo_bound=4, hi_bound=64, precision=2)
    trials = 0
    while not s.done:
        n = s.next()
        assert 4 <= n <= 64 and n not in s.trials  # never repeats a size, stays in bounds
        s.record(n, {"status": "fit" if n <= limit else "oom"})
        trials += 1
    assert trials <= 7
    if limit >= 64:
        assert s.fit == 64 and s.fail is None and "cap" in s.bracket()
    elif limit < 4:
        assert s.fit == 0
    else:
        assert s.fit <= limit < s.fail and s.fail - s.fit <= 2, (s.fit, s.fail)


@pytest.mark.parametrize("a,b", [(1.5, 0.83), (0.5, 0.3), (6.0, 2.1), (0.1, 0.05), (20.0, 1.0)])
def test_guided_search_finds_a_linear_limit_in_few_trials(capacity, a, b):
    """Peak = a + b*n GiB against a 24 GiB budget (with a little noise): the guided search ends on the
    exact limit (precision 1) within a few trials."""
    GiB = 1 << 30
    budget = 24 * GiB
    limit = int((24 - a) // b)
    s = capacity.Search(start=16, lo_bound=4, hi_bound=64, precision=1, budget=budget)
    trials = 0
    while not s.done:
        n = s.next()
        assert n not in s.trials and 4 <= n <= 64
        peak = int((a + b * n) * GiB * (1 + 0.002 * ((n * 7) % 3 - 1)))
        s.record(n, {"status": "fit" if peak <= budget else "oom", "device_peak_bytes": peak})
        trials += 1
    if limit >= 64:
        assert s.fit == 64
    elif limit < 4:
        assert s.fit == 0
    else:
        assert s.fit in (limit - 1, limit) and s.fail == s.fit + 1, (limit, s.fit, s.fail, sorted(s.trials))
    assert trials <= 6, sorted(s.trials)


def test_search_below_the_minimum(capacity):
    s = capacity.Search(start=16, lo_bound=4, hi_bound=64, precision=2)
    while not s.done:
        s.record(s.next(), {"status": "oom"})
    assert s.fit == 0 and s.fail == 4 and s.bracket() == "< 4"


def test_capacity_runs_end_to_end_on_cpu(tmp_path):
    out, js = tmp_path / "cap.md", tmp_path / "cap.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(BENCH / "capacity.py"), "--model", "mlp",  # cpu default budget: 16 MiB
           "--policies", "remat,jaxvmm-hidden", "--start", "4", "--min", "4", "--max", "4",
           "--steps", "1", "--warmup", "0", "--time-limit", "100", "--markdown", "--out", str(out), "--json", str(js)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    assert "| full remat | >= 4 (cap) |" in text, text
    assert "| jaxvmm offload (names) | >= 4 (cap) |" in text, text
    trials = json.loads(js.read_text())["trials"]
    assert {(t["policy"], t["n"], t["status"]) for t in trials} == {("remat", 4, "fit"), ("jaxvmm-hidden", 4, "fit")}
    assert all(t["budget"] == 16 << 20 for t in trials), trials  # the parent's default reached the trials
    assert "within a 16.00 MiB device budget" in text
    vm = next(t for t in trials if t["policy"] == "jaxvmm-hidden")
    # B=64 x D=128 bf16 block inputs (16 KiB) and hidden activations (64 KiB) of 4 layers go to pinned host
    assert vm["pinned_step_peak_bytes"] >= 4 * (16 + 64) * 1024, vm
    assert vm["staging_step_peak_bytes"] > 0 and vm["device_peak_bytes"] > vm["planned_bytes"], vm
    assert "x |" in text  # the jaxvmm row has a ratio against remat at the same L


def test_train_step_engine_totals_sum_the_counters_only():
    """bench/train_step.py sums every engine's counters; engine_stats() also names the host store (a
    string), which once made every jaxvmm row of the bench fail."""
    import jax.numpy as jnp
    import jaxvmm

    sys.path.insert(0, str(BENCH))
    try:
        import train_step
    finally:
        sys.path.remove(str(BENCH))
    x = jnp.arange(1024, dtype=jnp.float32)
    before = train_step._engine_totals(jaxvmm)
    y = jaxvmm.reload(jaxvmm.offload(x))
    assert bool(jnp.array_equal(y, x))
    after = train_step._engine_totals(jaxvmm)
    assert after["offloads"] - before["offloads"] == 1 and after["reloads"] - before["reloads"] == 1


def test_train_step_repeat_alternates_processes_and_reports_each_ratio(tmp_path):
    """bench/train_step.py --repeat 2: two processes per variant (save, jaxvmm, save, jaxvmm), the
    median of each in the table, and a note with the two per-run ratios; --autotune-cache reaches the
    children's XLA_FLAGS (a flag XLA does not know would stop them)."""
    out = tmp_path / "ts.md"
    proc = subprocess.run([sys.executable, str(BENCH / "train_step.py"), "--small", "--models", "mlp", "--targets",
                           "mlp_hidden", "--variants", "save,jaxvmm", "--mlp-shape", "16,32,2", "--steps", "2",
                           "--warmup", "1", "--repeat", "2", "--autotune-cache", str(tmp_path / "at"),
                           "--out", str(out), "--plot", str(tmp_path / "ts.png")],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.stderr.count("mlp / mlp_hidden / save #") == 2 and proc.stderr.count("mlp / mlp_hidden / jaxvmm #") == 2
    notes = [ln for ln in proc.stdout.splitlines() if "per-run ratios" in ln]
    assert len(notes) == 1 and "2 pairs" in notes[0], proc.stdout
    assert "median of 2 alternating processes" in proc.stdout


def test_graph_rounds_runs_on_cpu():
    """bench/graph_rounds.py end to end on the POSIX backend (which stands for an sm_90 device: the copy
    and the publish launched early): the rounds replayed, and none waited for the host (every cell armed
    ahead)."""
    proc = subprocess.run([sys.executable, str(BENCH / "graph_rounds.py"), "--device", "cpu", "--rounds", "4",
                           "--reps", "3", "--size", "16K"],
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=120, cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| early launches |")]
    assert len(rows) == 1, proc.stdout
    assert all(ln.rstrip().endswith("| 0 |") for ln in rows), proc.stdout
