"""``offload`` / ``reload`` / ``prefetch``: move an array out of device memory inside a jitted program
and bring it back later, through fixed-address slots whose pages are returned in between; and the
engine-wide calls (``check``, ``configure``, ``reserve_host``, ``trim``, ``engine_stats``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _config, _ffi, _lifetimes, _sharded, _sites, errors  # noqa: F401  (_ffi registers the FFI targets)
from ._devices import _posix_ready, target_of
from ._lifetimes import collect, synchronize  # noqa: F401  (part of this module's API)
from ._native import lib
from ._order import after as _after
from ._ticket import TOKEN, Ticket, signature, storage_dtype
from ._validate import as_array, check_array, type_error, value_error


def _translate(e: Exception) -> Exception:
    """The jaxvmm error an eager ffi call's ``JaxRuntimeError`` carries (see ``errors.from_jax_error``)."""
    return errors.from_jax_error(e) or e


# ---- offload ----
@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _offload(x, signature: int, site: int):
    return jax.ffi.ffi_call("jaxvmm_offload", TOKEN, vmap_method="sequential")(
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
    if isinstance(x, Ticket):
        raise type_error("jaxvmm.offload: got a Ticket; offload arrays, reload tickets")
    x = as_array(x, "offload")
    check_array(x, "offload")
    _posix_ready()  # the cpu engine serves every cpu device the handlers may run on
    _lifetimes._collect()
    wide = storage_dtype(x.dtype)
    mesh = _mesh_for(x)
    try:
        v = x if wide == x.dtype else x.astype(wide)
        site = _sites.new_site("offload", _sites.eager_key(v))
        if mesh is not None:  # sharded over several devices under plain jit: each device offloads its shard
            token = _offload_sharded(v, signature(x.shape, x.dtype), site, mesh)
        else:
            token = _offload(v, signature(x.shape, x.dtype), site)
        if not isinstance(token, jax.core.Tracer):
            # Eager: the offload's own failure (the host pool's cap, say) is this call's, as a jaxvmm error,
            # whether or not x was computed yet (jax would raise it later, where the token is first used).
            token.block_until_ready()
    except jax.errors.JaxRuntimeError as e:  # eager: the handler's error, as the jaxvmm error it is
        raise _translate(e) from e
    return Ticket(token, x.shape, x.dtype, mesh is not None)


# ---- reload / prefetch ----
def _check_ticket(t: Ticket, what: str, reserve: bool) -> list:
    """Validates a ticket; for a concrete token also checks it with its engine now (and, with
    ``reserve``, reserves it for this eager reload). Returns the (target, token value) pairs checked."""
    if not isinstance(t, Ticket):
        raise type_error(f"jaxvmm.{what}: expected a jaxvmm.Ticket, got {type(t).__name__}")
    tok = t.token
    if t.sharded:
        return _check_sharded_ticket(t, what, reserve)
    if getattr(tok, "shape", None) is None or tuple(tok.shape)[-1:] != (2,) or tok.dtype != jnp.uint32:
        raise errors.InvalidArgumentError(f"jaxvmm.{what}: the ticket's token is not a uint32[2] array "
                                          f"(got {getattr(tok, 'dtype', None)}{list(getattr(tok, 'shape', ()))}); "
                                          "was it built by jaxvmm.offload?", code="invalid_argument")
    if len(tok.shape) > 1:
        raise value_error(f"jaxvmm.{what}: the ticket's token has shape {tuple(tok.shape)}: it holds "
                           f"{int(np.prod(tok.shape[:-1]))} tickets, one per element of a jax.vmap batch. "
                           f"{what.capitalize()} it inside jax.vmap (e.g. jax.vmap(jaxvmm.{what})(ticket)), "
                           "with the same batch axes as the offload")
    if isinstance(tok, (np.ndarray, np.generic)):  # a numpy token is as concrete as a jax one: check it now
        tok = jnp.asarray(tok)
    if isinstance(tok, jax.Array) and not isinstance(tok, jax.core.Tracer) and tok.ndim == 1:
        # Outside jit the token is concrete: check it now so a bad ticket raises here, synchronously.
        sig = signature(t.shape, t.dtype)
        checked = []
        for device, values in _lifetimes.token_values(tok):
            tgt = target_of(device)
            for v in values:
                lib.engine(tgt.backend, tgt.ordinal).check(int(v), t.nbytes, sig, reserve)
                checked.append((tgt, int(v)))
        return checked
    return []


def _check_sharded_ticket(t: Ticket, what: str, reserve: bool) -> list:
    tok = t.token
    shape = tuple(getattr(tok, "shape", ()) or ())
    if getattr(tok, "dtype", None) == jnp.uint32 and len(shape) > len(t.shape) + 1 and shape[-1:] == (2,):
        raise value_error(f"jaxvmm.{what}: the sharded ticket's token has shape {shape}: it holds one ticket per "
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
    sig = signature(t.shape, t.dtype)
    checked = []
    try:
        blocks = {shard.device: tuple(shard.data.shape) for shard in tok.addressable_shards}
        for device, values in _lifetimes.token_values(tok):
            tgt = target_of(device)
            for v in values:
                lib.engine(tgt.backend, tgt.ordinal).check(int(v), t._local_nbytes(blocks[device]), sig, reserve)
                checked.append((tgt, int(v)))
    except Exception:
        for tgt, v in checked if reserve else ():
            lib.engine(tgt.backend, tgt.ordinal).unreserve(v)
        raise
    return checked


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
    _lifetimes._collect()
    wide = storage_dtype(ticket.dtype)  # sub-byte dtypes travel widened (see _storage_dtype)
    try:
        site = _sites.new_site("reload", _ticket_key(ticket))
        if ticket.sharded:  # sharded under plain jit: each device reloads its own shard
            y = _sharded.reload(ticket.token, ticket.shape, wide, signature(ticket.shape, ticket.dtype), site)
        else:
            y = jax.ffi.ffi_call("jaxvmm_reload", jax.ShapeDtypeStruct(ticket.shape, wide), vmap_method="sequential")(
                ticket.token, signature=np.int64(signature(ticket.shape, ticket.dtype)), site=np.int64(site))
    except Exception as e:
        for tgt, v in reserved:  # the eager reload never ran: the ticket may be reloaded again
            lib.engine(tgt.backend, tgt.ordinal).unreserve(v)
        if isinstance(e, jax.errors.JaxRuntimeError):
            raise _translate(e) from e
        raise
    return y if wide == ticket.dtype else y.astype(ticket.dtype)




def _ticket_key(ticket: Ticket):
    """_eager_key of a ticket's token, with the shape and dtype it reloads to."""
    key = _sites.eager_key(ticket.token)
    return None if key is None else key + ((tuple(ticket.shape), str(ticket.dtype), ticket.sharded),)


def prefetch(ticket: Ticket) -> Ticket:
    """Hint: start bringing ``ticket``'s data back to the device now (at this point of the program).

    Returns a ticket to reload instead of the original (it carries the ordering). The runtime already
    prefetches in reverse offload order by itself; use this when your reload order differs."""
    _posix_ready()
    _check_ticket(ticket, "prefetch", reserve=False)
    try:
        site = _sites.new_site("prefetch", _ticket_key(ticket))
        if ticket.sharded:
            token = _sharded.prefetch(ticket.token, site)
        else:
            token = jax.ffi.ffi_call("jaxvmm_prefetch", TOKEN, vmap_method="sequential")(ticket.token, site=np.int64(site))
    except jax.errors.JaxRuntimeError as e:
        raise _translate(e) from e
    return Ticket(token, ticket.shape, ticket.dtype, ticket.sharded)


# ---- engine-wide ----
def check() -> None:
    """Raise the first asynchronous error any engine recorded since the last check (for example a
    reload, inside jit, of a ticket that was already reloaded). Handlers also raise it on their next call."""
    _lifetimes._collect()
    for backend, device in lib.engine_devices():
        try:
            lib.engine(backend, device).take_error()
        except errors.VmmError as e:
            raise errors.named(e) from None


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
    lib.engine(tgt.backend, tgt.ordinal).reserve_host(n)


def trim() -> int:
    """Return every idle staging page to the driver now (they also go back by themselves after
    ``staging_idle_ms`` without an op), and the host_numa store's empty chunks (their VA ranges stay
    reserved; the pinned pool keeps its chunks). Returns the bytes returned."""
    n = 0
    for backend, device in lib.engine_devices():
        n += int(lib.engine(backend, device).trim())
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
    _lifetimes._collect()
    out = {}
    for backend, device in lib.engine_devices():
        out[f"{'cuda' if backend == 'cuda' else 'cpu'}:{device}"] = dict(lib.engine(backend, device).stats())
    return out
