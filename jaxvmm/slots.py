"""``jaxvmm.Slot``: a fixed virtual address range whose physical pages can be given back and mapped again."""

from __future__ import annotations

import operator
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from . import errors
from ._devices import Target, target_of
from ._native import lib

# A sanity bound, not a capability: the driver or the kernel reports out-of-memory for real requests.
MAX_NBYTES = 1 << 48

_LOCATIONS = ("device", "host_numa")


def _type_error(msg: str) -> errors.InvalidArgumentTypeError:
    return errors.InvalidArgumentTypeError(msg, code="invalid_argument")


def _value_error(msg: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(msg, code="invalid_argument")


NUMA_SYSFS = "/sys/devices/system/node"


def _numa_nodes() -> list[int]:
    """Host NUMA nodes the kernel reports; a kernel without NUMA support has node 0 only."""
    try:
        names = os.listdir(NUMA_SYSFS)
    except OSError:
        return [0]
    nodes = sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())
    return nodes or [0]


def _parse_location(location: str) -> tuple[str, int | None]:
    if not isinstance(location, str):
        raise _type_error(f"jaxvmm: location must be a str, not {type(location).__name__}")
    kind, _, node = location.partition(":")
    if kind not in _LOCATIONS or (node and kind != "host_numa"):
        raise _value_error(f"jaxvmm: unsupported location {location!r}; use 'device', 'host_numa' or 'host_numa:N'")
    if node:
        if not node.isdigit():
            raise _value_error(f"jaxvmm: NUMA node in {location!r} must be a non-negative integer")
        return kind, int(node)
    return kind, None


def _check_numa_node(node: int) -> None:
    nodes = _numa_nodes()
    if node not in nodes:
        raise errors.NotSupportedError(
            f"jaxvmm: location 'host_numa:{node}': this machine has no host NUMA node {node} "
            f"(nodes: {', '.join(map(str, nodes))}, from {NUMA_SYSFS})", code="not_supported", stage="create")


def _check_nbytes(nbytes, what: str = "nbytes") -> int:
    if isinstance(nbytes, bool):
        raise _type_error(f"jaxvmm: {what} must be an int, not bool")
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise _type_error(f"jaxvmm: {what} must be an int, not {type(nbytes).__name__}") from None
    if n <= 0:
        raise _value_error(f"jaxvmm: {what} must be > 0, got {n}")
    if n > MAX_NBYTES:
        raise _value_error(f"jaxvmm: {what}={n} is absurd (more than 2**48 bytes)")
    return n


def _access_list(access) -> list:
    """``access`` as a list of devices: ``None`` (none), one device (an int, a ``"cpu:1"`` string, a
    ``jax.Device``) or an iterable of them. A string is one device, never a sequence of characters."""
    if access is None:
        return []
    if isinstance(access, (str, int, jax.Device)) and not isinstance(access, bool):
        return [access]
    if isinstance(access, (bytes, bool)) or not hasattr(access, "__iter__"):
        raise _type_error(f"jaxvmm: access must be a device (int, str, jax.Device) or a list of them, "
                          f"not {type(access).__name__}")
    return list(access)


def _as_bytes(data) -> np.ndarray:
    """The raw bytes of ``data``: bytes-like objects, numpy and jax arrays (and scalars), and objects with
    ``__jax_array__`` (through ``jnp.asarray``, as ``jaxvmm.offload`` takes them). Text and ``None`` are
    refused: a str would otherwise be written as UTF-32 code points."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    if isinstance(data, str):
        raise _type_error("jaxvmm: Slot.write got a str; encode it first (data.encode()) to write its bytes")
    if data is None:
        raise _type_error("jaxvmm: Slot.write got None; expected bytes or an array")
    if not isinstance(data, (jax.Array, np.ndarray, np.generic)) and hasattr(data, "__jax_array__"):
        data = jnp.asarray(data)
    if not isinstance(data, (jax.Array, np.ndarray, np.generic)):
        raise _type_error(f"jaxvmm: Slot.write expects bytes or an array (numpy, jax), "
                          f"not {type(data).__name__}")
    arr = np.ascontiguousarray(np.asarray(data))
    if arr.dtype.hasobject or arr.dtype.kind in "USV":
        raise _type_error(f"jaxvmm: Slot.write cannot take the raw bytes of a {arr.dtype} array")
    return arr.reshape(-1).view(np.uint8)


class Slot:
    """A fixed virtual address range with releasable physical pages.

    ``Slot(nbytes)`` reserves a virtual range (rounded up to the driver's granularity), creates
    physical pages, maps them and grants access, all at once. ``release()`` gives the pages back to
    the driver while the address stays reserved; ``remap()`` maps fresh pages at the *same* address
    and bumps ``generation``. ``close()`` (or leaving a ``with`` block) returns everything.

    Args:
      nbytes: bytes the slot must hold (> 0).
      device: ``None`` (jax's default device), an int, a ``jax.Device`` or ``"cpu[:N]"``/``"cuda[:N]"``.
        CUDA devices use the real driver; cpu devices the POSIX backend with the same semantics.
      location: ``"device"`` (pages in the device's memory) or ``"host_numa[:N]"`` (pages in host NUMA
        node N, default 0), mapped for the device.
      access: extra devices granted read/write access (one batched grant); the owning device always is.
    """

    def __init__(self, nbytes: int, *, device=None, location: str = "device", access=None):
        n = _check_nbytes(nbytes)
        kind, node = _parse_location(location)
        target = target_of(device)
        access_targets = [target] + [target_of(d) for d in _access_list(access)]
        for t in access_targets:
            if t.backend != target.backend:
                raise _value_error(f"jaxvmm: access device {t.device} is on another platform than {target.device}")
        ordinals = sorted({t.ordinal for t in access_targets})
        if kind == "host_numa" and node is None:
            node = 0
        if kind == "host_numa":
            _check_numa_node(node)
        loc_id = target.ordinal if kind == "device" else node
        self._lock = threading.Lock()
        self._target: Target = target
        self._id: int | None = None
        self._id = lib.slot_create(target.backend, target.ordinal, kind, loc_id, ordinals, n)
        self._nbytes = n
        self._location = kind if kind == "device" else f"host_numa:{node}"
        self._size = int(lib.slot_info(self._id)["size"])
        self._address = int(lib.slot_info(self._id)["address"])

    # ---- properties ----
    def _live_id(self) -> int:
        if self._id is None:
            raise errors.SlotStateError("jaxvmm: the slot is closed", code="state", stage="use")
        return self._id

    @property
    def id(self) -> int:
        """Process-unique slot id (also the allocation id that caches keyed by address should use)."""
        return self._live_id()

    @property
    def address(self) -> int:
        """The fixed virtual address; identical across every release/remap of this slot."""
        self._live_id()
        return self._address

    @property
    def nbytes(self) -> int:
        """Bytes requested."""
        return self._nbytes

    @property
    def size(self) -> int:
        """Bytes reserved and mapped: ``nbytes`` rounded up to the allocation granularity."""
        return self._size

    @property
    def device(self):
        """The ``jax.Device`` owning the slot."""
        return self._target.device

    @property
    def location(self) -> str:
        return self._location

    @property
    def backend(self) -> str:
        """``"cuda"`` (real driver) or ``"posix"`` (host backend used for cpu devices)."""
        return self._target.backend

    def info(self) -> dict:
        """A snapshot of the native slot record (state, generation, mapped bytes, last error)."""
        return dict(lib.slot_info(self._live_id()))

    @property
    def generation(self) -> int:
        """Starts at 1 and increases on every successful ``remap()``: key caches by (id, generation)."""
        return int(self.info()["generation"])

    @property
    def mapped(self) -> bool:
        """True while physical pages are mapped and accessible."""
        return self._id is not None and bool(self.info()["mapped"])

    @property
    def state(self) -> str:
        """``"mapped"``, ``"released"`` or ``"closed"``."""
        return "closed" if self._id is None else str(self.info()["state"])

    @property
    def closed(self) -> bool:
        return self._id is None

    # ---- lifecycle ----
    def release(self) -> None:
        """Unmap and release the physical pages; the address stays reserved (touching it faults)."""
        lib.slot_release(self._live_id())

    def remap(self) -> None:
        """Map fresh physical pages at the same address (contents are undefined) and bump ``generation``."""
        lib.slot_remap(self._live_id())

    def close(self) -> None:
        """Return pages and reservation to the driver. A teardown that fails is quarantined (the
        error is raised once as ``QuarantinedError``) and retried later; the slot is closed either way."""
        with self._lock:
            sid, self._id = self._id, None
        if sid is None:
            raise errors.SlotStateError("jaxvmm: the slot is already closed", code="state", stage="close")
        lib.slot_close(sid)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc) -> None:
        if self._id is not None:
            self.close()

    def __del__(self):
        sid = getattr(self, "_id", None)
        if sid is not None:
            self._id = None
            try:
                lib.slot_close(sid)
            except Exception:  # noqa: BLE001 - quarantined and logged by the core
                pass

    # ---- data ----
    def write(self, data, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like or array-like, taken as raw bytes) into the slot at ``offset``."""
        buf = _as_bytes(data)
        offset = self._check_range(offset, buf.nbytes)
        lib.slot_write(self._live_id(), offset, buf)

    def read(self, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
        """Copy ``nbytes`` (default: to the end) starting at ``offset`` out of the slot as ``uint8``."""
        off = self._check_range(offset, 0)
        if nbytes is None:
            n = self._nbytes - off
        else:
            try:
                n = operator.index(nbytes)
            except TypeError:
                raise _type_error(f"jaxvmm: nbytes must be an int, not {type(nbytes).__name__}") from None
        self._check_range(off, n)
        out = np.empty(n, dtype=np.uint8)
        lib.slot_read_into(self._live_id(), off, out)
        return out

    def _check_range(self, offset, n: int) -> int:
        if isinstance(offset, bool):
            raise _type_error("jaxvmm: offset must be an int, not bool")
        try:
            off = operator.index(offset)
        except TypeError:
            raise _type_error(f"jaxvmm: offset must be an int, not {type(offset).__name__}") from None
        if off < 0 or n < 0 or off + n > self._nbytes:
            raise _value_error(f"jaxvmm: range [{off}, {off + n}) is outside the slot's {self._nbytes} bytes")
        return off

    def __repr__(self) -> str:
        if self._id is None:
            return f"<jaxvmm.Slot closed nbytes={self._nbytes}>"
        i = self.info()
        return (f"<jaxvmm.Slot id={self._id} {self._target.name} {self._location} address=0x{self._address:x} "
                f"nbytes={self._nbytes} size={self._size} generation={i['generation']} state={i['state']}>")
