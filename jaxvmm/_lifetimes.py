"""Ticket lifetimes: when the host memory of a ticket that nothing can reload any more goes back.

The rules fit in a page (docs/lifetimes.md says the same with examples):

- A **holder** is a token array jaxvmm has seen in a concrete :class:`~jaxvmm.Ticket` (or kept for a
  ``jax.vjp`` function): it is *tracked*, by identity, with a strong reference. A tracked token
  **dies** when only this registry refers to it (CPython's reference count). A dead token stays a
  holder until its entry is ready (below).
- A holder's **values** (the ticket numbers in it, per device) are read once it is ready. A ticket
  value is **dropped** (handed to its engine, which frees its host memory once the device has passed
  every op enqueued so far) when a dead token's entry is ready and no holder's values hold it.
- A dead token's entry is ready when every computation that **read** it has finished, whichever
  thread dispatched it and whether or not its outputs are alive: once the token is ready (its values
  read), it is donated to a compiled identity, and jax runs a computation that donates a buffer only
  after every computation reading that buffer. The identity's outputs are the entry's barrier.
- A token that is not ready when it dies is donated once it is: until then it is a holder not read
  yet. A holder not read yet needs no waiting for: the computation that makes it read its source, a
  holder that stays one until that computation has finished.
- A token deleted before it was read (donated by the user's own computation) is **lost**: its values
  went into the donating computation, whose outputs may copy them. Its barrier is every computation
  dispatched so far (a fence per device, and the live arrays in flight: on the cpu platform a fence
  waits only for its own thread's computations), and until it is ready no value is dropped while a
  holder is not read yet.
- :func:`collect` drops the tickets that no reload consumed and no holder holds, after every
  computation dispatched before it has finished; it reads no array but the holders.

Lock order: the GIL, then ``_lock``. Engine calls that drop tickets are made after ``_lock`` is
released.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import errors
from ._devices import target_of
from ._native import lib

_lock = threading.RLock()
_tracked: dict[int, jax.Array] = {}  # id -> live tracked token array (strong reference)
_dying: dict[int, "_Dying"] = {}  # id of a dead token -> its entry (which keeps the id unique)
_values: dict[int, list] = {}  # id -> [(device, ticket value)] of a holder, read once it was ready
_unread: set[int] = set()  # ids of holders whose values are not read yet
_held: collections.Counter = collections.Counter()  # (device, value) -> how many holders' values have it
_lost: dict[int, list] = {}  # id -> barrier of a holder deleted before it was read
_kept: set[int] = set()  # ids of tracked tokens whose tickets keep() marked kept
_issued_at_last_call: dict = {}  # (backend, device) -> seq_issued when collect() was last called


class _Dying:
    """A dead token. ``barrier`` is None until the token is ready and donated (then: the identity's
    outputs) or found deleted (then: every computation dispatched so far)."""

    __slots__ = ("token", "barrier")

    def __init__(self, token):
        self.token = token
        self.barrier: list | None = None

    def ready(self) -> bool:
        return self.barrier is not None and _passed(self.barrier)


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


def _passed(barrier: list) -> bool:
    """Whether every array a barrier names (callables giving arrays) is finished."""
    return all(_finished(r()) for r in barrier)


def _wait_quietly(a) -> None:
    """Blocks until ``a`` is finished. A failed computation's error is its array's, raised where that
    array is used, not here."""
    try:
        if a is not None and not a.is_deleted():
            a.block_until_ready()
    except Exception:  # noqa: BLE001  (failed, or deleted by another thread meanwhile)
        pass


def token_values(token) -> list[tuple[jax.Device, np.ndarray]]:
    """(device, the distinct uint64 ticket values of its block) for each addressable shard of a token
    array (uint32[..., 2], or float32[..., 2] holding a token's bits: jaxvmm.checkpoint's tangent
    tickets travel that way). Blocks until the token is ready."""
    out = []
    for shard in token.addressable_shards:
        host = np.array(shard.data, copy=True)  # a copy: on cpu np.asarray is a view that keeps the array alive
        host = (host.view(np.uint32) if host.dtype == np.float32 else host.astype(np.uint32)).reshape(-1, 2)
        vals = host.view(np.uint64).reshape(-1)
        # A sharded ticket's block repeats its device's ticket in every cell: each value once.
        out.append((shard.device, vals if len(vals) <= 1 else np.unique(vals)))
    return out


def track(token) -> None:
    """Tracks a concrete token array (see the rules above); then processes the deaths so far."""
    with _lock:
        if id(token) not in _tracked:
            _tracked[id(token)] = token
            _unread.add(id(token))
    _collect()


def keep(token) -> None:
    """Tracks a concrete token array and marks its tickets kept: reloads no longer consume them, so a
    function holding the token (a ``jax.vjp`` function) may reload them any number of times. They are
    freed when the token dies, or by :func:`collect`. A traced token is left alone (inside a trace a
    reload consumes its ticket: nothing outside the program can reload it again)."""
    if not isinstance(token, jax.Array) or isinstance(token, jax.core.Tracer):
        return
    if token.dtype not in (jnp.uint32, jnp.float32) or tuple(token.shape)[-1:] != (2,):
        raise errors.InvalidArgumentError(f"jaxvmm: internal: not a ticket token: {token.dtype}{list(token.shape)}",
                                          code="invalid_argument")
    with _lock:
        if _tracked.get(id(token)) is token and id(token) in _kept:  # this very array was kept already
            return
    track(token)
    for device, values in token_values(token):
        tgt = target_of(device)
        for v in values:
            lib.engine(tgt.backend, tgt.ordinal).keep(int(v))
    with _lock:
        if _tracked.get(id(token)) is token:
            _kept.add(id(token))


# ---- barriers ----
@functools.lru_cache(maxsize=256)
def _identity(shape: tuple, dtype, device):
    """A compiled identity that donates its argument (one device's block of a token). Compiled, so that
    calling it inside a trace (offload/reload under jit process deaths) runs it instead of staging it."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda t: t, donate_argnums=0, out_shardings=sharding).lower(
        jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)).compile()


def _donate(token) -> list | None:
    """Donates every addressable block of a ready dead token to the identity; returns the identity's
    outputs (ready once every computation that read the token has finished), or None if the token was
    deleted meanwhile (another thread donated it)."""
    outs = []
    try:
        with jax.disable_jit(False):  # under jax.disable_jit() a compiled program refuses to run
            for shard in token.addressable_shards:
                data = shard.data
                outs.append(_identity(tuple(data.shape), data.dtype, shard.device)(data))
    except Exception:  # noqa: BLE001  (deleted, by a donation in another thread)
        return None
    return outs


@functools.lru_cache(maxsize=None)
def _fence(device):
    return jax.jit(lambda: jnp.zeros((), jnp.uint8),
                   out_shardings=jax.sharding.SingleDeviceSharding(device)).lower().compile()


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


def _barrier() -> list:
    """Every computation dispatched so far, as callables giving arrays to wait for: a trivial computation
    dispatched now on each device (jax runs a device's computations in dispatch order; on the cpu
    platform, per dispatching thread only), and weak references to the live arrays in flight (which
    cover other threads' computations whose outputs are alive)."""
    barrier = [weakref.ref(a) for a in _per_platform(jax.live_arrays) if not _finished(a)]
    with jax.disable_jit(False):  # under jax.disable_jit() a compiled program refuses to run
        fences = [_fence(d)() for d in _per_platform(lambda platform: jax.local_devices(backend=platform))]
    return barrier + [(lambda f=f: f) for f in fences]


def drain_dispatched() -> None:
    """Waits for every computation dispatched so far (see _barrier)."""
    for r in _barrier():
        _wait_quietly(r())


# ---- the registry ----
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


def _source(key: int):
    """The array a holder's values are read from: the tracked token, or a dead one not donated yet
    (None for a dead one that was lost or donated; call with _lock held)."""
    token = _tracked.get(key)
    if token is not None:
        return token
    entry = _dying.get(key)
    return entry.token if entry is not None and entry.barrier is None else None


def _read_holders() -> bool:
    """Reads the values of every holder that is ready now, and settles the dead tokens that can be:
    donated once read, lost once found deleted unread (call with _lock held). Returns False while a lost
    holder's barrier is not ready and a holder is not read yet."""
    for key, barrier in list(_lost.items()):
        if _passed(barrier):
            del _lost[key]
    for key in list(_unread):
        token = _source(key)
        if token is None:
            _unread.discard(key)
            continue
        if not _finished(token):
            continue
        try:
            vals = [(d, int(v)) for d, vs in token_values(token) for v in vs]
        except Exception:  # noqa: BLE001  (deleted, by a donation, before it could be read)
            if key in _tracked:
                _unread.discard(key)
                _lost[key] = _barrier()
            continue  # a dead one: settled below
        _unread.discard(key)
        _values[key] = vals
        _held.update(vals)
    for key, entry in _dying.items():
        if entry.barrier is not None:
            continue
        if key in _unread and not entry.token.is_deleted():
            continue  # not ready yet: a holder not read yet
        outs = None if key in _unread else _donate(entry.token)
        if outs is None:  # deleted before it could be read or donated
            entry.barrier = _barrier()
            if key in _unread:
                _unread.discard(key)
                _lost[key] = entry.barrier
        else:
            entry.barrier = [(lambda o=o: o) for o in outs]
    return not (_lost and _unread)


def _collect(wait: bool = False) -> None:
    """Hands the tickets of tokens that died to their engines once nothing can reload them any more
    (the rules above); with ``wait``, first blocks until what the dead tokens and the holders not read
    yet are waiting for is finished."""
    if wait:
        _wait_for_pending()  # its own frame: no reference to a tracked token outlives it
    with _lock:
        dead = []
        for key in list(_tracked):
            token = _tracked[key]
            if sys.getrefcount(token) <= _UNREFERENCED:  # only this registry holds it
                dead.append(key)
            del token
        for key in dead:
            _dying[key] = _Dying(_tracked.pop(key))
            _kept.discard(key)
        if not _dying or not _read_holders():
            return
        freed = set()
        for key in [key for key, entry in _dying.items() if entry.ready()]:
            del _dying[key]
            freed.update(_forget(key))
        drops = [v for v in freed if _held[v] <= 0]
    for device, v in drops:
        tgt = target_of(device)
        lib.engine(tgt.backend, tgt.ordinal).drop(v)


def _wait_for_pending() -> None:
    """Blocks until the barriers of the dead tokens and of the lost holders, and every holder not read
    yet, are finished."""
    with _lock:
        pending = [r() for e in _dying.values() if e.barrier is not None for r in e.barrier]
        pending += [r() for b in _lost.values() for r in b]
        pending += [_source(key) for key in _unread]
    for a in pending:
        _wait_quietly(a)


def settle() -> None:
    """Waits for every computation dispatched so far and the engines, then hands the engines the
    tickets of every token that died before."""
    drain_dispatched()
    for backend, device in lib.engine_devices():
        lib.engine(backend, device).sync()
    for _ in range(3):  # a drop can release the last reference that kept another token alive; a dead
        _collect(wait=True)  # token read in one round is donated, and its barrier waited for, in the next


def collect() -> int:
    """Free the tickets that can no longer be reloaded: those no reload consumed and no array holds.

    A ticket normally lives while a ``Ticket`` (or a token array taken from one, or the residuals of a
    ``jax.vjp`` function of ``jaxvmm.checkpoint``) is alive, and until it is reloaded. Tickets whose
    tokens never leave a jitted computation (offloaded, then reloaded in only one branch of a
    ``lax.cond``), or whose last holder died inside jax (a ``vjp_fn`` dropped uncalled), are found
    here: once every computation dispatched before the call has finished, each ticket that no reload
    consumed and no live jax array holds is dropped (its host memory is freed once
    the device has passed every op enqueued so far). Call it between steps of a loop whose tickets do
    not reach Python, every few steps, to keep host memory constant; it waits for the computations in
    flight and reads every live token-like array (uint32 or float32, last dimension 2), so it is not
    free. A token copied out of jax (to numpy, or to another process) is not seen: keep tickets in jax
    arrays. Returns how many tickets were dropped."""
    def issued() -> dict:
        return {(backend, device): int(lib.engine(backend, device).stats()["seq_issued"])
                for backend, device in lib.engine_devices()}

    # The tickets to judge: those issued by the computations dispatched before the call, all issued once
    # they have finished. Unless another thread may be dispatching: a computation it dispatches may
    # issue a ticket before its outputs exist as arrays (jax releases the GIL while it enqueues and
    # takes it back to make them), and still be ahead of its reload; no fence of this thread waits for
    # it. Then only tickets issued before the previous call began are judged: the thread that
    # dispatched their computation has had the time since to make its outputs, which are waited for.
    global _issued_at_last_call
    alone = threading.active_count() == 1
    now = issued()
    last, _issued_at_last_call = _issued_at_last_call, now
    settle()
    last = issued() if alone else last
    settle()  # what another thread dispatched meanwhile, if its outputs are alive
    candidates = {}
    for (backend, device), upto in last.items():
        mine = [int(token) for token, seq in lib.engine(backend, device).unclaimed_tickets() if seq <= upto]
        if mine:
            candidates[(backend, device)] = np.array(mine, np.uint64)
    held = _held_by_live_arrays(candidates) if candidates else set()
    dropped = 0
    for (backend, device), mine in candidates.items():
        for token in mine.tolist():
            if (backend, device, token) not in held:
                lib.engine(backend, device).drop(token)
                dropped += 1
    for backend, device in lib.engine_devices():
        lib.engine(backend, device).sync()
    return dropped


def _held_by_live_arrays(candidates: dict) -> set:
    """(backend, device, ticket) of the candidates that a live token-like array holds: uint32 (or
    float32: a token's bits) with a last dimension of 2. Besides the holders, the residuals of a
    ``jax.vjp`` function that a jitted computation returned hold tickets, and nothing tells their arrays
    from others but their values."""
    held = set()
    for a in _per_platform(jax.live_arrays):
        try:
            if a.dtype not in (jnp.uint32, jnp.float32) or a.ndim < 1 or a.shape[-1] != 2 or a.is_deleted():
                continue
            for dev, vals in token_values(a):
                tgt = target_of(dev)
                mine = candidates.get((tgt.backend, tgt.ordinal))
                if mine is not None:
                    held.update((tgt.backend, tgt.ordinal, int(v)) for v in mine[np.isin(mine, vals)])
        except Exception:  # noqa: BLE001  (deleted (donated) between the check and the read: it holds nothing)
            continue
    return held


def synchronize() -> None:
    """Block until every jax computation dispatched so far has finished, those whose outputs were all
    discarded included (on the cpu platform: those this thread dispatched, and other threads' whose
    outputs are alive), then until every offload/reload enqueued so far has completed and jaxvmm's
    workers are idle; frees the tickets of the tokens that died before. Tickets whose tokens never
    reach Python are freed by :func:`collect`."""
    settle()
    for backend, device in lib.engine_devices():
        lib.engine(backend, device).sync()
