"""Prints the JAX internals jaxvmm.remat hooks (ad.linearize, api._vjp3_callable, api._lift_linearized,
api.vjp, api.linearize, api.VJP) for the installed jax: what a version bump changed."""
import inspect

import jax
from jax._src import api
from jax._src.interpreters import ad

print("jax", jax.__version__)
for name, fn in [("ad.linearize", ad.linearize), ("api._vjp3_callable", getattr(api, "_vjp3_callable", None)),
                 ("api._lift_linearized", getattr(api, "_lift_linearized", None)), ("api.vjp", api.vjp),
                 ("api.linearize", api.linearize), ("api._vjp3_bwd", getattr(api, "_vjp3_bwd", None)),
                 ("api.VJP", getattr(api, "VJP", None))]:
    print("=" * 20, name)
    if fn is None:
        print("missing")
        continue
    try:
        print(inspect.signature(fn))
    except (TypeError, ValueError) as e:
        print("no signature:", e)
    try:
        src = inspect.getsource(fn)
        lines = [l for l in src.splitlines() if not l.strip().startswith((">>>", "#"))]
        print("\n".join(l for l in lines if "\"\"\"" not in l)[-4000:])
    except (TypeError, OSError) as e:
        print("no source:", e)
