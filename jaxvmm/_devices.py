"""Maps what users pass as ``device=`` to a native backend and ordinal.

jax ``gpu`` devices are served by the real CUDA driver (backend ``"cuda"``); jax ``cpu`` devices by
the POSIX backend (``"posix"``), which gives the same slot semantics with host pages.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax

from . import errors
from ._native import lib


def _bad(msg: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(msg, code="invalid_argument")


@dataclasses.dataclass(frozen=True)
class Target:
    backend: str  # "cuda" | "posix"
    ordinal: int  # CUDA device ordinal, or the cpu device's index
    device: jax.Device

    @property
    def name(self) -> str:
        return f"{'cuda' if self.backend == 'cuda' else 'cpu'}:{self.ordinal}"


@functools.lru_cache(maxsize=None)
def _posix_ready() -> None:
    """Tell the POSIX backend how many cpu devices jax has (each gets its own engine)."""
    try:
        # This process's cpu devices: with jax.distributed, jax.devices("cpu") also lists other processes'.
        devs = jax.local_devices(backend="cpu")
    except RuntimeError:  # JAX_PLATFORMS excludes cpu: the POSIX backend serves nothing
        devs = []
    lib.set_posix_device_count(max(1, len(devs)))
    lib.set_posix_device_ids([int(d.id) for d in devs])


def _platform_devices(platform: str) -> list[jax.Device]:
    try:
        return jax.local_devices(backend=platform)
    except RuntimeError as e:
        raise _bad(f"jaxvmm: no jax '{platform}' devices in this process ({e})") from None


def target_of(device) -> Target:
    """Resolve ``None`` (jax's default device), an ``int`` (index into the default platform's local
    devices), a ``jax.Device``, or a string ``"cpu"``, ``"cpu:1"``, ``"cuda:0"``, ``"gpu:0"``."""
    if device is None:
        device = jax.local_devices()[0]
    elif isinstance(device, str):
        platform, _, index = device.partition(":")
        platform = {"cuda": "gpu"}.get(platform, platform)
        if platform not in ("cpu", "gpu"):
            raise _bad(f"jaxvmm: unknown device string {device!r}; use 'cpu[:N]' or 'cuda[:N]'")
        if _ and not index.isdigit():
            raise _bad(f"jaxvmm: device {device!r}: the index after ':' must be a non-negative integer "
                       "('cpu:0', 'cuda:1')")
        devs = _platform_devices(platform)
        i = int(index) if index else 0
        if not 0 <= i < len(devs):
            raise _bad(f"jaxvmm: device {device!r} does not exist ({len(devs)} {platform} devices)")
        device = devs[i]
    elif isinstance(device, bool) or not isinstance(device, (int, jax.Device)):
        try:
            device = operator.index(device)
        except TypeError:
            raise errors.InvalidArgumentTypeError(
                f"jaxvmm: device must be None, an int, a str or a jax.Device, not {type(device).__name__}",
                code="invalid_argument") from None
    if isinstance(device, int):
        devs = jax.local_devices()
        if not 0 <= device < len(devs):
            raise _bad(f"jaxvmm: device {device} does not exist ({len(devs)} local devices)")
        device = devs[device]
    if device.process_index != jax.process_index():
        raise _bad(f"jaxvmm: device {device} belongs to another process")
    if device.platform == "gpu":
        return Target("cuda", int(device.local_hardware_id), device)
    if device.platform == "cpu":
        _posix_ready()
        return Target("posix", _platform_devices("cpu").index(device), device)
    raise errors.NotSupportedError(f"jaxvmm: platform {device.platform!r} is not supported (cpu and CUDA gpu are)",
                                   code="not_supported")
