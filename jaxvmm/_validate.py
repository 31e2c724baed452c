"""Validation of what users pass to offload, reload and Ticket: jaxvmm errors (``TypeError`` and
``ValueError`` subclasses) raised in Python, before anything reaches the engine."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from . import errors

INT64_MAX = (1 << 63) - 1


def type_error(msg: str) -> errors.InvalidArgumentTypeError:
    return errors.InvalidArgumentTypeError(msg, code="invalid_argument")


def value_error(msg: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(msg, code="invalid_argument")


def check_dtype(dtype, what: str) -> np.dtype:
    try:
        extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    except TypeError:
        extended = False
    if extended:
        raise type_error(f"jaxvmm.{what}: dtype {dtype} (an extended dtype such as PRNG keys) cannot be offloaded; "
                          "offload jax.random.key_data(x) instead")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise type_error(f"jaxvmm.{what}: {dtype!r} is not a dtype") from None
    if not (jnp.issubdtype(dt, jnp.number) or jnp.issubdtype(dt, jnp.bool_)):
        raise type_error(f"jaxvmm.{what}: unsupported dtype {dt} (numbers and bool only)")
    return dt


def check_shape(shape, what: str) -> tuple:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise type_error(f"jaxvmm.{what}: shape must be a tuple of ints, got {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool):
            raise type_error(f"jaxvmm.{what}: shape {tuple(shape)!r} has a bool dimension")
        try:
            d = operator.index(d)
        except TypeError:
            raise type_error(f"jaxvmm.{what}: shape {tuple(shape)!r} must hold ints, got {type(d).__name__}") from None
        if d < 0:
            raise value_error(f"jaxvmm.{what}: shape {tuple(shape)!r} has a negative dimension")
        out.append(d)
    if int(np.prod(out, dtype=object)) > INT64_MAX:
        raise value_error(f"jaxvmm.{what}: shape {tuple(out)!r} has more elements than fit in int64")
    return tuple(out)


def as_array(x, what: str):
    """``x`` as a jax array: jax and numpy arrays and scalars, and objects with ``__jax_array__`` (taken
    through ``jnp.asarray``, like every jax API). Anything else is refused."""
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)) and not hasattr(x, "__jax_array__"):
        raise type_error(f"jaxvmm.{what}: expected an array, got {type(x).__name__}")
    if not isinstance(x, jax.Array):
        if isinstance(x, (np.ndarray, np.generic)):
            check_dtype(x.dtype, what)  # before jnp.asarray: it would turn object/str arrays into errors of its own
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise type_error(f"jaxvmm.{what}: cannot convert {type(x).__name__} to a jax array ({e})") from None
    return x


def check_array(x, what: str):
    check_dtype(x.dtype, what)
    if int(np.prod(x.shape, dtype=np.int64)) == 0:
        raise value_error(f"jaxvmm.{what}: cannot offload a zero-size array (shape {x.shape})")
