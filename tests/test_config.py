"""JAXVMM_* environment variables and ``jaxvmm.configure``: one parser (jaxvmm/_config.py), sizes with
suffixes, bad values refused by name, and a pinned-pool limit that is enforced even when lowered."""

from __future__ import annotations

import textwrap

import pytest

import jaxvmm
from jaxvmm import _config
from jaxvmm._native import lib

from conftest import run_in_subprocess

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ENV = {"JAX_PLATFORMS": "cpu"}


@pytest.mark.parametrize("text,want", [
    ("1", 1), ("4096", 4096), ("1K", KiB), ("1k", KiB), ("1KB", KiB), ("1kib", KiB), ("1M", MiB), ("2MiB", 2 * MiB),
    ("1mb", MiB), ("3G", 3 * GiB), ("1GB", GiB), ("1GiB", GiB), ("2T", 2 << 40), ("1TiB", 1 << 40), (" 8 M ", 8 * MiB),
])
def test_parse_size_accepts_bytes_and_binary_suffixes(text, want):
    assert _config.parse_size(text, "X") == want


@pytest.mark.parametrize("text", ["", "M", "1.5G", "-1", "0", "1X", "1 M B", "abc", "1e9", "99999999999T"])
def test_parse_size_refuses_garbage(text):
    with pytest.raises(jaxvmm.InvalidArgumentError, match="X="):
        _config.parse_size(text, "X")


def test_host_pool_limit_1M_is_one_mebibyte_subprocess():
    # It used to be read with strtoull: "1M" was one byte and every offload failed. Now 512 KiB fits
    # and 2 MiB is refused with OutOfMemoryError at the eager call.
    code = textwrap.dedent("""
        import jax.numpy as jnp, jaxvmm
        assert jaxvmm.configure()["host_pool_limit"] == 1 << 20, jaxvmm.configure()
        t = jaxvmm.offload(jnp.ones((128 * 1024,), jnp.float32))  # 512 KiB
        assert float(jaxvmm.reload(t)[5]) == 1.0
        try:
            jaxvmm.offload(jnp.ones((512 * 1024,), jnp.float32))  # 2 MiB
        except jaxvmm.OutOfMemoryError as e:
            assert "pinned host pool exhausted" in str(e) and str(e).startswith("jaxvmm:"), e
            print("OK")
    """)
    r = run_in_subprocess(code, env={**ENV, "JAXVMM_HOST_POOL_LIMIT": "1M"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("name,value", [
    ("JAXVMM_HOST_POOL_LIMIT", "lots"), ("JAXVMM_HOST_POOL_LIMIT", "1.5G"), ("JAXVMM_HOST_POOL_CHUNK", "0"),
    ("JAXVMM_PREFETCH_DEPTH", "two"), ("JAXVMM_PREFETCH_DEPTH", "0"), ("JAXVMM_PREFETCH_DEPTH", "99999999999"),
    ("JAXVMM_KEEP_RESIDENT", "-1"), ("JAXVMM_KEEP_RESIDENT", "x"), ("JAXVMM_TRACE", "maybe"),
    ("JAXVMM_PREDICT", "2"), ("JAXVMM_REQUIRE_GPU", "yes please"), ("JAXVMM_HOST_STORE", "numa"),
    ("JAXVMM_COPY_CHUNK", "-1"), ("JAXVMM_COPY_CHUNK", "lots"),
    ("JAXVMM_GRAPH_CELLS", "0"), ("JAXVMM_GRAPH_CELLS", "5"), ("JAXVMM_GRAPH_CELLS", "two"),
    ("JAXVMM_WORKER_SPIN_US", "-1"), ("JAXVMM_WORKER_SPIN_US", "1ms"), ("JAXVMM_RING_PROFILE", "sometimes"),
])
def test_bad_environment_value_fails_at_import_naming_it_subprocess(name, value):
    code = textwrap.dedent("""
        try:
            import jaxvmm
        except ValueError as e:
            assert type(e).__name__ == "InvalidArgumentError" and type(e).__module__ == "jaxvmm.errors", type(e)
            print("ERR", e)
        else:
            print("imported")
    """)
    r = run_in_subprocess(code, env={**ENV, name: value})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ERR" in r.stdout, r.stdout + r.stderr[-2000:]
    assert name in r.stdout and repr(value) in r.stdout, r.stdout


def test_valid_environment_values_reach_the_core_subprocess():
    code = textwrap.dedent("""
        import jaxvmm
        print(sorted(jaxvmm.configure().items()))
    """)
    env = {**ENV, "JAXVMM_HOST_POOL_LIMIT": "3GiB", "JAXVMM_HOST_POOL_CHUNK": "64m", "JAXVMM_PREFETCH_DEPTH": "3",
           "JAXVMM_KEEP_RESIDENT": "1", "JAXVMM_TRACE": "0", "JAXVMM_PREDICT": "true",
           "JAXVMM_STAGING_BUDGET": "96MiB", "JAXVMM_STAGING_IDLE_MS": "75", "JAXVMM_HOST_STORE": "host_numa",
           "JAXVMM_COPY_CHUNK": "8M", "JAXVMM_GRAPH_CELLS": "3", "JAXVMM_GRAPH_SPARES": "5",
           "JAXVMM_GRAPH_HOLD": "Spares", "JAXVMM_GRAPH_SPARE_BUDGET": "1G"}
    r = run_in_subprocess(code, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    want = sorted({"host_pool_limit": 3 * GiB, "host_pool_chunk": 64 * MiB, "prefetch_depth": 3,
                   "keep_resident": 1, "staging_budget": 96 * MiB, "staging_idle_ms": 75,
                   "host_store": "host_numa", "copy_chunk": 8 * MiB, "graph_cells": 3,
                   "graph_spares": 5, "graph_hold": "spares", "graph_spare_budget": GiB}.items())
    assert str(want) in r.stdout, r.stdout


def test_ring_profile_and_worker_spin_reach_the_engine_subprocess():
    # Read by the engine itself (getenv), in the canonical spelling _config writes back: "on" is on,
    # a spin of 0 naps at once and still delivers every op's bookkeeping.
    code = textwrap.dedent("""
        import os, jax, jax.numpy as jnp, numpy as np, jaxvmm
        assert os.environ["JAXVMM_RING_PROFILE"] == "1" and os.environ["JAXVMM_WORKER_SPIN_US"] == "0"
        x = jnp.arange(4096, dtype=jnp.float32)
        f = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)))
        for _ in range(5):
            assert np.array_equal(np.asarray(f(x)), np.asarray(x))
        jaxvmm.synchronize()
        s = jaxvmm.engine_stats()["cpu:0"]
        assert s["handler_offload_median_ns"] > 0 and s["handler_reload_median_ns"] > 0, s
        off, rel = s["handler_offload_sections_ns"], s["handler_reload_sections_ns"]
        assert {"staging acquire", "enqueue", "staging return"} <= set(off) and "host block" in off, off
        assert "host block" not in rel and "enqueue" in rel, rel
        assert sum(off.values()) > 0, off
        assert s["tickets_live"] == 0, s
        print("OK")
    """)
    r = run_in_subprocess(code, env={**ENV, "JAXVMM_RING_PROFILE": "on", "JAXVMM_WORKER_SPIN_US": "00"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
    r = run_in_subprocess("import jax, jax.numpy as jnp, jaxvmm\njaxvmm.reload(jaxvmm.offload(jnp.ones(8)))\n"
                          "jaxvmm.synchronize()\nprint(sorted(k for k in jaxvmm.engine_stats()['cpu:0'] if 'sections' in k))",
                          env=ENV)
    assert r.returncode == 0 and "[]" in r.stdout, r.stdout + r.stderr[-3000:]  # off by default


def test_unknown_jaxvmm_variable_warns_subprocess():
    r = run_in_subprocess("import jaxvmm; print('imported')", env={**ENV, "JAXVMM_PREFETCH_DEPHT": "4"})
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-3000:]
    assert "JAXVMM_PREFETCH_DEPHT" in r.stderr, r.stderr[-3000:]


def test_trace_env_is_honoured_subprocess():
    code = "import jaxvmm\nwith jaxvmm.Slot(4096, device='cpu'): pass\nprint('OK')"
    on = run_in_subprocess(code, env={**ENV, "JAXVMM_TRACE": "true"})
    off = run_in_subprocess(code, env={**ENV, "JAXVMM_TRACE": "off"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "jaxvmm-trace:" in on.stderr and "jaxvmm-trace:" not in off.stderr


def test_configure_accepts_size_strings():
    before = jaxvmm.configure()
    try:
        got = jaxvmm.configure(host_pool_limit="1G", host_pool_chunk="8MiB")
        assert got["host_pool_limit"] == GiB and got["host_pool_chunk"] == 8 * MiB
    finally:
        jaxvmm.configure(host_pool_limit=before["host_pool_limit"], host_pool_chunk=before["host_pool_chunk"])


@pytest.mark.parametrize("kwargs", [
    {"host_pool_limit": 1 << 64}, {"host_pool_chunk": 1 << 63}, {"prefetch_depth": 1 << 31},
    {"prefetch_depth": 1 << 40}, {"keep_resident": 1 << 31}, {"keep_resident": 1 << 64}, {"host_pool_limit": "1Q"},
    {"prefetch_depth": 0}, {"keep_resident": -1}, {"prefetch_depth": True}, {"prefetch_depth": 2.0},
    {"graph_cells": 0}, {"graph_cells": 5}, {"graph_cells": "2"}, {"graph_cells": True}, {"graph_cells": 2.0},
    {"graph_spares": -1}, {"graph_spares": 65}, {"graph_spares": "8"}, {"graph_hold": "all"}, {"graph_hold": 1},
    {"graph_spare_budget": -1}, {"graph_spare_budget": "2Q"}, {"graph_spare_budget": True}, {"graph_spare_budget": 1 << 63},
])
def test_configure_refuses_values_the_core_cannot_hold(kwargs):
    before = jaxvmm.configure()
    with pytest.raises(jaxvmm.InvalidArgumentError, match=f"configure: {next(iter(kwargs))}"):
        jaxvmm.configure(**kwargs)
    assert jaxvmm.configure() == before


def test_lowering_the_pool_limit_is_enforced_and_shrinks_the_pool_subprocess():
    # The pool pins a 4 MiB chunk for a 1 MiB ticket; the limit then drops to 1 MiB. Carving another
    # 512 KiB from the chunk it already holds would exceed the new limit (it used to succeed), and once
    # the ticket is reloaded the chunk goes back to the driver.
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxvmm
        jaxvmm.configure(host_pool_limit="64M", host_pool_chunk="4M")
        st = lambda: jaxvmm.engine_stats()["cpu:0"]
        t = jaxvmm.offload(jnp.ones((256 * 1024,), jnp.float32))  # 1 MiB
        jaxvmm.synchronize()
        assert st()["pinned_bytes"] == 4 << 20, st()
        jaxvmm.configure(host_pool_limit="1M")
        try:
            jaxvmm.offload(jnp.ones((128 * 1024,), jnp.float32))  # 512 KiB more: over the new limit
            raise SystemExit("offload past the lowered limit succeeded")
        except jaxvmm.OutOfMemoryError:
            pass
        assert float(jaxvmm.reload(t)[3]) == 1.0
        del t
        jaxvmm.synchronize()
        t2 = jaxvmm.offload(jnp.ones((128 * 1024,), jnp.float32))  # fits now; the 4 MiB chunk is gone
        jaxvmm.synchronize()
        assert st()["pinned_bytes"] <= 1 << 20, st()
        assert float(jaxvmm.reload(t2)[0]) == 1.0
        print("OK")
    """)
    r = run_in_subprocess(code, env=ENV)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_configure_graph_spare_budget_round_trips_and_reads_the_environment():
    before = jaxvmm.configure()["graph_spare_budget"]
    try:
        assert jaxvmm.configure(graph_spare_budget="2G")["graph_spare_budget"] == 2 * GiB
        assert jaxvmm.configure()["graph_spare_budget"] == 2 * GiB
        assert jaxvmm.configure(graph_spare_budget=0)["graph_spare_budget"] == 0
    finally:
        jaxvmm.configure(graph_spare_budget=before)
    code = "import jaxvmm; print('BUDGET', jaxvmm.configure()['graph_spare_budget'])"
    r = run_in_subprocess(code, env={**ENV, "JAXVMM_GRAPH_SPARE_BUDGET": "512M"})
    assert r.returncode == 0 and "BUDGET 536870912" in r.stdout, r.stdout + r.stderr[-3000:]


def test_configure_graph_cells_round_trips():
    before = jaxvmm.configure()["graph_cells"]
    try:
        for k in (1, 3, 4, 2):
            assert jaxvmm.configure(graph_cells=k)["graph_cells"] == k
            assert jaxvmm.configure()["graph_cells"] == k
    finally:
        jaxvmm.configure(graph_cells=before)


@pytest.mark.parametrize("flags, in_order", [
    (None, True),
    ("", True),
    ("--xla_gpu_enable_command_buffer=+WHILE", True),
    ("--xla_gpu_command_buffer_scheduling_mode=LHS", True),
    ("--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", True),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT", False),
    ("  --xla_gpu_graph_min_graph_size=1\t--xla_gpu_command_buffer_scheduling_mode='CONCURRENT'", False),
    ('--xla_gpu_command_buffer_scheduling_mode="CONC\\URRENT"', False),  # a backslash escape in double quotes
    ('--xla_gpu_command_buffer_scheduling_mode="CONCURRENT" --xla_gpu_command_buffer_scheduling_mode=LHS', True),
    ("--xla_gpu_command_buffer_scheduling_mode=LHS --xla_gpu_command_buffer_scheduling_mode=CONCURRENT", False),
    # XLA spells its values in capitals and ignores others: the CONCURRENT before stands.
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_command_buffer_scheduling_mode=lhs", False),
    ("--xla_gpu_command_buffer_scheduling_mode=concurrent", True),
    # The deprecated boolean sets CONCURRENT (true) or SERIALIZE (false).
    ("--xla_gpu_graph_enable_concurrent_region", False),
    ("--xla_gpu_graph_enable_concurrent_region=true", False),
    ("--xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_graph_enable_concurrent_region=false", True),
    # XLA stops at the first token that is not a flag.
    ("--xla_gpu_graph_min_graph_size=1 stop --xla_gpu_command_buffer_scheduling_mode=CONCURRENT", True),
    ("FILE", False),  # a value that does not start with '-' names a file of flags
])
def test_the_engine_reads_xla_s_command_buffer_scheduling_mode_from_xla_flags(monkeypatch, tmp_path, flags, in_order):
    """Graph mode reads another call site's offload cell only where XLA runs recorded commands in order
    (tests/test_graph.py, test_an_offload_round_beside_a_waiting_reload_...): XLA_FLAGS parsed as XLA
    parses it (ffi/config.cc), the last setting that XLA takes winning."""
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    elif flags == "FILE":
        path = tmp_path / "xla_flags"
        path.write_text("--xla_gpu_graph_min_graph_size=1\n--xla_gpu_command_buffer_scheduling_mode=CONCURRENT\n")
        monkeypatch.setenv("XLA_FLAGS", str(path))
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert lib.xla_keeps_command_order() is in_order
