"""``offload`` / ``reload`` / ``prefetch``: move an array out of device memory inside a jitted program
and bring it back later, through fixed-address slots whose pages are returned in between."""

from __future__ import annotations

import functools
import collections
import itertools
import os
import re
import operator
import sys
import threading
import weakref
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi  # noqa: F401  (registers the FFI targets)
from . import _config, _sharded, errors
from ._devices import _posix_ready, target_of
from ._native import lib

_sites = itertools.count(1)
_SITE_LINES: "collections.OrderedDict[int, str]" = collections.OrderedDict()  # site -> "op at file:line (fn)"
_eager_sites: "collections.OrderedDict[tuple, int]" = collections.OrderedDict()  # (op, line, key) -> site
_MAX_SITES = 1 << 14
_OWN = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep, os.sep + "jaxvmm" + os.sep, os.sep + "flax" + os.sep)


def _new_site(op: str, eager_key=None) -> int:
    """A call-site number, remembered with the first user frame that made it (errors name it).

    A traced call gets a new number (one per trace: the number is an attribute, which also keeps XLA
    from merging two offloads of one value). An eager call (``eager_key``: the call's shape, dtype and
    placement) runs as a one-op program with the number among its attributes: it reuses the number of
    the calls from the same source line with the same key, so that program compiles once rather than
    at every call."""
    f = sys._getframe(1)
    while f is not None and (any(o in f.f_code.co_filename for o in _OWN) or f.f_code.co_filename.startswith("<")):
        f = f.f_back
    where = f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})" if f is not None else "unknown"
    with _lock:
        key = (op, where, eager_key)
        n = _eager_sites.get(key) if eager_key is not None else None
        if n is None:
            n = next(_sites)
            if eager_key is not None:
                _eager_sites[key] = n
                if len(_eager_sites) > _MAX_SITES:
                    _eager_sites.popitem(last=False)
        else:
            _eager_sites.move_to_end(key)
        _SITE_LINES[n] = f"{op} at {where}"
        _SITE_LINES.move_to_end(n)
        if len(_SITE_LINES) > _MAX_SITES:
            _SITE_LINES.popitem(last=False)
    return n


def _eager_key(*arrays):
    """What an eager call's one-op program is compiled for, besides its attributes (see _new_site);
    None when any of ``arrays`` is traced (inside jit, vmap, grad: a new site each call)."""
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        return None
    return tuple((tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None))) for a in arrays)


def _name_sites(msg: str) -> str:
    """``msg`` with every ``[call site N]`` the engine wrote spelled out as the Python line that made it."""
    def sub(m):
        line = _SITE_LINES.get(int(m.group(1)))
        return f"[call site {m.group(1)}: {line}]" if line else m.group(0)
    return re.sub(r"\[call site (\d+)\]", sub, msg)


def _named(e: Exception) -> Exception:
    if isinstance(e, errors.VmmError) and e.args and "[call site " in str(e.args[0]):
        e.args = (_name_sites(str(e.args[0])),) + e.args[1:]
    return e
_TOKEN = jax.ShapeDtypeStruct((2,), jnp.uint32)


def _storage_dtype(dtype) -> np.dtype:
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


def _signature(shape, dtype) -> int:
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
        self.shape = _check_shape(shape, "Ticket")
        self.dtype = _check_dtype(dtype, "Ticket")
        if not isinstance(sharded, (bool, np.bool_)):
            raise _type_error(f"jaxvmm.Ticket: sharded must be a bool, got {type(sharded).__name__}")
        self.sharded = bool(sharded)
        if (isinstance(token, jax.Array) and not isinstance(token, jax.core.Tracer)
                and token.dtype == jnp.uint32 and tuple(token.shape)[-1:] == (2,)):
            _track(token)

    @property
    def nbytes(self) -> int:
        """Bytes jaxvmm holds for the ticket (sub-byte dtypes: one byte per element)."""
        return int(np.prod(self.shape, dtype=np.int64)) * _storage_dtype(self.dtype).itemsize

    def _local_nbytes(self, token_shard_shape) -> int:
        """Bytes one device holds for the ticket, given the shape of its block of the token."""
        if not self.sharded:
            return self.nbytes
        dims = tuple(self.token.shape[:-1])
        local = [d // (k // c) for d, k, c in zip(self.shape, dims, token_shard_shape[:-1])]
        return int(np.prod(local, dtype=np.int64)) * _storage_dtype(self.dtype).itemsize

    def tree_flatten(self):
        return (self.token,), (self.shape, self.dtype, self.sharded)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        extra = ", sharded" if self.sharded else ""
        return f"Ticket(shape={self.shape}, dtype={self.dtype.name}{extra})"


# ---- Python-side ticket lifetimes ----
# A ticket that Python stops referencing without reloading it must give its pinned memory back. Token
# values get copied (a jit that passes a ticket through returns a new token array with the same value),
# and jit dispatch is asynchronous (a reload may not have reached the engine yet), so a value is
# dropped only when (1) no token array that jaxvmm has seen in a Ticket is alive anywhere (CPython
# refcount: only this registry holds it), (2) every computation dispatched before it died has finished
# (its barrier: a fence per device, see _fences, and the live arrays in flight then), and (3) no holder
# holds the same value. Holders are the live tracked tokens and the dead ones whose barrier is not
# ready yet (copies of them may still be on their way); a holder's values are read once it is ready.
# A copy still on its way needs no reading: the token it copies was a holder when it was dispatched
# and stays one, ready, until it is (alive, or dead with the copy in its barrier). Except where that
# token was deleted (donated) before it was read: its values went into the donating computation, and
# until that computation's outputs are ready (the lost holder's own barrier), no value is dropped
# while any holder is not ready. What a donating computation does not return is found by collect().
_lock = threading.RLock()
_tracked: dict[int, jax.Array] = {}  # id -> token array seen in a concrete Ticket (strong reference)
_values: dict[int, list] = {}  # id -> [(device, uint64 values)] of a holder, read once it was ready
_unread: set[int] = set()  # ids of holders whose values are not read yet (ids only: no extra reference)
_held: collections.Counter = collections.Counter()  # (device, value) -> how many holders' values have it
_lost: dict[int, list] = {}  # id -> barrier of a holder deleted before it was read (see above)
_dying: list[tuple[jax.Array, list]] = []  # (dead token array, its barrier: callables giving arrays)
_kept: set[int] = set()  # ids of tracked token arrays whose tickets _keep marked kept


def _refcount_when_unreferenced() -> int:
    # What sys.getrefcount reports, in _collect's loop, for an object only the registry holds. Measured
    # rather than assumed: the count of temporary references differs between Python versions.
    d = {0: object()}
    n = 0
    for key in list(d):
        token = d[key]
        n = sys.getrefcount(token)
        del token
    return n


_UNREFERENCED = _refcount_when_unreferenced()


def _finished(a) -> bool:
    """Whether ``a`` needs no more waiting for: gone, deleted (donated), or ready (its computation
    finished, failed included). Another thread may delete it between the two checks."""
    if a is None:
        return True
    try:
        return a.is_deleted() or a.is_ready()
    except Exception:  # noqa: BLE001  (deleted in between: "Array has been deleted")
        return True


def _wait_quietly(a) -> None:
    """Blocks until ``a`` is finished (see _finished). A failed computation's error is its array's, raised
    where that array is used, not here."""
    try:
        if a is not None and not a.is_deleted():
            a.block_until_ready()
    except Exception:  # noqa: BLE001  (failed, or deleted by another thread meanwhile)
        pass


def _track(token) -> None:
    with _lock:
        if id(token) not in _tracked:
            _tracked[id(token)] = token
            _unread.add(id(token))
    _collect()


def _token_values(token) -> list[tuple[jax.Device, np.ndarray]]:
    out = []
    for shard in token.addressable_shards:
        # A copy: on cpu np.asarray is a view that would keep the token array alive.
        host = np.array(shard.data, copy=True)
        # float32: the bits of a token (jaxvmm.checkpoint carries a residual's tangent ticket that way)
        host = (host.view(np.uint32) if host.dtype == np.float32 else host.astype(np.uint32)).reshape(-1, 2)
        vals = host.view(np.uint64).reshape(-1)
        # A sharded ticket's block repeats its device's ticket in every cell: each value once.
        out.append((shard.device, vals if len(vals) <= 1 else np.unique(vals)))
    return out


def _read_holders() -> bool:
    """Reads the values of every holder that is ready now (call with _lock held). Returns False while
    a holder lost unread (donated) may still have copies on their way and a holder is not ready."""
    for key, barrier in list(_lost.items()):
        if all(_finished(r()) for r in barrier):
            del _lost[key]  # the donating computation's outputs are ready: read below if tracked
    waiting = False
    holders = _holders()
    for key in list(_unread):
        token = holders.get(key)
        if token is not None and not _finished(token):
            waiting = True
            continue
        _unread.discard(key)
        if token is None:
            continue
        try:
            vals = [(d, int(v)) for d, vs in _token_values(token) for v in vs]
        except Exception:  # noqa: BLE001  (deleted, by donation, before it could be read)
            _lost[key] = _barrier()
            waiting = True
            continue
        _values[key] = vals
        _held.update(vals)
    return not (waiting and _lost)


def _holders() -> dict:
    """id -> token array of every holder: the tracked tokens and the dying ones (call with _lock held)."""
    return {**{id(token): token for token, _ in _dying}, **_tracked}


def _barrier() -> list:
    """What a death (or a loss) waits for: every computation dispatched so far. The fences, and weak
    references to the live arrays in flight (a barrier must not keep arrays, tracked tokens among
    them, alive): on the cpu platform a fence is ordered only after its own thread's computations."""
    barrier = [weakref.ref(a) for a in _live_arrays() if not _finished(a)]
    return barrier + [(lambda f=f: f) for f in _fences()]


def _forget(key: int) -> list:
    """A holder is no longer one: its values leave _held; returns them (call with _lock held)."""
    _unread.discard(key)
    _lost.pop(key, None)
    vals = _values.pop(key, [])
    _held.subtract(vals)
    for v in vals:
        if _held[v] <= 0:
            del _held[v]
    return vals


def _wait_for_pending() -> None:
    """Blocks until the barriers of the dying tokens and of the lost holders, and every holder not read
    yet, are finished."""
    with _lock:
        holders = _holders()
        pending = [r() for entry in _dying for r in entry[1]] + [r() for b in _lost.values() for r in b]
        pending += [holders.get(key) for key in _unread]
    for a in pending:
        _wait_quietly(a)


def _collect(wait: bool = False) -> None:
    """Hands the tickets of tokens that died to their engines once nothing can reload them any more
    (see the rules above and ffi/DESIGN.md, *Lifetimes*); with ``wait``, first blocks until the
    barriers of those that died before this call are ready and every holder is."""
    if wait:
        _wait_for_pending()  # its own frame: no reference to a tracked token outlives it
    with _lock:
        dead = []
        for key in list(_tracked):
            token = _tracked[key]
            if sys.getrefcount(token) <= _UNREFERENCED:  # only this registry holds it
                dead.append(key)
            del token
        if dead:
            barrier = _barrier()  # first: should it fail, the dead stay tracked and are found next time
            for key in dead:
                _dying.append((_tracked.pop(key), barrier))
                _kept.discard(key)
        if not _dying:
            return
        ready = [entry for entry in _dying if _finished(entry[0]) and all(_finished(r()) for r in entry[1])]
        if not ready or not _read_holders():
            return
        taken = {id(entry) for entry in ready}  # by identity: == on token arrays compares them
        _dying[:] = [entry for entry in _dying if id(entry) not in taken]
        freed = {v for token, _ in ready for v in _forget(id(token))}
        drops = [v for v in freed if _held[v] <= 0]
    for device, v in drops:
        tgt = target_of(device)
        lib.engine_drop(tgt.backend, tgt.ordinal, v)


def _keep(token) -> bool:
    """Marks the tickets of a concrete token array kept: reloads no longer consume them, so a function
    holding the token (a ``jax.vjp`` function) may reload them any number of times, eagerly or inside
    ``jax.jit``. They are freed when the last array holding the token dies (the lifetime registry
    above tracks it from now on) or by :func:`collect`. Returns False for a traced token (inside a
    trace a reload consumes its ticket: nothing outside the program can reload it again)."""
    if not isinstance(token, jax.Array) or isinstance(token, jax.core.Tracer):
        return False
    # float32: the bits of a token (a residual's tangent ticket, see jaxvmm.remat._rules)
    if token.dtype not in (jnp.uint32, jnp.float32) or tuple(token.shape)[-1:] != (2,):
        raise _value_error(f"jaxvmm: internal: not a ticket token: {token.dtype}{list(token.shape)}")
    with _lock:
        if _tracked.get(id(token)) is token and id(token) in _kept:  # this very array was kept already
            return True
    _track(token)
    for device, values in _token_values(token):
        tgt = target_of(device)
        for v in values:
            lib.engine_keep(tgt.backend, tgt.ordinal, int(v))
    with _lock:
        if _tracked.get(id(token)) is token:
            _kept.add(id(token))
    return True


# ---- validation ----
def _type_error(msg: str) -> errors.InvalidArgumentTypeError:
    return errors.InvalidArgumentTypeError(msg, code="invalid_argument")


def _value_error(msg: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(msg, code="invalid_argument")


def _check_dtype(dtype, what: str) -> np.dtype:
    try:
        extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    except TypeError:
        extended = False
    if extended:
        raise _type_error(f"jaxvmm.{what}: dtype {dtype} (an extended dtype such as PRNG keys) cannot be offloaded; "
                          "offload jax.random.key_data(x) instead")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise _type_error(f"jaxvmm.{what}: {dtype!r} is not a dtype") from None
    if not (jnp.issubdtype(dt, jnp.number) or jnp.issubdtype(dt, jnp.bool_)):
        raise _type_error(f"jaxvmm.{what}: unsupported dtype {dt} (numbers and bool only)")
    return dt


def _check_shape(shape, what: str) -> tuple:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise _type_error(f"jaxvmm.{what}: shape must be a tuple of ints, got {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool):
            raise _type_error(f"jaxvmm.{what}: shape {tuple(shape)!r} has a bool dimension")
        try:
            d = operator.index(d)
        except TypeError:
            raise _type_error(f"jaxvmm.{what}: shape {tuple(shape)!r} must hold ints, got {type(d).__name__}") from None
        if d < 0:
            raise _value_error(f"jaxvmm.{what}: shape {tuple(shape)!r} has a negative dimension")
        out.append(d)
    if int(np.prod(out, dtype=object)) > _config.INT64_MAX:
        raise _value_error(f"jaxvmm.{what}: shape {tuple(out)!r} has more elements than fit in int64")
    return tuple(out)


def _as_array(x, what: str):
    """``x`` as a jax array: jax and numpy arrays and scalars, and objects with ``__jax_array__`` (taken
    through ``jnp.asarray``, like every jax API). Anything else is refused."""
    if isinstance(x, Ticket):
        raise _type_error(f"jaxvmm.{what}: got a Ticket; offload arrays, reload tickets")
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)) and not hasattr(x, "__jax_array__"):
        raise _type_error(f"jaxvmm.{what}: expected an array, got {type(x).__name__}")
    if not isinstance(x, jax.Array):
        if isinstance(x, (np.ndarray, np.generic)):
            _check_dtype(x.dtype, what)  # before jnp.asarray: it would turn object/str arrays into errors of its own
        try:
            x = jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise _type_error(f"jaxvmm.{what}: cannot convert {type(x).__name__} to a jax array ({e})") from None
    return x


def _check_array(x, what: str):
    _check_dtype(x.dtype, what)
    if int(np.prod(x.shape, dtype=np.int64)) == 0:
        raise _value_error(f"jaxvmm.{what}: cannot offload a zero-size array (shape {x.shape})")


def _translate(e: Exception) -> Exception:
    """The jaxvmm error an eager ffi call's ``JaxRuntimeError`` carries (see ``errors.from_jax_error``)."""
    return _named(errors.from_jax_error(e) or e)


# ---- offload ----
@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _offload(x, signature: int, site: int):
    return jax.ffi.ffi_call("jaxvmm_offload", _TOKEN, vmap_method="sequential")(
        x, signature=np.int64(signature), site=np.int64(site))


@_offload.defjvp
def _offload_jvp(signature, site, primals, tangents):
    raise TypeError(
        "jaxvmm.offload/reload are not differentiable: the ticket is an integer token, so gradients "
        "cannot flow through it. Use jaxvmm.checkpoint(fn, policy=...) (alias jaxvmm.remat) to offload "
        "residuals with correct gradients, or apply jax.lax.stop_gradient(x) before offloading.")


def _mesh_for(x):
    """The mesh an offload of ``x`` is partitioned over (each device offloads its own shard), or None
    for the one-device path: unsharded arrays, scalars, and shard_map bodies (already per device)."""
    return _sharded.mesh_of(x) if jnp.ndim(x) else None


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _offload_sharded(x, signature: int, site: int, mesh):
    return _sharded.offload(x, signature, site, mesh)


@_offload_sharded.defjvp
def _offload_sharded_jvp(signature, site, mesh, primals, tangents):
    _offload_jvp(signature, site, primals, tangents)


def offload(x) -> Ticket:
    """Copy ``x`` into host memory and return a :class:`Ticket` for it.

    Inside ``jit``: XLA's stream snapshots ``x`` into a staging cell (a fixed-address slot), a copy
    stream moves it to pinned host memory, and the cell is free for the next op once that copy is done
    (idle cells' pages go back to the driver after ``staging_idle_ms``, or on ``jaxvmm.trim()``). ``x``'s
    own buffer is free for XLA to reuse right after the call."""
    x = _as_array(x, "offload")
    _check_array(x, "offload")
    _posix_ready()  # the cpu engine serves every cpu device the handlers may run on
    _collect()
    wide = _storage_dtype(x.dtype)
    mesh = _mesh_for(x)
    try:
        v = x if wide == x.dtype else x.astype(wide)
        site = _new_site("offload", _eager_key(v))
        if mesh is not None:  # sharded over several devices under plain jit: each device offloads its shard
            token = _offload_sharded(v, _signature(x.shape, x.dtype), site, mesh)
        else:
            token = _offload(v, _signature(x.shape, x.dtype), site)
    except jax.errors.JaxRuntimeError as e:  # eager: the handler's error, as the jaxvmm error it is
        raise _translate(e) from e
    return Ticket(token, x.shape, x.dtype, mesh is not None)


# ---- reload / prefetch ----
def _check_ticket(t: Ticket, what: str, reserve: bool) -> list:
    """Validates a ticket; for a concrete token also checks it with its engine now (and, with
    ``reserve``, reserves it for this eager reload). Returns the (target, token value) pairs checked."""
    if not isinstance(t, Ticket):
        raise _type_error(f"jaxvmm.{what}: expected a jaxvmm.Ticket, got {type(t).__name__}")
    tok = t.token
    if t.sharded:
        return _check_sharded_ticket(t, what, reserve)
    if getattr(tok, "shape", None) is None or tuple(tok.shape)[-1:] != (2,) or tok.dtype != jnp.uint32:
        raise errors.InvalidArgumentError(f"jaxvmm.{what}: the ticket's token is not a uint32[2] array "
                                          f"(got {getattr(tok, 'dtype', None)}{list(getattr(tok, 'shape', ()))}); "
                                          "was it built by jaxvmm.offload?", code="invalid_argument")
    if len(tok.shape) > 1:
        raise _value_error(f"jaxvmm.{what}: the ticket's token has shape {tuple(tok.shape)}: it holds "
                           f"{int(np.prod(tok.shape[:-1]))} tickets, one per element of a jax.vmap batch. "
                           f"{what.capitalize()} it inside jax.vmap (e.g. jax.vmap(jaxvmm.{what})(ticket)), "
                           "with the same batch axes as the offload")
    if isinstance(tok, (np.ndarray, np.generic)):  # a numpy token is as concrete as a jax one: check it now
        tok = jnp.asarray(tok)
    if isinstance(tok, jax.Array) and not isinstance(tok, jax.core.Tracer) and tok.ndim == 1:
        # Outside jit the token is concrete: check it now so a bad ticket raises here, synchronously.
        sig = _signature(t.shape, t.dtype)
        checked = []
        for device, values in _token_values(tok):
            tgt = target_of(device)
            for v in values:
                lib.engine_check(tgt.backend, tgt.ordinal, int(v), t.nbytes, sig, reserve)
                checked.append((tgt, int(v)))
        return checked
    return []


def _check_sharded_ticket(t: Ticket, what: str, reserve: bool) -> list:
    tok = t.token
    shape = tuple(getattr(tok, "shape", ()) or ())
    if getattr(tok, "dtype", None) == jnp.uint32 and len(shape) > len(t.shape) + 1 and shape[-1:] == (2,):
        raise _value_error(f"jaxvmm.{what}: the sharded ticket's token has shape {shape}: it holds one ticket per "
                           f"element of a jax.vmap batch. {what.capitalize()} it inside jax.vmap (e.g. "
                           f"jax.vmap(jaxvmm.{what})(ticket)), with the same batch axes as the offload")
    if (getattr(tok, "dtype", None) != jnp.uint32 or len(shape) != len(t.shape) + 1 or shape[-1] != 2
            or any(d % max(k, 1) for d, k in zip(t.shape, shape[:-1]))):
        raise errors.InvalidArgumentError(
            f"jaxvmm.{what}: a sharded ticket of shape {t.shape} needs a uint32 token of rank {len(t.shape) + 1} "
            f"ending in 2 whose leading dimensions divide the array's (got {getattr(tok, 'dtype', None)}"
            f"{list(shape)}); was it built by jaxvmm.offload?", code="invalid_argument")
    if isinstance(tok, jax.core.Tracer) or not isinstance(tok, jax.Array):  # numpy: not on any device
        return []
    sig = _signature(t.shape, t.dtype)
    checked = []
    try:
        blocks = {shard.device: tuple(shard.data.shape) for shard in tok.addressable_shards}
        for device, values in _token_values(tok):
            tgt = target_of(device)
            for v in values:
                lib.engine_check(tgt.backend, tgt.ordinal, int(v), t._local_nbytes(blocks[device]), sig, reserve)
                checked.append((tgt, int(v)))
    except Exception:
        for tgt, v in checked if reserve else ():
            lib.engine_unreserve(tgt.backend, tgt.ordinal, v)
        raise
    return checked


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _dep_scalar(deps: list):
    """A uint32 scalar that exists only once every array in ``deps`` does (the bits of each one's first
    element, or-ed). Its value is meaningless: :func:`_tie_leaf` uses it so that the result does not
    depend on it."""
    s = None
    for d in deps:
        if jnp.issubdtype(d.dtype, jnp.complexfloating):
            d = jnp.real(d)
        if _explicitly_sharded(d):  # jax refuses to slice one element out of a dimension typed as sharded
            e = jnp.max(d)
        else:
            e = d[(0,) * d.ndim] if d.ndim else d  # indexing, not ravel: ravel of a sharded array gathers it
        if e.dtype == jnp.bool_ or e.dtype.itemsize not in _UINT or jax.dtypes.issubdtype(e.dtype, jax.dtypes.extended):
            u = e.astype(jnp.uint32) if not jax.dtypes.issubdtype(e.dtype, jax.dtypes.extended) else None
        else:
            u = jax.lax.bitcast_convert_type(e, _UINT[e.dtype.itemsize]).astype(jnp.uint32)
        if u is not None:
            s = u if s is None else s | u
    return s


def _explicitly_sharded(d) -> bool:
    """``d``'s type says it is sharded (a mesh with Explicit axes): jax checks slicing against it."""
    try:
        spec = getattr(getattr(_sharded._typeof(d), "sharding", None), "spec", None)
    except TypeError:
        return False
    return any(e is not None for e in (spec or ()))


def _tie_leaf(x, s):
    """``x`` unchanged, computed from the scalar ``s``: ``min(b, b | s)`` is ``b`` for every unsigned ``b``
    and ``s``, so the result is bit-exact whatever the values (inf, nan, -0.0 included), yet XLA must
    compute ``s`` first. Arithmetic on purpose: XLA:CPU removes optimization barriers before it schedules.
    Returns None for dtypes it cannot handle."""
    dt = x.dtype
    if dt == jnp.bool_:
        return x & (x | s.astype(jnp.bool_))
    if jax.dtypes.issubdtype(dt, jax.dtypes.extended) or jnp.issubdtype(dt, jnp.complexfloating):
        return None
    u = _UINT.get(dt.itemsize)
    if u is None:
        return None
    b = x if dt == u else jax.lax.bitcast_convert_type(x, u)
    b = jnp.minimum(b, b | s.astype(u))
    return b if dt == u else jax.lax.bitcast_convert_type(b, dt)


def _tie_cpu(x_leaves, deps):
    s = _dep_scalar(deps)
    if s is None:
        return list(jax.lax.optimization_barrier((x_leaves, deps))[0])
    out = []
    for x in x_leaves:
        t = _tie_leaf(x, s)
        out.append(jax.lax.optimization_barrier((x, deps))[0] if t is None else t)
    return out


def _tie(x_leaves: list, deps: list, *, small: bool = False) -> list:
    """``x_leaves`` with a value-independent dependency on ``deps``. On GPUs an optimization_barrier
    (free; XLA:GPU removes barriers only after scheduling). On cpu, where XLA removes barriers before it
    schedules, elementwise arithmetic that leaves the bits unchanged (:func:`_tie_leaf`). ``small``: the
    leaves are tiny (ticket tokens), use the arithmetic everywhere."""
    x_leaves = [jnp.asarray(x) for x in x_leaves]
    deps = [d for d in deps if isinstance(d, (jax.Array, np.ndarray)) and d.dtype != jax.dtypes.float0 and d.size]
    if not x_leaves or not deps:
        return x_leaves
    if small:
        return _tie_cpu(x_leaves, deps)
    return list(jax.lax.platform_dependent(
        x_leaves, deps, cpu=_tie_cpu,
        default=lambda xs, ds: list(jax.lax.optimization_barrier((xs, ds))[0])))


def after(dep, x):
    """``x``, ordered after ``dep``: inside jit, nothing that uses the returned ``x`` can run before every
    array in ``dep`` (a pytree: arrays, :class:`Ticket` s, ...) exists. Values are bit-exact whatever
    they are (inf and nan included): the dependency does not look at them. Gradients flow through
    ``x``; ``x`` may be an array, a Ticket or a pytree of them.

    Use it to make XLA run an offload where it is written::

        t = jaxvmm.offload(y)
        x = jaxvmm.after(t, x)         # what uses x below runs after the offload
        z = heavy(x)
        out = jaxvmm.reload(t, after=z) * z

    Cost: nothing on GPUs (an ``optimization_barrier``); on cpu an elementwise pass over ``x`` (XLA:CPU
    drops barriers before scheduling), so tie something small when you can."""
    x_leaves, tree = jax.tree.flatten(x)
    for v in x_leaves:
        if not isinstance(v, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"jaxvmm.after: x must be an array, a Ticket or a pytree of them; got a leaf of type "
                            f"{type(v).__name__}")
    for d in jax.tree.leaves(dep):
        if not isinstance(d, (jax.Array, np.ndarray, np.generic, int, float, complex)):  # Python numbers: no order
            raise TypeError(f"jaxvmm.after: dep must be an array, a Ticket or a pytree of them; got a leaf of type "
                            f"{type(d).__name__}")
    small = isinstance(x, Ticket)
    return jax.tree.unflatten(tree, _tie(x_leaves, jax.tree.leaves(dep), small=small))


def reload(ticket: Ticket, *, after=None) -> jax.Array:
    """Bring a ticket's array back: same shape and dtype (and, inside jit, sharding) as the original.

    ``after``: optional arrays (any pytree); inside jit the reload cannot start before they exist. A
    reload depends only on its ticket, so without it XLA may schedule the reload right after the
    offload (keeping the data on the device all along); pass what the program computes in between.

    The runtime copies host -> staging cell on a copy stream as soon as the cell is free (ahead of
    need), makes XLA's stream wait for exactly that cell, then copies into XLA's output."""
    _posix_ready()
    if after is not None and isinstance(ticket, Ticket):
        ticket = _after(after, ticket)
    reserved = _check_ticket(ticket, "reload", reserve=True)
    _collect()
    wide = _storage_dtype(ticket.dtype)  # sub-byte dtypes travel widened (see _storage_dtype)
    try:
        site = _new_site("reload", _ticket_key(ticket))
        if ticket.sharded:  # sharded under plain jit: each device reloads its own shard
            y = _sharded.reload(ticket.token, ticket.shape, wide, _signature(ticket.shape, ticket.dtype), site)
        else:
            y = jax.ffi.ffi_call("jaxvmm_reload", jax.ShapeDtypeStruct(ticket.shape, wide), vmap_method="sequential")(
                ticket.token, signature=np.int64(_signature(ticket.shape, ticket.dtype)), site=np.int64(site))
    except Exception as e:
        for tgt, v in reserved:  # the eager reload never ran: the ticket may be reloaded again
            lib.engine_unreserve(tgt.backend, tgt.ordinal, v)
        if isinstance(e, jax.errors.JaxRuntimeError):
            raise _translate(e) from e
        raise
    return y if wide == ticket.dtype else y.astype(ticket.dtype)


_after = after  # reload's keyword argument shadows the name


def _ticket_key(ticket: Ticket):
    """_eager_key of a ticket's token, with the shape and dtype it reloads to."""
    key = _eager_key(ticket.token)
    return None if key is None else key + ((tuple(ticket.shape), str(ticket.dtype), ticket.sharded),)


def prefetch(ticket: Ticket) -> Ticket:
    """Hint: start bringing ``ticket``'s data back to the device now (at this point of the program).

    Returns a ticket to reload instead of the original (it carries the ordering). The runtime already
    prefetches in reverse offload order by itself; use this when your reload order differs."""
    _posix_ready()
    _check_ticket(ticket, "prefetch", reserve=False)
    try:
        site = _new_site("prefetch", _ticket_key(ticket))
        if ticket.sharded:
            token = _sharded.prefetch(ticket.token, site)
        else:
            token = jax.ffi.ffi_call("jaxvmm_prefetch", _TOKEN, vmap_method="sequential")(ticket.token, site=np.int64(site))
    except jax.errors.JaxRuntimeError as e:
        raise _translate(e) from e
    return Ticket(token, ticket.shape, ticket.dtype, ticket.sharded)


# ---- engine-wide ----
def check() -> None:
    """Raise the first asynchronous error any engine recorded since the last check (for example a
    reload, inside jit, of a ticket that was already reloaded). Handlers also raise it on their next call."""
    _collect()
    for backend, device in lib.engine_devices():
        try:
            lib.engine_take_error(backend, device)
        except errors.VmmError as e:
            raise _named(e) from None


@functools.lru_cache(maxsize=None)
def _fence(device):
    # Compiled: calling it inside a trace (offload/reload under jit run _collect) runs it, not stages it.
    return jax.jit(lambda: jnp.zeros((), jnp.uint8),
                   out_shardings=jax.sharding.SingleDeviceSharding(device)).lower().compile()


def _fences() -> list:
    """A trivial computation dispatched now on each of this process's devices. jax runs a device's
    computations in the order they were dispatched, so each is ready only after every computation
    dispatched before it on its device, one whose outputs were all dropped (no live array leads to it)
    included. On the cpu platform that order holds per dispatching thread only (a fence does not wait
    for a computation another thread dispatched): the live arrays not ready yet cover those."""
    with jax.disable_jit(False):  # under jax.disable_jit() a compiled program refuses to run
        return [_fence(d)() for d in _per_platform(lambda platform: jax.local_devices(backend=platform))]


def _per_platform(get) -> list:
    """``get(platform)`` of every platform jax has, concatenated (cpu and gpu: jax's own calls of that
    kind see only the default platform, so on a GPU machine they would miss the cpu devices)."""
    out = []
    for platform in ("cpu", "gpu"):
        try:
            out += get(platform)
        except RuntimeError:  # this platform is not initialized (JAX_PLATFORMS) or does not exist
            continue
    return out


def _live_arrays() -> list:
    """Live arrays of every platform jax has (see _per_platform)."""
    return _per_platform(jax.live_arrays)


def synchronize() -> None:
    """Block until every jax computation dispatched so far has finished, those whose outputs were all
    discarded included, then until every offload/reload enqueued so far has completed and jaxvmm's
    workers are idle. Tickets whose tokens never reach Python are freed by :func:`collect`, which
    reads every live token array (kept out of this call, which benchmarks and tests use on hot paths)."""
    _settle()
    for backend, device in lib.engine_devices():
        lib.engine_sync(backend, device)


def _settle() -> None:
    """Waits for every computation dispatched so far and the engines, then hands the engines the
    tickets of every token that died before (see _collect)."""
    _drain_dispatched()
    for backend, device in lib.engine_devices():
        lib.engine_sync(backend, device)
    for _ in range(3):  # a drop can release the last reference that kept another token alive
        _collect(wait=True)


def _drain_dispatched() -> None:
    """Wait for every computation dispatched so far on this process's devices, including one whose
    outputs were all dropped (see _fences; on the cpu platform, one that this thread dispatched): what
    a death waits for (_barrier), waited for now."""
    for r in _barrier():
        _wait_quietly(r())


def _is_token_array(a) -> bool:
    # float32: the bits of a token (jaxvmm.checkpoint's tangent tickets travel that way)
    return a.dtype in (jnp.uint32, jnp.float32) and a.ndim >= 1 and a.shape[-1] == 2 and not a.is_deleted()


def _sweep_unreachable(issued: dict) -> int:
    """Drops every ticket issued by ``issued[(backend, device)]`` (sequence numbers read before the
    computations in flight were drained) that no reload consumed and no live jax array holds. Reads
    token-like arrays only when such a ticket exists."""
    candidates = {}
    for (backend, device), last in issued.items():
        mine = [int(token) for token, seq in lib.engine_unclaimed_tickets(backend, device) if seq <= last]
        if mine:
            candidates[(backend, device)] = np.array(mine, np.uint64)
    if not candidates:
        return 0
    held = set()
    for a in _live_arrays():
        try:
            if not _is_token_array(a):
                continue
            for dev, vals in _token_values(a):
                tgt = target_of(dev)
                mine = candidates.get((tgt.backend, tgt.ordinal))
                if mine is not None:
                    held.update((tgt.backend, tgt.ordinal, int(v)) for v in mine[np.isin(mine, vals)])
        except Exception:  # noqa: BLE001  (deleted (donated) between the check and the read: it holds nothing any more)
            continue
    dropped = 0
    for (backend, device), mine in candidates.items():
        for token in mine.tolist():
            if (backend, device, token) not in held:
                lib.engine_drop(backend, device, token)
                dropped += 1
    return dropped


def collect() -> int:
    """Free the tickets that can no longer be reloaded: those whose token no live jax array holds.

    A ticket normally lives while a ``Ticket`` (or any jax array holding its token, such as the
    residuals inside a ``jax.vjp`` function) is alive, and until it is reloaded. Tickets whose tokens
    never leave a jitted computation (offloaded, then reloaded in only one branch of a ``lax.cond``),
    or whose last holder died inside jax (a ``vjp_fn`` dropped uncalled), are found here: after every
    computation dispatched so far has finished, each live ticket that no reload consumed and whose token no live
    jax array holds is dropped (its host memory is freed once the GPU has passed every op enqueued so
    far). Call it between steps of a loop whose tickets do not reach Python (every few steps), to keep
    host memory constant; it waits for the computations in flight and reads every live token array, so it
    is not free. A token copied out of jax (to numpy, or to another
    process) is not seen: keep tickets in jax arrays. Returns how many tickets were dropped."""
    # Only tickets issued before the call: once the computations dispatched so far have finished, so
    # has every computation that issued one of them (its reload of it included). One issued while this
    # waits may come from a computation another thread dispatched meanwhile, still running: the next
    # call judges it. (On the cpu platform a fence waits only for its own thread's computations, and
    # another thread's computation may issue a ticket before its output is a live array: the second
    # drain waits for that output.)
    issued = {(backend, device): int(lib.engine_stats(backend, device)["seq_issued"])
              for backend, device in lib.engine_devices()}
    _settle()
    _drain_dispatched()
    for backend, device in lib.engine_devices():
        lib.engine_sync(backend, device)
    n = _sweep_unreachable(issued)
    for backend, device in lib.engine_devices():
        lib.engine_sync(backend, device)
    return n


def configure(**settings) -> dict:
    """Set engine settings (process-wide) at run time; returns the values in force, read back from the
    core. A keyword left out (or ``None``) keeps its setting. Every value is validated before any is
    set: a bad one raises ``InvalidArgumentError`` (``InvalidArgumentTypeError`` for a value of the
    wrong type) naming it. Sizes are ints or strings such as ``"512M"`` or ``"1GiB"`` (K, M, G, T, with
    or without B/iB, all powers of 1024). The keywords, their defaults and environment variables (read
    at ``import jaxvmm``) come from one table, jaxvmm/_config.py:

"""
    return _config.configure(lib, "user", "configure", settings)


configure.__doc__ = (configure.__doc__ or "") + _config.keywords_doc("user")


def reserve_host(nbytes: int | str, device=None) -> None:
    """Pin host memory for offloaded arrays now, before the steps that need it.

    Makes sure the host store of ``device`` (jax's default device when ``None``; an index, a
    ``jax.Device`` or a string such as ``"cuda:0"``) has a free block of at least ``nbytes`` (an int,
    or a size string such as ``"14G"``), pinning a new chunk if it has none. Otherwise the pool grows
    while the first steps run, and pinning is slow (about 0.6 s per GiB on an H200 host): the first
    steps of a job whose round tickets outgrow the pool go through pageable memory and wait for the
    grower. ``host_stats()["window_peak_in_use_bytes"]`` of an earlier run tells how much a step
    needs. Pinned host memory also takes a little device memory for its mappings (about 1.5 MiB per
    GiB on an H200): near a device budget's edge, leave room for it. Raises ``OutOfMemoryError`` past
    ``host_pool_limit``."""
    n = _config.parse_size(nbytes, "jaxvmm.reserve_host: nbytes")
    tgt = target_of(device)
    lib.engine_reserve_host(tgt.backend, tgt.ordinal, n)


def trim() -> int:
    """Return every idle staging page to the driver now (they also go back by themselves after
    ``staging_idle_ms`` without an op), and the host_numa store's empty chunks (their VA ranges stay
    reserved; the pinned pool keeps its chunks). Returns the bytes returned."""
    n = 0
    for backend, device in lib.engine_devices():
        n += int(lib.engine_trim(backend, device))
    return n


def engine_stats() -> dict:
    """Per device (``"cuda:0"``, ``"cpu:0"``): offloads, reloads, prefetch hits/misses, live tickets and
    their host bytes, pinned pool bytes and driver allocations, async errors, handler host time per
    call (``handler_median_ns``, ``handler_p99_ns``, per kind ``handler_offload_median_ns``, ``handler_reload_median_ns``; ``ring_copy_kernel``: 1 when uncaptured calls copy with
    jaxvmm's kernel, 0 with driver copies), where the pipeline stands (``seq_issued``, ``seq_completed``: what to look at when a program
    seems stuck), and the staging area: ``staging_budget_bytes``, ``staging_mapped_bytes`` (now),
    ``staging_peak_bytes``, ``staging_cells``, ``staging_acquires``, ``staging_device_waits`` (acquires
    whose stream waited for the cell's previous user: back-pressure on the device), ``staging_host_waits``
    (the rare acquires that waited on the host), ``staging_pages_mapped`` / ``staging_pages_returned``
    (driver page operations: constant in steady state), ``staging_shared_pages`` (page slots that cells
    of at most half a page share now), ``staging_offload_cells`` /
    ``staging_reload_cells`` (cells in each direction's pool), ``staging_direct_reloads`` (uncaptured
    reloads of a size a graph-mode call site was recorded for, copied straight into XLA's buffer
    instead of through a new staging cell), and the host store: ``host_store`` (the
    store new offloads draw from), ``host_store_bytes`` (what it holds), ``pinned_*`` and ``host_numa_*``
    (bytes held, in use, peak in use, chunks taken and returned, host time spent taking them)."""
    _collect()
    out = {}
    for backend, device in lib.engine_devices():
        out[f"{'cuda' if backend == 'cuda' else 'cpu'}:{device}"] = dict(lib.engine_stats(backend, device))
    return out
