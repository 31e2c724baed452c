"""Every dtype jax has, offloaded and reloaded bit-exactly, eager and inside jit.

Sub-byte dtypes (int1/2/4, uint1/2/4, float4_e2m1fn) are where sizes disagree: numpy's itemsize is 1,
XLA stores them packed, and the XLA FFI's ``size_bytes()`` counts one byte per element, so a copy of
``size_bytes()`` bytes ran past XLA's packed buffer (heap corruption, SIGSEGV). jaxvmm now moves them
widened to one byte per element (a conversion XLA does exactly, since the wider type holds every value),
so their tests run in a subprocess: a regression kills that process, not the suite.

The cpu tests run on the POSIX backend; their ``gpu``-marked twins run the same matrix on ``cuda:0``.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxvmm

from conftest import drain_errors, jdev, run_in_subprocess

X64 = ("float64", "int64", "uint64", "complex128")
NAMES = (
    # jnp's bool, int, uint, float and complex dtypes
    "bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
    # ml_dtypes' float8 family
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
    "float8_e5m2fnuz", "float8_e8m0fnu",
    # sub-byte
    "int1", "int2", "int4", "uint1", "uint2", "uint4", "float4_e2m1fn",
)


def _jax_supports(name: str) -> bool:
    """Whether jax itself can hold and pass through an array of this dtype (jax 0.10 cannot for uint1)."""
    dt = getattr(jnp, name, None) or getattr(ml_dtypes, name, None)
    if dt is None:
        return False
    try:
        with jax.enable_x64(name in X64):
            x = jax.device_put(np.zeros(4, np.dtype(dt)))
            y = jax.jit(lambda a: a)(x)
            return y.dtype == np.dtype(dt)
    except Exception:  # noqa: BLE001 - jax's own gap, not jaxvmm's
        return False


def _bits(dtype) -> int:
    return int(jax.dtypes.itemsize_bits(dtype))


SUPPORTED = [n for n in NAMES if _jax_supports(n)]
BYTE_DTYPES = [n for n in SUPPORTED if _bits(np.dtype(getattr(jnp, n, None) or getattr(ml_dtypes, n))) >= 8]
SUB_BYTE = [n for n in SUPPORTED if n not in BYTE_DTYPES]


def test_matrix_covers_what_jax_has():
    # The sub-byte dtypes that triggered the crash must be in the matrix on this jax.
    assert {"int4", "uint4", "int2", "float4_e2m1fn"} <= set(SUB_BYTE), SUB_BYTE
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "complex64", "bool_", "float64"} <= set(BYTE_DTYPES)


def _dtype(name):
    return np.dtype(getattr(jnp, name, None) or getattr(ml_dtypes, name))


def _patterns(name: str, shape) -> np.ndarray:
    """Every representable bit pattern (sub-byte) or random bytes (NaN payloads included), as numpy."""
    dt = _dtype(name)
    n = int(np.prod(shape))
    if dt == np.bool_:
        return (np.random.default_rng(0).integers(0, 2, n) == 1).reshape(shape)
    if _bits(dt) < 8:
        if jnp.issubdtype(dt, jnp.integer):
            info = ml_dtypes.iinfo(dt)
            vals = np.arange(int(info.min), int(info.max) + 1)
            return np.resize(vals, n).astype(dt).reshape(shape)
        vals = np.arange(1 << _bits(dt), dtype=np.uint8).view(dt)  # every bit pattern, -0 included
        return np.resize(vals, n).reshape(shape)
    raw = np.random.default_rng(1).integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    dt = a.dtype
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if _bits(dt) < 8:  # numpy keeps one byte per element; only the low bits are the value
        mask = (1 << _bits(dt)) - 1
        return np.array_equal(a.view(np.uint8) & mask, b.view(np.uint8) & mask)
    return np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _roundtrip(name: str, device: str, mode: str, shape=(3, 37)) -> None:
    with jax.enable_x64(name in X64):
        host = _patterns(name, shape)
        x = jax.device_put(host, jdev(device))
        assert x.dtype == host.dtype
        if mode == "eager":
            t = jaxvmm.offload(x)
            assert t.dtype == host.dtype and t.shape == shape
            y = jaxvmm.reload(t)
        else:
            y = jax.jit(lambda v: jaxvmm.reload(jaxvmm.offload(v)))(x)
        y = np.asarray(jax.block_until_ready(y))
    assert _same_bits(y, host), (name, mode, host.ravel()[:16], y.ravel()[:16])


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", BYTE_DTYPES)
def test_byte_dtypes_roundtrip_bit_exact_cpu(name, mode):
    _roundtrip(name, "cpu", mode)
    drain_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("name", BYTE_DTYPES)
def test_byte_dtypes_roundtrip_bit_exact_gpu(name, mode):
    _roundtrip(name, "cuda:0", mode)
    drain_errors()


_SUB_BYTE_CODE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, jaxvmm
    from test_dtypes import _roundtrip
    for shape in [(1,), (3,), (5, 7), (4097,)]:          # odd element counts: packing edges
        for mode in ("eager", "jit"):
            _roundtrip({name!r}, {device!r}, mode, shape)
    jaxvmm.synchronize()
    jaxvmm.check()
    s = jaxvmm.engine_stats()
    assert all(v["tickets_live"] == 0 and v["errors"] == 0 for v in s.values()), s
    print("OK")
""")


def _run_sub_byte(name, device, platform):
    import os

    tests = os.path.dirname(os.path.abspath(__file__))
    r = run_in_subprocess(_SUB_BYTE_CODE.format(tests=tests, name=name, device=device),
                          env={"JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert r.returncode == 0 and "OK" in r.stdout, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-4000:]}"


@pytest.mark.parametrize("name", SUB_BYTE)
def test_sub_byte_dtypes_roundtrip_bit_exact_cpu_subprocess(name):
    _run_sub_byte(name, "cpu", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", SUB_BYTE)
def test_sub_byte_dtypes_roundtrip_bit_exact_gpu_subprocess(name):
    _run_sub_byte(name, "cuda:0", "cuda,cpu")


def test_sub_byte_ticket_keeps_its_dtype_and_refuses_a_wider_reload():
    # The ticket records the dtype the user offloaded; reloading it as the wider carrier is a mismatch.
    x = jnp.arange(-8, 8, dtype=jnp.int4)
    t = jaxvmm.offload(x)
    assert t.dtype == np.dtype(jnp.int4) and t.shape == (16,)
    with pytest.raises(jaxvmm.InvalidArgumentError):
        jaxvmm.reload(jaxvmm.Ticket(t.token, t.shape, jnp.int8))
    y = jaxvmm.reload(t)
    assert y.dtype == jnp.int4 and np.array_equal(np.asarray(y).astype(np.int8), np.arange(-8, 8))
    drain_errors()
