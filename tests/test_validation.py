"""Argument errors are ``jaxvmm.InvalidArgumentError`` (a ``ValueError``; type errors are also
``TypeError``), raised by Python-side validation with a ``jaxvmm`` message before the core is asked;
failures coming out of eager FFI calls are jaxvmm's classes, so ``except jaxvmm.VmmError`` catches them."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvmm
from jaxvmm import errors

from conftest import drain_errors, run_in_subprocess


# ---- errors from eager FFI calls (item 6) ----
def test_eager_pool_cap_is_out_of_memory_error_subprocess():
    code = textwrap.dedent("""
        import jax.numpy as jnp, jaxvmm
        jaxvmm.configure(host_pool_limit=1 << 20)
        try:
            jaxvmm.offload(jnp.zeros((1 << 19,), jnp.float32))
        except jaxvmm.VmmError as e:
            assert isinstance(e, jaxvmm.OutOfMemoryError) and isinstance(e, MemoryError), type(e)
            assert str(e).startswith("jaxvmm:") and "pinned host pool exhausted" in str(e), e
            print("OK")
    """)
    r = run_in_subprocess(code, env={"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.parametrize("msg,cls", [
    ("RESOURCE_EXHAUSTED: jaxvmm: offload: pinned host pool exhausted", jaxvmm.OutOfMemoryError),
    ("INVALID_ARGUMENT: jaxvmm: reload: the token is not a jaxvmm ticket", jaxvmm.InvalidArgumentError),
    ("UNIMPLEMENTED: jaxvmm: slot 3: create: no VMM", jaxvmm.NotSupportedError),
    ("UNAVAILABLE: jaxvmm: no driver", jaxvmm.BackendUnavailableError),
    ("INTERNAL: jaxvmm: slot 2: remap: cuMemMap: CUDA_ERROR_INVALID_VALUE", jaxvmm.DriverError),
])
def test_from_jax_error_maps_xla_statuses(msg, cls):
    e = errors.from_jax_error(RuntimeError(msg))
    assert type(e) is cls and str(e).startswith("jaxvmm:")
    assert errors.from_jax_error(RuntimeError("INTERNAL: something else")) is None


# ---- Python-side validation (item 7) ----
@pytest.mark.parametrize("device", ["cpu:abc", "cpu:-1", "cpu:", "tpu:0", "cpu:99"])
def test_bad_device_strings(device):
    with pytest.raises(jaxvmm.InvalidArgumentError, match=r"jaxvmm: .*device"):
        jaxvmm.Slot(4096, device=device)


def test_missing_numa_node_is_not_supported_naming_it():
    with pytest.raises(jaxvmm.NotSupportedError, match="host_numa:77.*NUMA node 77"):
        jaxvmm.Slot(4096, device="cpu", location="host_numa:77")


def test_access_string_is_one_device(no_leaks):
    with jaxvmm.Slot(4096, device="cpu", access="cpu") as s:  # used to iterate 'c', 'p', 'u'
        s.write(b"x")
    with jaxvmm.Slot(4096, device="cpu", access=0) as s:  # used to be silently ignored
        s.write(b"x")
    with pytest.raises(jaxvmm.InvalidArgumentError, match="device"):
        jaxvmm.Slot(4096, device="cpu", access="cpu:abc")
    with pytest.raises(TypeError, match="access"):
        jaxvmm.Slot(4096, device="cpu", access=1.5)


@pytest.mark.parametrize("data", ["hello", None, object(), np.array(["a", "b"]), np.array([object()])])
def test_write_refuses_text_none_and_objects(data, no_leaks):
    with jaxvmm.Slot(4096, device="cpu") as s:
        s.write(b"\0" * 16)
        with pytest.raises(jaxvmm.InvalidArgumentError) as ei:
            s.write(data)
        assert isinstance(ei.value, TypeError) and str(ei.value).startswith("jaxvmm:")
        assert s.read(16).tolist() == [0] * 16


class OnlyJaxArray:
    """An object that only implements ``__jax_array__`` (like flax/equinox wrappers)."""

    def __init__(self, a):
        self._a = a

    def __jax_array__(self):
        return jnp.asarray(self._a)


def test_jax_array_protocol_objects_are_accepted_by_offload_and_write():
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = jaxvmm.reload(jaxvmm.offload(OnlyJaxArray(v)))
    assert np.array_equal(np.asarray(y), v)
    with jaxvmm.Slot(4096, device="cpu") as s:
        s.write(OnlyJaxArray(v))
        assert np.array_equal(s.read(v.nbytes).view(np.float32).reshape(3, 4), v)
    drain_errors()


@pytest.mark.parametrize("make", [lambda: np.array([5, 7], np.uint32), lambda: jnp.array([5, 7], jnp.uint32)],
                         ids=["numpy", "jax"])
def test_forged_token_reloaded_eagerly_raises_at_the_call(make):
    with pytest.raises(jaxvmm.InvalidArgumentError, match="not a jaxvmm ticket"):
        jaxvmm.reload(jaxvmm.Ticket(make(), (4,), jnp.float32))
    jaxvmm.check()  # nothing was enqueued: no asynchronous error is left behind


@pytest.mark.parametrize("shape,dtype", [
    ((-1,), jnp.float32), ((2, -3), jnp.float32), ((1.5,), jnp.float32), ("ab", jnp.float32), (3, jnp.float32),
    ((True,), jnp.float32), ((4,), "not-a-dtype"), ((4,), object), ((4,), np.str_),
])
def test_invalid_ticket_shapes_and_dtypes(shape, dtype):
    with pytest.raises(jaxvmm.InvalidArgumentError, match="jaxvmm.Ticket"):
        jaxvmm.Ticket(jnp.zeros((2,), jnp.uint32), shape, dtype)


def test_checkpoint_static_argnums_checked_at_wrap_time():
    with pytest.raises(jaxvmm.InvalidArgumentError, match="static_argnums"):
        jaxvmm.checkpoint(lambda x: x, static_argnums="a")
    with pytest.raises(TypeError, match="static_argnums"):
        jaxvmm.checkpoint(lambda x: x, static_argnums=(0.5,))


def test_vmapped_ticket_reloaded_without_vmap_hints_at_vmap():
    xs = jnp.arange(12.0).reshape(3, 4)
    t = jax.vmap(jaxvmm.offload)(xs)
    assert t.token.shape == (3, 2)
    with pytest.raises(jaxvmm.InvalidArgumentError, match=r"vmap.*jax.vmap\(jaxvmm.reload\)"):
        jaxvmm.reload(t)
    with pytest.raises(jaxvmm.InvalidArgumentError, match="vmap"):
        jax.jit(jaxvmm.reload)(t)
    ys = jax.vmap(jaxvmm.reload)(t)  # the ticket was not consumed by the refused calls
    assert np.array_equal(np.asarray(ys), np.asarray(xs))
    drain_errors()


@pytest.mark.parametrize("bad", ["x", None, [1, 2], object()])
def test_offload_refuses_non_arrays_with_jaxvmm_error(bad):
    with pytest.raises(jaxvmm.InvalidArgumentError, match="jaxvmm.offload") as ei:
        jaxvmm.offload(bad)
    assert isinstance(ei.value, TypeError)


def test_slot_argument_errors_are_invalid_argument_errors():
    for kwargs in ({"nbytes": 0}, {"nbytes": -5}, {"nbytes": 1 << 60}, {"nbytes": 4096, "location": "moon"}):
        with pytest.raises(jaxvmm.InvalidArgumentError):
            jaxvmm.Slot(**kwargs)
    with jaxvmm.Slot(4096, device="cpu") as s:
        with pytest.raises(jaxvmm.InvalidArgumentError):
            s.write(b"x", offset=4096)
        with pytest.raises(jaxvmm.InvalidArgumentError):
            s.read(8, offset="0")
