"""Loads the compiled core once and wires its error reporting to jaxvmm.errors."""

from __future__ import annotations

import atexit

from . import errors

try:
    from . import _jaxvmm as lib  # noqa: F401
except ImportError as e:  # pragma: no cover - only on broken installs
    raise ImportError(
        "jaxvmm: the compiled extension jaxvmm._jaxvmm is missing or failed to load "
        f"({e}). Reinstall with `pip install .` from the source tree (or "
        "`pip install --no-build-isolation .` on a machine without network)."
    ) from e

lib._set_error_factory(errors._from_native)

# Every setting: the JAXVMM_* environment variables parsed (a bad value raises InvalidArgumentError
# naming it), and every value the core reads, defaults included, pushed into it before anything else runs.
from . import _config  # noqa: E402

_config.load(lib)


def _close_all_at_exit() -> None:
    # Computations still running (a script that ends right after dispatching a step) may be inside a
    # jaxvmm handler: let them finish before the engines go, or a handler touches a destroyed engine.
    try:
        import jax

        for a in jax.live_arrays():
            try:
                a.block_until_ready()
            except Exception:  # noqa: BLE001 - a failed computation is done too
                pass
    except Exception:  # noqa: BLE001 - jax already torn down: nothing can still run
        pass
    # Return every slot's pages and reservations while the driver is still loaded.
    try:
        lib.close_all(final=True)  # and no engine starts again (finalizers run after this)
    except Exception:  # noqa: BLE001 - nothing useful can be raised at exit
        pass


atexit.register(_close_all_at_exit)
