"""Sharded arrays under plain ``jit`` (NamedSharding, GSPMD and Shardy): each device offloads and
reloads its own shard, outputs keep the input's sharding, tickets are sharded with the data, and
``jaxvmm.checkpoint`` gives ``jax.checkpoint``'s gradients.

The cpu tests need 4 devices: each runs one case of ``_sharded_cases.py`` in a subprocess with
``--xla_force_host_platform_device_count=4`` (this process has one cpu device), under Shardy and
under GSPMD. The gpu tests need 2 GPUs and run in this process."""

from __future__ import annotations

import os
import textwrap

import jax
import numpy as np
import pytest

import jaxvmm
from conftest import run_in_subprocess

CASES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sharded_cases.py")


@pytest.mark.parametrize("partitioner", ["shardy", "gspmd"])
@pytest.mark.parametrize("case", ["roundtrip", "prefetch_after", "vmap_and_shard_map", "training", "explicit"])
def test_sharded_cpu_4_devices(case, partitioner):
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = [{CASES_FILE!r}, {case!r}, {partitioner!r}]
        runpy.run_path({CASES_FILE!r}, run_name="__main__")
    """)
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    r = run_in_subprocess(code, env={"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0 and f"{case} OK" in r.stdout, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def test_one_device_tickets_unchanged():
    # Unsharded use keeps the uint32[2] token and the unsharded path.
    x = jax.numpy.arange(12.0).reshape(3, 4)
    t = jaxvmm.offload(x)
    assert not t.sharded and t.token.shape == (2,) and repr(t) == "Ticket(shape=(3, 4), dtype=float32)"
    t2 = jax.jit(jaxvmm.offload)(x)
    assert not t2.sharded and t2.token.shape == (2,)
    np.testing.assert_array_equal(np.asarray(jaxvmm.reload(t)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(jaxvmm.reload)(t2)), np.asarray(x))


def test_ticket_sharded_flag_validated():
    with pytest.raises(jaxvmm.errors.InvalidArgumentTypeError, match="sharded must be a bool"):
        jaxvmm.Ticket(jax.numpy.zeros(2, jax.numpy.uint32), (2,), "float32", "yes")
    # A sharded ticket whose token does not match the array's rank is refused before any device work.
    bad = jaxvmm.Ticket(jax.numpy.zeros(2, jax.numpy.uint32), (4, 4), "float32", True)
    with pytest.raises(jaxvmm.errors.InvalidArgumentError, match="sharded ticket"):
        jaxvmm.reload(bad)


# ---------------------------------------------------------------------------------------------------
# 2 GPUs
# ---------------------------------------------------------------------------------------------------
def _two_gpus():
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs 2 gpu devices, jax sees {len(gpus)}")
    return gpus[:2]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["d", "none_d", "replicated"])
def test_gpu_two_devices_roundtrip(spec):
    import _sharded_cases as cases
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(_two_gpus()), ("d",))
    p = {"d": P("d"), "none_d": P(None, "d"), "replicated": P()}[spec]
    cases.check_roundtrip(mesh, p, shape=(64, 1024, 33))  # 8.6 MB: several staging pages per shard


@pytest.mark.gpu
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("style", ["dp", "fsdp"])
def test_gpu_two_devices_training_step(style, scan):
    """A data-parallel and an FSDP-style training step in plain jit on 2 GPUs: jaxvmm.checkpoint's
    gradients equal jax.checkpoint's (same residuals saved instead of offloaded), and each device's
    offloaded bytes are its local shard of every layer's input."""
    import _sharded_cases as cases
    from jax.sharding import Mesh

    mesh = Mesh(np.array(_two_gpus()), ("data",))
    got = cases.check_training_step(mesh, style, scan, batch=64, width=512, layers=4, exact=False)
    print(style, scan, got)
