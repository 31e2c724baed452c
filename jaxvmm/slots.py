"""``jaxvmm.Slot``: a fixed virtual address range whose physical pages can be given back and mapped again."""

from __future__ import annotations

import operator
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

from . import errors
from . import share as _share
from ._devices import Target, target_of
from ._native import lib
from ._validate import check_shape as _check_shape

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


_SHAREABLE = (None, "posix_fd", "fabric")
VIEW_ALIGNMENT = 256
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6, "V": 4}


def _check_shareable(shareable):
    if shareable is not None and not isinstance(shareable, str):
        raise _type_error(f"jaxvmm: shareable must be None, 'posix_fd' or 'fabric', not {type(shareable).__name__}")
    if shareable not in _SHAREABLE:
        raise _value_error(f"jaxvmm: unknown shareable handle type {shareable!r}; use None, 'posix_fd' or 'fabric'")
    return shareable


def _check_view_shape(shape) -> tuple:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    return _check_shape(shape, "Slot.as_array")


def _check_view_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise _type_error(f"jaxvmm: as_array dtype {dtype!r} is not a dtype") from None
    supported = dt.kind in "iufcb" or dt == jnp.bfloat16
    if not supported or dt.itemsize * 8 not in (8, 16, 32, 64, 128):
        raise errors.NotSupportedError(f"jaxvmm: as_array cannot view {dt} (DLPack int, uint, float, bfloat16, "
                                       "complex and bool only)", code="not_supported", stage="as_array")
    if jax.dtypes.canonicalize_dtype(dt) != dt:
        raise errors.NotSupportedError(f"jaxvmm: as_array of {dt} needs jax_enable_x64 (jax would convert it to "
                                       f"{jax.dtypes.canonicalize_dtype(dt)}, a copy)", code="not_supported",
                                       stage="as_array")
    return dt


class _DLPackProducer:
    """What ``jax.dlpack.from_dlpack`` consumes: a capsule built by the core, handed out once."""

    __slots__ = ("_capsule", "_device")

    def __init__(self, capsule, dl_type: int, dl_id: int):
        self._capsule = capsule
        self._device = (dl_type, dl_id)

    def __dlpack__(self, stream=None, **_kw):  # slot writes are synchronous: nothing to order on `stream`
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("jaxvmm: this view was already consumed")
        return capsule

    def __dlpack_device__(self):
        return self._device


VIEW_DRAIN_SECONDS = 1.0


def _wait_for_dead_views(native) -> None:
    """jax frees an unreferenced view's buffer asynchronously, just after the last computation that read
    it: give such views a moment (at most VIEW_DRAIN_SECONDS) to go before a release or close is refused."""
    if not native.info()["views"]:
        return
    import gc
    import time

    gc.collect()
    deadline = time.monotonic() + VIEW_DRAIN_SECONDS
    while native.info()["views"] and time.monotonic() < deadline:
        time.sleep(0.001)


def _granularity_of(slot) -> int:
    kind, _, node = slot.location.partition(":")
    return int(lib.granularity(slot.backend, slot._target.ordinal, kind,
                               slot._target.ordinal if kind == "device" else int(node or 0)))


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
      shareable: ``None`` (default), ``"posix_fd"`` or ``"fabric"``: the pages can be exported to other
        processes with :meth:`export` (see :mod:`jaxvmm.share`). Checked up front: a handle type the device,
        driver or system does not permit raises ``NotSupportedError`` naming the driver's answer (FABRIC
        needs an IMEX channel; the POSIX backend supports ``"posix_fd"`` only).
    """

    def __init__(self, nbytes: int, *, device=None, location: str = "device", access=None, shareable=None):
        n = _check_nbytes(nbytes)
        shareable = _check_shareable(shareable)
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
        self._native = None  # the core's slot (lib.Slot) until closed
        self._channel_fd: int | None = None  # imported slots: the exporter's generation channel
        self._import_generation = 0
        if shareable:
            lib.shareable_check(target.backend, target.ordinal, kind, loc_id, shareable)
        self._native = lib.create_slot(target.backend, target.ordinal, kind, loc_id, ordinals, n, shareable or "")
        self._shareable = shareable
        self._nbytes = n
        self._location = kind if kind == "device" else f"host_numa:{node}"
        info = self._native.info()
        self._size = int(info["size"])
        self._address = int(info["address"])

    # ---- properties ----
    def _live(self):
        """The core's slot; raises once this one is closed."""
        if self._native is None:
            raise errors.SlotStateError("jaxvmm: the slot is closed", code="state", stage="use")
        return self._native

    @property
    def id(self) -> int:
        """Process-unique slot id (also the allocation id that caches keyed by address should use)."""
        return self._live().id

    @property
    def address(self) -> int:
        """The fixed virtual address; identical across every release/remap of this slot."""
        self._live()
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
        return dict(self._live().info())

    @property
    def generation(self) -> int:
        """Starts at 1 and increases on every successful ``remap()``: key caches by (id, generation)."""
        return int(self.info()["generation"])

    @property
    def mapped(self) -> bool:
        """True while physical pages are mapped and accessible."""
        return self._native is not None and bool(self.info()["mapped"])

    @property
    def state(self) -> str:
        """``"mapped"``, ``"released"`` or ``"closed"``."""
        return "closed" if self._native is None else str(self.info()["state"])

    @property
    def closed(self) -> bool:
        return self._native is None

    # ---- lifecycle ----
    def release(self) -> None:
        """Unmap and release the physical pages; the address stays reserved (touching it faults).
        Refused (``SlotStateError``) while zero-copy views from :meth:`as_array` live."""
        native = self._live()
        _wait_for_dead_views(native)
        native.release()

    def remap(self) -> None:
        """Map fresh physical pages at the same address (contents are undefined) and bump ``generation``."""
        self._live().remap()

    def close(self) -> None:
        """Return pages and reservation to the driver. A teardown that fails is quarantined (the
        error is raised once as ``QuarantinedError``) and retried later; the slot is closed either way.

        Refused (``SlotStateError``, the slot stays open) while zero-copy views from :meth:`as_array` live."""
        with self._lock:
            native = self._native
            if native is None:
                raise errors.SlotStateError("jaxvmm: the slot is already closed", code="state", stage="close")
            _wait_for_dead_views(native)
            try:
                native.close()
            except errors.SlotStateError:
                raise  # live views: nothing was done, the slot stays open
            except BaseException:
                self._native = None
                self._drop_channel()
                raise
            self._native = None
            self._drop_channel()

    def _drop_channel(self) -> None:
        fd, self._channel_fd = self._channel_fd, None
        if fd is not None:
            _share._close(fd)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc) -> None:
        if self._native is not None:
            self.close()

    def __del__(self):
        native = getattr(self, "_native", None)
        if native is not None:
            self._native = None
            try:
                native.close()
            except Exception as e:  # noqa: BLE001 - quarantined and logged by the core
                if getattr(e, "code", None) == "state":  # views outlive the object: the last one closes the slot
                    try:
                        native.close_when_unviewed()
                    except Exception:  # noqa: BLE001
                        pass
        if getattr(self, "_channel_fd", None) is not None:
            try:
                self._drop_channel()
            except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel closes what is left
                pass

    # ---- data ----
    def write(self, data, offset: int = 0) -> None:
        """Copy ``data`` (bytes-like or array-like, taken as raw bytes) into the slot at ``offset``."""
        buf = _as_bytes(data)
        offset = self._check_range(offset, buf.nbytes)
        self._live().write(offset, buf)

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
        self._live().read_into(off, out)
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

    # ---- sharing ----
    @property
    def shareable(self) -> str | None:
        """``"posix_fd"``/``"fabric"`` for an exportable (or imported) slot, else None."""
        return self._shareable

    @property
    def imported(self) -> bool:
        """True for a slot made by :meth:`import_` (it maps another process's pages)."""
        return self._import_generation > 0

    @property
    def stale(self) -> bool:
        """For an imported slot: True once the exporter released, remapped or closed its slot (this
        slot's pages stay valid, and this process's, until it closes them; they are just no longer the
        exporter's). None when the exporter cannot be asked (a fabric handle from bytes). Always False
        for a slot this process created."""
        self._live()
        if not self.imported:
            return False
        if self._channel_fd is None:
            return None
        return _share.staleness(self._channel_fd, self._import_generation) is not None

    def export(self, kind: str | None = None) -> "_share.ShareHandle":
        """A :class:`jaxvmm.share.ShareHandle` of the slot's current pages (see :mod:`jaxvmm.share`).

        The slot must be mapped and created with ``shareable=``. Each call returns a new handle with new
        descriptors, owned by the handle: close it (or use ``with``) once it has been sent."""
        native = self._live()
        sid = native.id
        kind = _check_shareable(kind) or self._shareable
        if not kind:
            raise errors.SlotStateError("jaxvmm: the slot was not created shareable; pass shareable='posix_fd' "
                                        "(or 'fabric') to jaxvmm.Slot", code="state", slot=sid, stage="export")
        fd, fabric, channel, generation, size = native.export(kind)
        return _share.ShareHandle(
            kind=kind, backend=self.backend, size=int(size), nbytes=self._nbytes, granularity=_granularity_of(self),
            location=self._location, device=self._target.ordinal, generation=int(generation), pid=os.getpid(),
            slot=sid, fd=fd if fd >= 0 else None, fabric=fabric if kind == "fabric" else None,
            channel_fd=channel if channel >= 0 else None)

    @classmethod
    def import_(cls, handle, *, device=None, access=None) -> "Slot":
        """Map the pages ``handle`` names at a new fixed address of this process (reserve, import, map,
        one batched access grant for ``device`` and ``access``); any failure rolls back exactly.

        The imported slot owns its own reference to the pages: they live until it is closed, whatever the
        exporter does. It cannot be released or remapped (the pages are the exporter's); when the exporter
        remaps, ``stale`` turns True and a new handle must be imported. A stale, closed or malformed handle
        raises before anything is mapped. ``handle`` stays open (close it yourself)."""
        if not isinstance(handle, _share.ShareHandle):
            raise _type_error(f"jaxvmm: Slot.import_ needs a jaxvmm.share.ShareHandle, not {type(handle).__name__}")
        handle.check_current()  # raises for a closed or stale handle
        target = target_of(device)
        if target.backend != handle.backend:
            raise _value_error(f"jaxvmm: a {handle.backend} handle cannot be imported on {target.name} "
                               f"(the {target.backend} backend)")
        access_targets = [target] + [target_of(d) for d in _access_list(access)]
        for t in access_targets:
            if t.backend != target.backend:
                raise _value_error(f"jaxvmm: access device {t.device} is on another platform than {target.device}")
        ordinals = sorted({t.ordinal for t in access_targets})
        if handle.size <= 0 or handle.granularity <= 0 or handle.size % handle.granularity:
            raise errors.InvalidArgumentError(f"jaxvmm: malformed handle: size {handle.size} is not a positive "
                                              f"multiple of granularity {handle.granularity}",
                                              code="invalid_argument", stage="import")
        fd = -1
        if handle.kind == "posix_fd":
            fd = handle.fd
            try:
                st = os.fstat(fd)
            except OSError as e:
                raise errors.InvalidArgumentError(f"jaxvmm: the handle's descriptor {fd} is not open ({e})",
                                                  code="invalid_argument", stage="import") from None
            if handle.backend == "posix" and st.st_size != handle.size:
                raise errors.InvalidArgumentError(
                    f"jaxvmm: the handle's descriptor holds {st.st_size} bytes, the handle says {handle.size}: "
                    "not the pages this handle was exported for", code="invalid_argument", stage="import")
        channel = None
        if handle.channel_fd is not None:
            channel = _share._own(os.dup(handle.channel_fd))
        try:
            native = lib.import_slot(target.backend, target.ordinal, ordinals, handle.kind, fd,
                                     handle.fabric or b"", handle.size, handle.granularity, handle.generation)
        except BaseException as e:
            if channel is not None:
                _share._close(channel)
            if (isinstance(e, errors.DriverError) and e.stage == "import"
                    and e.driver_error in ("CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_HANDLE")
                    and "cuMemImportFromShareableHandle" in str(e)):
                raise errors.InvalidArgumentError(
                    f"{e}: the driver does not recognize the handle as a shareable allocation handle of "
                    f"kind {handle.kind!r} (a forged or foreign descriptor?)", code="invalid_argument",
                    driver_error=e.driver_error, slot=e.slot, stage="import") from None
            raise
        self = cls.__new__(cls)
        self._lock = threading.Lock()
        self._target = target
        self._native = native
        self._channel_fd = channel
        self._import_generation = handle.generation
        self._shareable = handle.kind
        self._nbytes = handle.nbytes if 0 < handle.nbytes <= handle.size else handle.size
        self._location = handle.location
        info = native.info()
        self._size = int(info["size"])
        self._address = int(info["address"])
        return self

    # ---- zero-copy views ----
    def as_array(self, shape, dtype, *, offset: int = 0) -> jax.Array:
        """A ``jax.Array`` of ``shape`` and ``dtype`` that aliases the slot's bytes from ``offset`` (DLPack,
        no copy), on the slot's device (cpu or CUDA).

        Writes through :meth:`write` (or by another process that imported the pages) are seen by the array,
        which jax treats as immutable: change the bytes only while no computation reads the array. While
        any view lives, ``release()`` and ``close()`` are refused; delete the arrays first. A view always
        shows the pages mapped when it was made; after a release and remap, ask for a new view.

        ``offset`` must be a multiple of 256 bytes (XLA's buffer alignment on cpu and CUDA). 64-bit dtypes
        need ``jax_enable_x64`` (jax would otherwise convert, i.e. copy)."""
        native = self._live()
        sid = native.id
        shp = _check_view_shape(shape)
        dt = _check_view_dtype(dtype)
        off = self._check_range(offset, 0)
        if off % VIEW_ALIGNMENT:
            raise _value_error(f"jaxvmm: as_array offset {off} must be a multiple of {VIEW_ALIGNMENT} bytes")
        nbytes = int(np.prod(shp, dtype=np.int64)) * dt.itemsize
        self._check_range(off, nbytes)
        code, bits = _DLPACK_CODES[dt.kind], dt.itemsize * 8
        if dt == jnp.bfloat16:
            code = 4
        dev = self._target.device
        dl_type = 2 if self.backend == "cuda" else 1
        capsule = native.dlpack(off, list(shp), code, bits, dl_type, int(dev.local_hardware_id or 0))
        producer = _DLPackProducer(capsule, dl_type, int(dev.local_hardware_id or 0))
        try:
            arr = jax.dlpack.from_dlpack(producer, device=dev, copy=False)
        except (ValueError, TypeError, RuntimeError) as e:
            raise errors.NotSupportedError(f"jaxvmm: jax cannot alias the slot's memory as a {dt.name}{list(shp)} "
                                           f"array at offset {off} ({e})", code="not_supported", slot=sid,
                                           stage="as_array") from None
        finally:
            del producer, capsule  # an unconsumed capsule drops its view here
        if arr.dtype != dt or tuple(arr.shape) != shp:  # jax converted (a copy): never hand that out as a view
            raise errors.NotSupportedError(f"jaxvmm: jax converted the view to {arr.dtype}{list(arr.shape)}; enable "
                                           "jax_enable_x64 for 64-bit dtypes", code="not_supported", slot=sid,
                                           stage="as_array")
        return arr

    @property
    def views(self) -> int:
        """Live zero-copy views (arrays from :meth:`as_array` that jax has not freed yet)."""
        return int(self.info()["views"])

    def __repr__(self) -> str:
        if self._native is None:
            return f"<jaxvmm.Slot closed nbytes={self._nbytes}>"
        i = self.info()
        return (f"<jaxvmm.Slot id={self._native.id} {self._target.name} {self._location} address=0x{self._address:x} "
                f"nbytes={self._nbytes} size={self._size} generation={i['generation']} state={i['state']}>")
