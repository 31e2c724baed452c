"""``jaxvmm.stats()`` separates the user's slots from jaxvmm's internal staging slots, so a user's leak
check (every Slot closed -> zero) is not disturbed by the offload engine's staging cells, which stay
mapped while ops flow and go back after the idle timeout or on ``jaxvmm.trim()``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvmm

from conftest import drain_errors

KEYS = ("slots", "reserved_bytes", "mapped_bytes", "peak_mapped_bytes")


@pytest.fixture(autouse=True)
def _staging_stays_mapped():
    """The staging cells must not go back on their idle timer in the middle of these tests."""
    old = jaxvmm.configure()["staging_idle_ms"]
    jaxvmm.configure(staging_idle_ms=600_000)
    try:
        yield
    finally:
        jaxvmm.configure(staging_idle_ms=old)


def test_user_counts_are_zero_after_closing_every_user_slot_while_staging_exists():
    before_user = jaxvmm.stats()["user"]
    # offloads and reloads create the engine's staging slots
    x = jnp.arange(3 * 4099, dtype=jnp.float32)
    y = jax.jit(lambda v: jaxvmm.reload(jaxvmm.offload(v)))(x)
    assert np.array_equal(np.asarray(y), np.asarray(x))
    y = jaxvmm.reload(jaxvmm.offload(x))
    drain_errors()
    slots = [jaxvmm.Slot(8192, device="cpu") for _ in range(3)]
    s = jaxvmm.stats()
    assert s["user"]["slots"] == before_user["slots"] + 3
    assert s["user"]["mapped_bytes"] >= 3 * 8192
    assert s["internal"]["slots"] >= 1, s["internal"]  # the engine's staging slots
    for slot in slots:
        slot.close()
    s = jaxvmm.stats()
    assert s["user"]["slots"] == before_user["slots"] == 0, s["user"]
    assert s["user"]["reserved_bytes"] == 0 and s["user"]["mapped_bytes"] == 0, s["user"]
    jaxvmm.trim()
    t = jaxvmm.stats()
    assert t["internal"]["mapped_bytes"] == 0, t["internal"]  # an idle engine holds no pages after trim()
    assert t["user"] == s["user"]
    # totals are the sum of both owners, process-wide and per device
    for k in ("slots", "reserved_bytes", "mapped_bytes"):
        assert s[k] == s["user"][k] + s["internal"][k], k
    d = s["devices"]["cpu:0"]
    for k in ("slots", "reserved_bytes", "mapped_bytes"):
        assert d[k] == d["user"][k] + d["internal"][k], k
    assert set(s["user"]) == set(KEYS) and set(d["internal"]) == set(KEYS)


def test_user_peak_ignores_staging():
    jaxvmm.reset_peak_stats()
    x = jnp.ones((1 << 20,), jnp.float32)  # 4 MiB of staging for the offload and the reload
    jax.block_until_ready(jax.jit(lambda v: jaxvmm.reload(jaxvmm.offload(v)))(x))
    drain_errors()
    s = jaxvmm.stats()
    assert s["internal"]["peak_mapped_bytes"] >= 4 << 20, s["internal"]
    assert s["user"]["peak_mapped_bytes"] == s["user"]["mapped_bytes"], s["user"]
