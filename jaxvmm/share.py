"""Sharing a slot's pages with another process: :class:`ShareHandle`, and how to move one.

``slot.export()`` returns a :class:`ShareHandle`: the shareable handle of the slot's pages (a file
descriptor for ``"posix_fd"``, 64 bytes for ``"fabric"``), what an importer needs to map them (size,
granularity, location, backend) and the exporter's generation. ``jaxvmm.Slot.import_(handle)`` maps the
same pages at a fixed address of the importing process.

Descriptors travel between processes over a Unix socket (:func:`send_handle` / :func:`recv_handle`,
``SCM_RIGHTS``), or are taken from the exporter with ``pidfd_getfd`` (:meth:`ShareHandle.from_pid`, Linux
5.6+, needs ptrace permission over the exporter). Fabric handles are plain bytes: :meth:`ShareHandle.to_bytes`
and :meth:`ShareHandle.from_bytes` carry them through any channel.

Ownership (DESIGN.md, "Shared slots"): a handle owns its descriptors and closes each exactly once, on
:meth:`ShareHandle.close`, at the end of a ``with`` block, or when it is garbage collected. Sending a handle
does not give its descriptors away (the receiver gets its own); importing does not consume it (the
importer's slot holds its own reference to the pages and to the generation channel). Every descriptor a
handle or an imported slot holds is counted in ``jaxvmm.stats()["share"]``.

Staleness: beside the pages, every handle carries the exporter's *generation channel*, a one-page memfd
that the exporting slot rewrites on every transition: its generation while mapped, 0 while released, and
a closed flag. A handle, and a slot imported from it, is *current* while the channel still shows the
generation the handle was exported at; after the exporter releases, remaps or closes its slot it is
stale (the importer's pages stay valid and its own until it closes them, but they are no longer the
exporter's). A fabric handle sent as bytes to another node has no channel: its staleness is unknown
(``stale`` is ``None``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import struct
import threading

from . import errors

KINDS = ("posix_fd", "fabric")
FABRIC_BYTES = 64
_CHANNEL = struct.Struct("<QQQQq")  # magic, generation, closed, slot, pid (ffi/share.h ChannelPage)
_CHANNEL_MAGIC = 0x6C6E6E6168636D76
_HEADER = struct.Struct("<I")
_MAX_MESSAGE = 1 << 16

# ---- descriptor accounting ----
_lock = threading.Lock()
_fds = 0  # descriptors owned by live handles and imported slots


def _own(fd: int) -> int:
    global _fds
    with _lock:
        _fds += 1
    return fd


def _close(fd: int) -> None:
    global _fds
    with _lock:
        _fds -= 1
    try:
        os.close(fd)
    except OSError:  # pragma: no cover - an fd we own cannot be closed behind our back unless the user did
        pass


def open_fds() -> int:
    """Descriptors jaxvmm's share layer holds now (live handles and imported slots)."""
    with _lock:
        return _fds


def _bad_handle(msg: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(msg, code="invalid_argument", stage="import")


def read_channel(fd: int) -> tuple[int, bool]:
    """``(generation, closed)`` of an exporter's generation channel (generation 0: no pages mapped)."""
    try:
        raw = os.pread(fd, _CHANNEL.size, 0)
    except OSError as e:
        raise _bad_handle(f"jaxvmm: the generation channel (fd {fd}) cannot be read ({e})") from None
    if len(raw) != _CHANNEL.size:
        raise _bad_handle(f"jaxvmm: fd {fd} is not a jaxvmm generation channel (short read)")
    magic, generation, closed, _slot, _pid = _CHANNEL.unpack(raw)
    if magic != _CHANNEL_MAGIC:
        raise _bad_handle(f"jaxvmm: fd {fd} is not a jaxvmm generation channel")
    return int(generation), bool(closed)


def staleness(channel_fd: int | None, generation: int) -> str | None:
    """Why pages exported at ``generation`` are no longer the exporter's, or None while they are."""
    if channel_fd is None:
        return None
    now, closed = read_channel(channel_fd)
    if closed:
        return "the exporter closed its slot"
    if now == 0:
        return f"the exporter released its slot (the handle is of generation {generation})"
    if now != generation:
        return f"the exporter remapped its slot (handle generation {generation}, exporter now at {now})"
    return None


class ShareHandle:
    """A slot's pages, exportable to another process. Built by ``Slot.export()``, :func:`recv_handle`,
    :meth:`from_pid` or :meth:`from_bytes`; never by hand.

    Attributes: ``kind`` (``"posix_fd"`` or ``"fabric"``), ``backend`` (``"cuda"`` or ``"posix"``),
    ``size`` (bytes of pages, a multiple of ``granularity``), ``nbytes`` (what the exporter asked for),
    ``granularity``, ``location`` (``"device"`` or ``"host_numa:N"``), ``device`` (the exporter's device
    ordinal), ``generation`` (the exporter's, at export), ``pid`` and ``slot`` (the exporter's, for
    messages), ``fd`` (posix_fd) or ``fabric`` (64 bytes), ``channel_fd`` (the generation channel)."""

    __slots__ = ("kind", "backend", "size", "nbytes", "granularity", "location", "device", "generation", "pid",
                 "slot", "fabric", "_fd", "_channel_fd", "_closed", "_lock", "__weakref__")

    def __init__(self, *, kind, backend, size, nbytes, granularity, location, device, generation, pid, slot,
                 fd=None, fabric=None, channel_fd=None):
        self._closed = True  # until the descriptors below are owned
        self._lock = threading.Lock()
        if kind not in KINDS:
            raise _bad_handle(f"jaxvmm: unknown handle kind {kind!r} (expected one of {KINDS})")
        self.kind, self.backend = kind, backend
        self.size, self.nbytes, self.granularity = int(size), int(nbytes), int(granularity)
        self.location, self.device, self.generation = location, int(device), int(generation)
        self.pid, self.slot = int(pid), int(slot)
        self.fabric = bytes(fabric) if fabric is not None else None
        self._fd = _own(fd) if fd is not None else None
        self._channel_fd = _own(channel_fd) if channel_fd is not None else None
        self._closed = False

    # ---- descriptors ----
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise errors.SlotStateError("jaxvmm: the share handle is closed", code="state", stage="import")

    @property
    def fd(self) -> int | None:
        """The pages' descriptor (posix_fd), still owned by the handle: do not close it yourself."""
        self._check_open()
        return self._fd

    @property
    def channel_fd(self) -> int | None:
        """The generation channel's descriptor (None for a fabric handle from bytes), owned by the handle."""
        self._check_open()
        return self._channel_fd

    def fds(self) -> list[int]:
        """Descriptors to send with this handle: the pages' (posix_fd) then the channel's, where present."""
        self._check_open()
        return [f for f in (self._fd, self._channel_fd) if f is not None]

    def close(self) -> None:
        """Close the handle's descriptors (each exactly once; a second call does nothing). Slots imported
        from the handle keep their pages."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds, self._fd, self._channel_fd = [self._fd, self._channel_fd], None, None
        for f in fds:
            if f is not None:
                _close(f)

    def __enter__(self) -> "ShareHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown: the kernel closes what is left
                pass

    # ---- staleness ----
    @property
    def stale(self) -> bool | None:
        """True once the exporter released, remapped or closed the slot since this export; None when the
        handle has no generation channel (a fabric handle from bytes, on another node)."""
        self._check_open()
        if self._channel_fd is None:
            return None
        return staleness(self._channel_fd, self.generation) is not None

    def check_current(self) -> None:
        """Raise :class:`jaxvmm.errors.StaleHandleError` if the handle is stale."""
        self._check_open()
        why = staleness(self._channel_fd, self.generation)
        if why:
            raise errors.StaleHandleError(f"jaxvmm: stale share handle of slot {self.slot} (pid {self.pid}): {why}; "
                                          "ask the exporter for a new export", code="state", stage="import")

    # ---- metadata ----
    def describe(self) -> dict:
        """Everything but the descriptors, as JSON-able values (``fd_numbers`` are the descriptors' numbers
        in *this* process, for :meth:`from_pid`)."""
        self._check_open()
        d = {k: getattr(self, k) for k in ("kind", "backend", "size", "nbytes", "granularity", "location",
                                             "device", "generation", "pid", "slot")}
        d["fabric"] = self.fabric.hex() if self.fabric is not None else None
        d["fd_numbers"] = {"fd": self._fd, "channel_fd": self._channel_fd}
        if os.getpid() != self.pid:
            d["fd_numbers"] = None  # only the exporter's own numbers can be taken with pidfd_getfd
        return d

    def to_bytes(self) -> bytes:
        """The metadata (and a fabric handle's 64 bytes) as JSON bytes. Descriptors are not included:
        send a posix_fd handle with :func:`send_handle` or take its descriptors with :meth:`from_pid`."""
        return json.dumps(self.describe(), sort_keys=True).encode()

    @classmethod
    def _from_meta(cls, meta: dict, fd=None, channel_fd=None) -> "ShareHandle":
        try:
            fabric = bytes.fromhex(meta["fabric"]) if meta.get("fabric") else None
            return cls(kind=meta["kind"], backend=meta["backend"], size=meta["size"], nbytes=meta["nbytes"],
                       granularity=meta["granularity"], location=meta["location"], device=meta["device"],
                       generation=meta["generation"], pid=meta["pid"], slot=meta["slot"], fd=fd, fabric=fabric,
                       channel_fd=channel_fd)
        except (KeyError, TypeError, ValueError) as e:
            for f in (fd, channel_fd):
                if f is not None:
                    os.close(f)  # not yet owned by a handle
            raise _bad_handle(f"jaxvmm: malformed share handle metadata ({e!r})") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> "ShareHandle":
        """A fabric handle from :meth:`to_bytes` (no descriptors; ``stale`` is then None)."""
        try:
            meta = json.loads(bytes(data).decode())
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad_handle(f"jaxvmm: not a share handle ({e})") from None
        if not isinstance(meta, dict) or meta.get("kind") != "fabric":
            raise _bad_handle("jaxvmm: only fabric handles travel as bytes; a posix_fd handle needs its descriptor "
                              "(send_handle/recv_handle or ShareHandle.from_pid)")
        return cls._from_meta(meta)

    @classmethod
    def from_pid(cls, meta: dict | bytes) -> "ShareHandle":
        """Take the exporter's descriptors with ``pidfd_getfd`` (Linux >= 5.6; needs ptrace permission over
        the exporter: the same user and ``kernel.yama.ptrace_scope`` 0, or an ancestor, or CAP_SYS_PTRACE).
        ``meta`` is the exporter's ``handle.describe()`` (or ``to_bytes()``); the exporter must keep its
        handle open until this returns."""
        if isinstance(meta, (bytes, bytearray)):
            meta = json.loads(bytes(meta).decode())
        numbers = meta.get("fd_numbers") if isinstance(meta, dict) else None
        if not numbers:
            raise _bad_handle("jaxvmm: from_pid needs the exporter's own describe() (it names its descriptor numbers)")
        taken = []
        try:
            pidfd = os.pidfd_open(int(meta["pid"]))
        except (OSError, AttributeError) as e:
            raise errors.NotSupportedError(f"jaxvmm: pidfd_open({meta.get('pid')}) failed ({e}); send the handle "
                                           "over a Unix socket instead", code="not_supported", stage="import") from None
        try:
            for key in ("fd", "channel_fd"):
                n = numbers.get(key)
                taken.append(None if n is None else _pidfd_getfd(pidfd, int(n)))
        except BaseException:
            for f in taken:
                if f is not None:
                    os.close(f)
            raise
        finally:
            os.close(pidfd)
        return cls._from_meta(meta, fd=taken[0], channel_fd=taken[1])

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fds={self.fds()}"
        return (f"<jaxvmm.ShareHandle {self.kind} {self.backend} slot={self.slot} pid={self.pid} size={self.size} "
                f"location={self.location} generation={self.generation} {state}>")


_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}


def _pidfd_getfd(pidfd: int, target: int) -> int:
    nr = _SYS_PIDFD_GETFD.get(os.uname().machine)
    if nr is None:
        raise errors.NotSupportedError("jaxvmm: pidfd_getfd is not wired for this architecture", code="not_supported",
                                       stage="import")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, pidfd, target, 0)
    if fd < 0:
        err = ctypes.get_errno()
        hint = ("; it needs ptrace permission over the exporter (same user and kernel.yama.ptrace_scope=0, "
                "or run the importer as the exporter's ancestor, or CAP_SYS_PTRACE): send the handle over a "
                "Unix socket instead") if err == errno.EPERM else ""
        raise errors.NotSupportedError(f"jaxvmm: pidfd_getfd(fd {target}) failed: {os.strerror(err)}{hint}",
                                       code="not_supported", stage="import")
    os.set_inheritable(fd, False)
    return fd


# ---- Unix sockets ----
def send_handle(sock: socket.socket, handle: ShareHandle) -> None:
    """Send ``handle`` over a connected ``AF_UNIX`` socket: its metadata and (``SCM_RIGHTS``) its
    descriptors. The sender keeps its handle (close it when done); the receiver gets its own descriptors."""
    if not isinstance(handle, ShareHandle):
        raise errors.InvalidArgumentTypeError(f"jaxvmm: send_handle needs a ShareHandle, not {type(handle).__name__}",
                                              code="invalid_argument")
    if sock.family != socket.AF_UNIX:
        raise errors.InvalidArgumentError("jaxvmm: descriptors travel only over AF_UNIX sockets",
                                          code="invalid_argument")
    meta = handle.describe()
    meta["fd_numbers"] = None
    fds = handle.fds()
    meta["has"] = {"fd": handle._fd is not None, "channel_fd": handle._channel_fd is not None}
    body = json.dumps(meta, sort_keys=True).encode()
    if len(body) + _HEADER.size > _MAX_MESSAGE:
        raise errors.InternalError("jaxvmm: share handle metadata too large", code="internal")
    msg = _HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [msg], fds) if fds else sock.send(msg)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def recv_handle(sock: socket.socket) -> ShareHandle:
    """Receive a handle sent with :func:`send_handle`. The new handle owns the descriptors it received."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 2)
    for f in fds:
        os.set_inheritable(f, False)
    try:
        if len(data) < _HEADER.size:
            raise _bad_handle("jaxvmm: the peer closed the socket before sending a handle")
        (n,) = _HEADER.unpack_from(data)
        while len(data) < _HEADER.size + n:
            more = sock.recv(_HEADER.size + n - len(data))
            if not more:
                raise _bad_handle("jaxvmm: truncated share handle message")
            data += more
        meta = json.loads(data[_HEADER.size:_HEADER.size + n].decode())
        has = meta.pop("has")
        want = int(has["fd"]) + int(has["channel_fd"])
        if len(fds) != want:
            raise _bad_handle(f"jaxvmm: expected {want} descriptors with the handle, received {len(fds)}")
    except BaseException:
        for f in fds:
            os.close(f)
        raise
    it = iter(fds)
    fd = next(it) if has["fd"] else None
    channel = next(it) if has["channel_fd"] else None
    return ShareHandle._from_meta(meta, fd=fd, channel_fd=channel)


__all__ = ["ShareHandle", "send_handle", "recv_handle", "open_fds", "KINDS"]
