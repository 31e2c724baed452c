"""Shared fixtures for the jaxvmm suite.

* ``gpu``-marked tests are skipped when jaxvmm cannot use the CUDA driver or jax has no gpu device;
  with ``JAXVMM_REQUIRE_GPU=1`` they fail instead (so a GPU CI job cannot pass by skipping everything).
* ``platform_device`` runs a test once on the POSIX backend ("cpu") and once on the real driver
  ("cuda:0", gpu-marked).
* ``run_in_subprocess`` runs code in a fresh interpreter, for tests that crash or poison a process.
* ``no_leaks`` (opt-in) asserts that a test leaves no open slots, no quarantine, no destructor leaks
  and no live driver objects behind.
* Faults are cleared around every test so one test cannot poison the next.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import sys

# jax must not grab most of the GPU's memory when the gpu gate initializes it: the slots need it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402

import jaxvmm  # noqa: E402
import jaxvmm.testing  # noqa: E402
from jaxvmm import _config  # noqa: E402
from jaxvmm._native import lib  # noqa: E402

REQUIRE_GPU_ENV = _config.SETTINGS["require_gpu"].env


# ---------------------------------------------------------------------------------------------------
# GPU gate
# ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when jaxvmm can drive a CUDA device that jax also sees; otherwise why not."""
    status = jaxvmm.cuda_available()
    if not status:
        return f"jaxvmm cannot use the CUDA driver: {status.reason}"
    try:
        import jax

        devices = jax.devices("gpu")
    except RuntimeError as e:
        return f"jax has no gpu devices ({e})"
    if not devices:
        return "jax has no gpu devices"
    return None


def gpu_required() -> bool:
    return _config.read_at_import("require_gpu")  # a test switch of jaxvmm's settings table (jaxvmm/_config.py)


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None or gpu_required():
        return  # run them; when required and missing, pytest_runtest_call below fails them
    skip = pytest.mark.skip(reason=f"gpu test: {reason} (set {REQUIRE_GPU_ENV}=1 to fail instead)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """With JAXVMM_REQUIRE_GPU=1 a gpu test on a machine without a usable GPU FAILS (in the call phase,
    so it is reported as a failure, not a setup error) instead of running or being skipped."""
    if item.get_closest_marker("gpu") is not None:
        reason = gpu_unavailable_reason()
        if reason is not None:
            pytest.fail(f"{REQUIRE_GPU_ENV}=1 but {reason}", pytrace=False)


# ---------------------------------------------------------------------------------------------------
# Fault hygiene: never let an armed fault or a quarantine outlive its test.
# ---------------------------------------------------------------------------------------------------
BACKENDS = ("posix", "cuda")


def clear_all_faults() -> None:
    for backend in BACKENDS:
        jaxvmm.testing.hooks.clear_faults(backend)  # works without a driver: it only edits the wrapper's rule list


@pytest.fixture(autouse=True)
def _fault_hygiene():
    clear_all_faults()
    # The offload engine's staging cells from earlier tests go back now, not in the middle of this test
    # (their idle timer would change the process-wide slot and mapping counts a test compares).
    jaxvmm.trim()
    try:
        yield
    finally:
        clear_all_faults()
        if jaxvmm.stats()["quarantined"]:
            jaxvmm.retry_quarantine()


# ---------------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------------
PLATFORM_DEVICES = {"cpu": "cpu", "cuda": "cuda:0"}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def platform_device(request) -> str:
    """A device string for jaxvmm.Slot(device=...): the POSIX backend, then the real CUDA driver."""
    return PLATFORM_DEVICES[request.param]


def counter_devices() -> list[str]:
    """Devices whose driver counters are tracked: the cpu backend always, CUDA when usable."""
    return ["cpu"] + (["cuda:0"] if gpu_unavailable_reason() is None else [])


LIVE_KEYS = ("live_handles", "live_reservations", "live_mappings")


def live_counters(device) -> dict:
    c = jaxvmm.testing.driver_counters(device)
    return {k: c[k] for k in LIVE_KEYS}


# ---------------------------------------------------------------------------------------------------
# Leak check (opt-in)
# ---------------------------------------------------------------------------------------------------
def _snapshot() -> dict:
    s = jaxvmm.stats()
    return {
        "slots": s["slots"],
        "quarantined": s["quarantined"],
        "leaked": s["leaked"],
        "driver": {d: live_counters(d) for d in counter_devices()},
    }


@pytest.fixture
def no_leaks():
    """Asserts the test leaves open slots, the quarantine, destructor leaks and the driver seam's live
    handles/reservations/mappings exactly as it found them. Yields the baseline snapshot."""
    before = _snapshot()
    yield before
    after = _snapshot()
    if after != before:
        # Clean up so one leaking test does not cascade, then report what leaked.
        clear_all_faults()
        lib.close_all()
        jaxvmm.retry_quarantine()
        quarantine = jaxvmm.stats()["quarantine"]
        pytest.fail(
            f"test leaked jaxvmm state:\n  before={before}\n  after ={after}\n  quarantine={quarantine}",
            pytrace=False,
        )


# ---------------------------------------------------------------------------------------------------
# Subprocesses
# ---------------------------------------------------------------------------------------------------
def run_in_subprocess(code: str, env: dict | None = None,
                      timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``sys.executable -c code`` in a fresh interpreter; returns the completed process (text output).

    ``env`` entries are added to (and override) the current environment. Faulthandler is disabled so a
    crash is reported by the signal in ``returncode`` alone.
    """
    full_env = dict(os.environ)
    full_env.pop("PYTHONFAULTHANDLER", None)
    if env:
        full_env.update(env)
    # Run outside the source tree: `-c` puts the working directory first on sys.path, and the source
    # package there has no compiled extension (the installed one must be imported).
    return subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def subprocess_runner():
    """The ``run_in_subprocess`` helper, as a fixture."""
    return run_in_subprocess


# ---- helpers shared by the offload and remat tests ----
def jdev(device="cpu"):
    """The jax.Device a device string names."""
    from jaxvmm._devices import target_of

    return target_of(device).device


def dkey(device="cpu") -> str:
    """The key of ``device`` in engine_stats() and stats()['devices'] ("cpu:0", "cuda:0")."""
    from jaxvmm._devices import target_of

    return target_of(device).name


def drain_errors(collect: bool = True) -> None:
    """Wait for the engines and forget any pending asynchronous error (so one test cannot poison the next)."""
    import gc

    if collect:
        gc.collect()
    jaxvmm.synchronize()
    jaxvmm.synchronize()  # drops drained by the first call may have posted releases
    try:
        jaxvmm.check()
    except jaxvmm.VmmError:
        pass


ENGINE_COUNTER_KEYS = ("offloads", "reloads", "tickets_live", "ticket_host_bytes", "errors")


def engine_counters(device=None) -> dict:
    """Engine counters after synchronize(): of one device, or (``None``) summed over every engine, for
    tests that run on the default device (cpu in CI, cuda:0 on a GPU runner). Zeros where no engine exists."""
    jaxvmm.synchronize()
    engines = jaxvmm.engine_stats()
    picked = [engines.get(dkey(device), {})] if device is not None else list(engines.values())
    return {k: sum(s.get(k, 0) for s in picked) for k in ENGINE_COUNTER_KEYS}


def counter_delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ENGINE_COUNTER_KEYS}


@pytest.fixture
def engine_hygiene():
    """No asynchronous error of an earlier test reaches this one, and none of this one leaks out."""
    drain_errors(collect=False)
    yield
    drain_errors()


def _leaf_pairs(got, want):
    """(i, a, b) for each pair of leaves of two pytrees of the same structure, as contiguous numpy arrays
    of the same shape and dtype."""
    import numpy as np
    import jax

    g, gd = jax.tree.flatten(got)
    w, wd = jax.tree.flatten(want)
    assert gd == wd, (gd, wd)
    for i, (a, b) in enumerate(zip(g, w)):
        a, b = np.ascontiguousarray(np.asarray(a)), np.ascontiguousarray(np.asarray(b))
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, a.dtype, b.shape, b.dtype)
        yield i, a, b


def assert_trees_ulp_close(got, want, ulps: int = 2) -> None:
    """Like assert_trees_bit_equal, but float leaves may differ by up to `ulps` units in the last place
    (same sign, both finite). For programs whose arithmetic XLA may fuse differently around a custom
    call than around the plain value it replaces (FMA contraction on some hosts); a wrong or shifted
    reload still shows as a difference of many ulps."""
    import numpy as np

    for i, a, b in _leaf_pairs(got, want):
        if not np.issubdtype(a.dtype, np.floating) or a.tobytes() == b.tobytes():
            assert a.tobytes() == b.tobytes(), (i, a.ravel()[:8], b.ravel()[:8])
            continue
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and np.all(np.signbit(a) == np.signbit(b)), (i, a, b)
        ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize]
        diff = np.abs(a.view(ints).astype(np.int64) - b.view(ints).astype(np.int64))
        assert diff.max() <= ulps, f"leaf {i} {a.dtype}{list(a.shape)}: {int(diff.max())} ulps apart: {a.ravel()[:8]} vs {b.ravel()[:8]}"


def assert_trees_bit_equal(got, want) -> None:
    """Two pytrees with the same structure whose leaves have the same shape, dtype and bytes (nan
    payloads and -0.0 included): what "bit-exact" means in these tests."""
    for i, a, b in _leaf_pairs(got, want):
        if a.tobytes() != b.tobytes():
            raise AssertionError(f"leaf {i} {a.dtype}{list(a.shape)}: bits differ: {a.ravel()[:8]} vs {b.ravel()[:8]}")
