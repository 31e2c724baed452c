"""``Ticket``: what an offload returns, and the facts of the bytes it stands for."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from . import _lifetimes, errors
from ._validate import check_dtype, check_shape, type_error

TOKEN = jax.ShapeDtypeStruct((2,), jnp.uint32)


def storage_dtype(dtype) -> np.dtype:
    """The dtype jaxvmm moves for ``dtype``. Sub-byte dtypes (int1/2/4, uint1/2/4, float4_e2m1fn) travel
    widened to one byte per element: XLA stores them packed while the FFI counts one byte per element,
    so copying them as they are is not well defined. The widening is a value conversion that XLA does
    exactly (int8/uint8 and float8_e4m3fn hold every value, -0 included), so the round trip is
    bit-exact; the host copy costs one byte per element."""
    dtype = np.dtype(dtype)
    if jax.dtypes.itemsize_bits(dtype) >= 8:
        return dtype
    if jnp.issubdtype(dtype, jnp.signedinteger):
        return np.dtype(jnp.int8)
    if jnp.issubdtype(dtype, jnp.unsignedinteger):
        return np.dtype(jnp.uint8)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 4 and jnp.finfo(dtype).nexp <= 2:
        return np.dtype(jnp.float8_e4m3fn)  # float4_e2m1fn: every value (and -0) exists in e4m3fn
    raise errors.InvalidArgumentError(f"jaxvmm: sub-byte dtype {dtype} is not supported", code="invalid_argument")


def signature(shape, dtype) -> int:
    """A 63-bit hash of (dtype, shape): a reload checks it against the ticket it resolves to."""
    return zlib.crc32(repr((np.dtype(dtype).str, tuple(int(d) for d in shape))).encode()) & 0x7FFFFFFFFFFFFFFF


@jax.tree_util.register_pytree_node_class
class Ticket:
    """What ``offload`` returns: a small ``uint32[2]`` token (the data dependency, a jax array that may
    cross jit boundaries) plus the static shape and dtype of the offloaded array.

    For an array sharded over several devices under plain ``jit`` (``sharded`` is True) the token is
    ``uint32[*dims, 2]``, sharded like the array (``dims[i] = gcd(shape[i], devices)``): each device's
    block holds its own ticket for its own shard (see ``jaxvmm._sharded``).

    Reload a ticket exactly once. When no Python object references a ticket's token any more (and no
    computation in flight can still reload it), its host memory is freed."""

    __slots__ = ("token", "shape", "dtype", "sharded")

    def __init__(self, token, shape, dtype, sharded=False):
        self.token = token
        self.shape = check_shape(shape, "Ticket")
        self.dtype = check_dtype(dtype, "Ticket")
        if not isinstance(sharded, (bool, np.bool_)):
            raise type_error(f"jaxvmm.Ticket: sharded must be a bool, got {type(sharded).__name__}")
        self.sharded = bool(sharded)
        if (isinstance(token, jax.Array) and not isinstance(token, jax.core.Tracer)
                and token.dtype == jnp.uint32 and tuple(token.shape)[-1:] == (2,)):
            _lifetimes.track(token)

    @property
    def nbytes(self) -> int:
        """Bytes jaxvmm holds for the ticket (sub-byte dtypes: one byte per element)."""
        return int(np.prod(self.shape, dtype=np.int64)) * storage_dtype(self.dtype).itemsize

    def _local_nbytes(self, token_shard_shape) -> int:
        """Bytes one device holds for the ticket, given the shape of its block of the token."""
        if not self.sharded:
            return self.nbytes
        dims = tuple(self.token.shape[:-1])
        local = [d // (k // c) for d, k, c in zip(self.shape, dims, token_shard_shape[:-1])]
        return int(np.prod(local, dtype=np.int64)) * storage_dtype(self.dtype).itemsize

    def tree_flatten(self):
        return (self.token,), (self.shape, self.dtype, self.sharded)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        extra = ", sharded" if self.sharded else ""
        return f"Ticket(shape={self.shape}, dtype={self.dtype.name}{extra})"
