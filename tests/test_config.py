"""Settings: one table (jaxvmm/_config.py) from which the JAXVMM_* environment variables, ``jaxvmm.configure``,
``jaxvmm.testing.configure_debug``, the native core's values (lib.set_setting / get_setting, ffi/config.cc) and
README's table are derived; sizes with suffixes, bad values refused by name, and a pinned-pool limit that is
enforced even when lowered."""

from __future__ import annotations

import pathlib
import textwrap

import pytest

import jaxvmm
import jaxvmm.testing
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
    ("JAXVMM_HOST_POOL_LIMIT", "lots"), ("JAXVMM_HOST_POOL_LIMIT", "1.5G"), ("JAXVMM_DEBUG_HOST_POOL_CHUNK", "0"),
    ("JAXVMM_PREFETCH_DEPTH", "two"), ("JAXVMM_PREFETCH_DEPTH", "0"), ("JAXVMM_PREFETCH_DEPTH", "99999999999"),
    ("JAXVMM_KEEP_RESIDENT", "-1"), ("JAXVMM_KEEP_RESIDENT", "x"), ("JAXVMM_DEBUG_TRACE", "maybe"),
    ("JAXVMM_DEBUG_PREDICT", "2"), ("JAXVMM_REQUIRE_GPU", "yes please"), ("JAXVMM_HOST_STORE", "numa"),
    ("JAXVMM_DEBUG_COPY_CHUNK", "-1"), ("JAXVMM_DEBUG_COPY_CHUNK", "lots"),
    ("JAXVMM_GRAPH_CELLS", "0"), ("JAXVMM_GRAPH_CELLS", "5"), ("JAXVMM_GRAPH_CELLS", "two"),
    ("JAXVMM_DEBUG_WORKER_SPIN_US", "-1"), ("JAXVMM_DEBUG_WORKER_SPIN_US", "1ms"),
    ("JAXVMM_DEBUG_RING_PROFILE", "sometimes"), ("JAXVMM_GRAPH", "maybe"), ("JAXVMM_DEBUG_GRAPH_HOLD", "all"),
    ("JAXVMM_DEBUG_GRAPH_SPARES", "65"), ("JAXVMM_DEBUG_POSIX_ASYNC", "-1"),
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
        import jaxvmm, jaxvmm.testing
        print(sorted(jaxvmm.configure().items()))
        print(sorted(jaxvmm.testing.configure_debug().items()))
    """)
    env = {**ENV, "JAXVMM_HOST_POOL_LIMIT": "3GiB", "JAXVMM_PREFETCH_DEPTH": "3",
           "JAXVMM_KEEP_RESIDENT": "1", "JAXVMM_STAGING_BUDGET": "96MiB", "JAXVMM_STAGING_IDLE_MS": "75",
           "JAXVMM_HOST_STORE": "host_numa", "JAXVMM_GRAPH_CELLS": "3", "JAXVMM_GRAPH_SPARE_BUDGET": "1G",
           "JAXVMM_DEBUG_HOST_POOL_CHUNK": "64m", "JAXVMM_DEBUG_COPY_CHUNK": "8M", "JAXVMM_DEBUG_GRAPH_SPARES": "5",
           "JAXVMM_DEBUG_GRAPH_HOLD": "Spares", "JAXVMM_DEBUG_TRACE": "0", "JAXVMM_DEBUG_PREDICT": "false",
           "JAXVMM_DEBUG_WORKER_SPIN_US": "7", "JAXVMM_DEBUG_RING_PROFILE": "on", "JAXVMM_DEBUG_POSIX_ASYNC": "2",
           "JAXVMM_DEBUG_POSIX_LINK_US": "3", "JAXVMM_DEBUG_POSIX_DTOD_US": "4"}
    r = run_in_subprocess(code, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    user = sorted({"host_pool_limit": 3 * GiB, "prefetch_depth": 3, "keep_resident": 1, "staging_budget": 96 * MiB,
                   "staging_idle_ms": 75, "host_store": "host_numa", "graph_cells": 3,
                   "graph_spare_budget": GiB}.items())
    debug = sorted({"host_pool_chunk": 64 * MiB, "copy_chunk": 8 * MiB, "graph_spares": 5, "graph_hold": "spares",
                    "trace": False, "predict": False, "worker_spin_us": 7, "ring_profile": True, "posix_async": 2,
                    "posix_link_us": 3, "posix_dtod_us": 4}.items())
    assert r.stdout.splitlines() == [str(user), str(debug)], r.stdout


def test_every_setting_the_core_reads_has_a_row_in_the_native_table():
    # The Python table's names and the core's (ffi/config.cc) agree, choices by name.
    for s in _config.SETTINGS.values():
        if s.core:
            if s.kind == "choice":
                assert lib.get_setting(s.key) in s.choices
                for c in s.choices:
                    before = lib.get_setting(s.key)
                    lib.set_setting(s.key, c)
                    assert lib.get_setting(s.key) == c
                    lib.set_setting(s.key, before)
                with pytest.raises(jaxvmm.InvalidArgumentError, match=s.key):
                    lib.set_setting(s.key, 0)
            else:
                assert isinstance(lib.get_setting(s.key), int)
                with pytest.raises(jaxvmm.InvalidArgumentError, match=s.key):
                    lib.set_setting(s.key, "on")
    with pytest.raises(jaxvmm.InvalidArgumentError, match="unknown setting 'graph'"):
        lib.set_setting("graph", 1)  # read by Python, once, before the handlers are registered
    # The channel limits the core's arrays are sized by (ffi/graph_words.h) are the table's ranges.
    assert _config.SETTINGS["graph_cells"].hi == lib.graph_max_cells()
    assert _config.SETTINGS["graph_spares"].hi == lib.graph_max_spares()


def test_defaults_reach_the_core_and_the_environment_is_left_alone_subprocess():
    # Every setting the core reads is pushed at import, its default when unset; nothing is written
    # back into the environment.
    code = textwrap.dedent("""
        import os
        before = dict(os.environ)
        import jaxvmm
        from jaxvmm import _config
        from jaxvmm._native import lib
        assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
        for s in _config.SETTINGS.values():
            if s.core and s.env not in os.environ:
                want = s.default_value()
                assert lib.get_setting(s.key) == (int(want) if s.kind == "bool" else want), s
        print("OK")
    """)
    r = run_in_subprocess(code, env={**ENV, "JAXVMM_DEBUG_PREDICT": "off", "JAXVMM_DEBUG_WORKER_SPIN_US": "00",
                                     "JAXVMM_DEBUG_RING_PROFILE": "Yes", "JAXVMM_GRAPH": "on"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_configure_keywords_are_the_user_settings_the_core_reads():
    user = {k for k, s in _config.SETTINGS.items() if s.audience == "user" and s.core}
    debug = {k for k, s in _config.SETTINGS.items() if s.audience == "debug"}
    assert set(jaxvmm.configure()) == user
    assert set(jaxvmm.testing.configure_debug()) == debug
    assert len([s for s in _config.SETTINGS.values() if s.audience == "user"]) <= 12
    for k in user:
        assert f"    {k}: " in jaxvmm.configure.__doc__
    for s in _config.SETTINGS.values():
        assert s.env.startswith("JAXVMM_DEBUG_") == (s.audience == "debug"), s
        assert s.core or s.audience != "debug", s  # debug settings are the core's
    with pytest.raises(TypeError, match="graph_spares is a debug setting"):
        jaxvmm.configure(graph_spares=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'graph'"):
        jaxvmm.configure(graph=False)
    with pytest.raises(TypeError, match="host_store is a user setting"):
        jaxvmm.testing.configure_debug(host_store="pinned")


def test_readme_lists_exactly_the_user_settings():
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = _config.markdown("user")
    assert table in readme, "README's table of environment variables is not `python -m jaxvmm._config --markdown`"
    section = readme.split("## Settings\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `JAXVMM_")]
    assert rows == table.splitlines()[2:], "README lists other JAXVMM_* rows than the table's user settings"


def test_ring_profile_and_worker_spin_reach_the_engine_subprocess():
    # "on" is on; a spin of 0 naps at once and still delivers every op's bookkeeping.
    code = textwrap.dedent("""
        import os, jax, jax.numpy as jnp, numpy as np, jaxvmm, jaxvmm.testing
        assert jaxvmm.testing.configure_debug()["ring_profile"] is True
        assert jaxvmm.testing.configure_debug()["worker_spin_us"] == 0
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
    r = run_in_subprocess(code, env={**ENV, "JAXVMM_DEBUG_RING_PROFILE": "on", "JAXVMM_DEBUG_WORKER_SPIN_US": "00"})
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
    on = run_in_subprocess(code, env={**ENV, "JAXVMM_DEBUG_TRACE": "true"})
    off = run_in_subprocess(code, env={**ENV, "JAXVMM_DEBUG_TRACE": "off"})
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "jaxvmm-trace:" in on.stderr and "jaxvmm-trace:" not in off.stderr
    # ... and at run time (jaxvmm.testing.configure_debug)
    code = ("import jaxvmm, jaxvmm.testing\njaxvmm.testing.configure_debug(trace=True)\n"
            "with jaxvmm.Slot(4096, device='cpu'): pass\nprint('OK')")
    late = run_in_subprocess(code, env=ENV)
    assert late.returncode == 0 and "jaxvmm-trace:" in late.stderr, late.stderr[-3000:]


def test_configure_accepts_size_strings():
    before = jaxvmm.configure()
    try:
        got = jaxvmm.configure(host_pool_limit="1G", staging_budget="8MiB")
        assert got["host_pool_limit"] == GiB and got["staging_budget"] == 8 * MiB
    finally:
        jaxvmm.configure(host_pool_limit=before["host_pool_limit"], staging_budget=before["staging_budget"])
    before = jaxvmm.testing.configure_debug()
    try:
        assert jaxvmm.testing.configure_debug(host_pool_chunk="8MiB")["host_pool_chunk"] == 8 * MiB
    finally:
        jaxvmm.testing.configure_debug(host_pool_chunk=before["host_pool_chunk"])


@pytest.mark.parametrize("kwargs", [
    {"host_pool_limit": 1 << 64}, {"prefetch_depth": 1 << 31},
    {"prefetch_depth": 1 << 40}, {"keep_resident": 1 << 31}, {"keep_resident": 1 << 64}, {"host_pool_limit": "1Q"},
    {"prefetch_depth": 0}, {"keep_resident": -1}, {"prefetch_depth": True}, {"prefetch_depth": 2.0},
    {"graph_cells": 0}, {"graph_cells": 5}, {"graph_cells": "2"}, {"graph_cells": True}, {"graph_cells": 2.0},
    {"host_store": "numa"}, {"host_store": 0},
    {"graph_spare_budget": -1}, {"graph_spare_budget": "2Q"}, {"graph_spare_budget": True}, {"graph_spare_budget": 1 << 63},
    {"prefetch_depth": 3, "keep_resident": -1},  # nothing is set when one value is bad
])
def test_configure_refuses_values_the_core_cannot_hold(kwargs):
    before = jaxvmm.configure()
    bad = next(k for k, v in kwargs.items() if not (k == "prefetch_depth" and v == 3))
    with pytest.raises(jaxvmm.InvalidArgumentError, match=f"configure: {bad}"):
        jaxvmm.configure(**kwargs)
    assert jaxvmm.configure() == before


@pytest.mark.parametrize("kwargs", [
    {"host_pool_chunk": 1 << 63}, {"host_pool_chunk": 0}, {"copy_chunk": -1}, {"copy_chunk": "lots"},
    {"graph_spares": -1}, {"graph_spares": 65}, {"graph_spares": "8"}, {"graph_hold": "all"}, {"graph_hold": 1},
    {"trace": 1}, {"trace": "on"}, {"predict": None, "worker_spin_us": 100_001}, {"posix_async": -1},
])
def test_configure_debug_refuses_bad_values(kwargs):
    before = jaxvmm.testing.configure_debug()
    bad = next(k for k, v in kwargs.items() if v is not None)
    with pytest.raises(jaxvmm.InvalidArgumentError, match=f"configure_debug: {bad}"):
        jaxvmm.testing.configure_debug(**kwargs)
    assert jaxvmm.testing.configure_debug() == before


def test_lowering_the_pool_limit_is_enforced_and_shrinks_the_pool_subprocess():
    # The pool pins a 4 MiB chunk for a 1 MiB ticket; the limit then drops to 1 MiB. Carving another
    # 512 KiB from the chunk it already holds would exceed the new limit (it used to succeed), and once
    # the ticket is reloaded the chunk goes back to the driver.
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxvmm, jaxvmm.testing
        jaxvmm.configure(host_pool_limit="64M")
        jaxvmm.testing.configure_debug(host_pool_chunk="4M")
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
