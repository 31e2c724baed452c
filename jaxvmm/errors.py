"""The jaxvmm exception hierarchy.

Every error raised by the native core arrives here as a subclass of :class:`VmmError` whose message
starts with ``jaxvmm:`` and names the slot id, the lifecycle stage and, for driver failures, the
driver's error name (``CUDA_ERROR_OUT_OF_MEMORY``). The same fields are attributes.
"""

from __future__ import annotations

from . import _sites


class VmmError(RuntimeError):
    """Base class of every jaxvmm error."""

    def __init__(self, message: str, *, code: str = "", driver_error: str = "", slot: int | None = None,
                 stage: str = ""):
        super().__init__(message)
        self.code = code
        self.driver_error = driver_error or None
        self.slot = slot
        self.stage = stage or None


class InvalidArgumentError(VmmError, ValueError):
    """An argument was wrong (also a ``ValueError``)."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument had the wrong type: an :class:`InvalidArgumentError` that is also a ``TypeError``."""


class NotSupportedError(VmmError):
    """The device or driver lacks a capability (HOST_NUMA placement, VMM, a handle type)."""


class BackendUnavailableError(VmmError):
    """The backend cannot be used on this machine (no NVIDIA driver, no device)."""


class DriverError(VmmError):
    """A driver call failed; ``driver_error`` holds the driver's error name."""


class OutOfMemoryError(DriverError, MemoryError):
    """The driver or the kernel had no memory for the request."""


class QuarantinedError(DriverError):
    """A teardown failed; the remains are quarantined (see ``jaxvmm.stats()['quarantine']``) and retried."""


class SlotStateError(VmmError):
    """The slot is in the wrong state for the operation (released, closed)."""


class StaleHandleError(SlotStateError):
    """A share handle (or an imported slot) no longer names the exporter's pages: the exporter released,
    remapped or closed its slot since the export."""


class NotFoundError(VmmError, LookupError):
    """No slot has that id or that exact address range."""


class InternalError(VmmError):
    """A broken invariant inside jaxvmm; please report it."""


_BY_CODE = {
    "invalid_argument": InvalidArgumentError,
    "not_supported": NotSupportedError,
    "out_of_memory": OutOfMemoryError,
    "driver": DriverError,
    "state": SlotStateError,
    "not_found": NotFoundError,
    "unavailable": BackendUnavailableError,
    "quarantined": QuarantinedError,
    "internal": InternalError,
}


# XLA status names an FFI handler's error arrives with (see ffi/handlers.cc, ToFfi) -> jaxvmm's class.
_BY_XLA_STATUS = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "RESOURCE_EXHAUSTED": OutOfMemoryError,
    "UNIMPLEMENTED": NotSupportedError,
    "UNAVAILABLE": BackendUnavailableError,
}
_CODE_OF = {cls: code for code, cls in _BY_CODE.items()}


def from_jax_error(e: BaseException) -> VmmError | None:
    """The jaxvmm error a ``jax.errors.JaxRuntimeError`` carries, or ``None`` if it is not jaxvmm's.

    jaxvmm's FFI handlers fail with an XLA status whose message is jaxvmm's (it contains ``jaxvmm:``);
    jax raises it as ``JaxRuntimeError``. Eager ``offload``/``reload``/``prefetch`` translate it with this
    function; for errors raised by a jitted program, call it yourself::

        try:
            step(x)
        except jax.errors.JaxRuntimeError as e:
            raise jaxvmm.errors.from_jax_error(e) or e

    The class follows the XLA status (``RESOURCE_EXHAUSTED`` -> ``OutOfMemoryError``, ``INVALID_ARGUMENT``
    -> ``InvalidArgumentError``, ``UNIMPLEMENTED`` -> ``NotSupportedError``, ``UNAVAILABLE`` ->
    ``BackendUnavailableError``); other statuses give ``DriverError`` when a CUDA error name is in the
    message, else ``VmmError``."""
    msg = str(e)
    at = msg.find("jaxvmm:")
    if at < 0:
        return None
    status = msg.split(":", 1)[0].strip() if at > 0 else ""
    text = msg[at:].split("\n", 1)[0].strip()
    cls = _BY_XLA_STATUS.get(status)
    driver_error = ""
    for word in text.replace(",", " ").replace(";", " ").replace(":", " ").split():
        if word.startswith("CUDA_ERROR_"):
            driver_error = word
            break
    if cls is None:
        cls = DriverError if driver_error else VmmError
    return named(cls(text, code=_CODE_OF.get(cls, ""), driver_error=driver_error))


def named(e: BaseException) -> BaseException:
    """``e`` with every ``[call site N]`` in a jaxvmm error's message spelled out as the Python line
    that made that call."""
    if isinstance(e, VmmError) and e.args and "[call site " in str(e.args[0]):
        e.args = (_sites.name_sites(str(e.args[0])),) + e.args[1:]
    return e


def _from_native(code: str, message: str, driver_error: str, slot: int, stage: str) -> VmmError:
    """Builds the exception for a failed native Status (called from C++)."""
    cls = _BY_CODE.get(code, VmmError)
    return cls(message, code=code, driver_error=driver_error, slot=slot if slot >= 0 else None, stage=stage)


__all__ = [
    "VmmError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "NotSupportedError",
    "BackendUnavailableError",
    "DriverError",
    "OutOfMemoryError",
    "QuarantinedError",
    "SlotStateError",
    "StaleHandleError",
    "NotFoundError",
    "InternalError",
    "from_jax_error",
]
