"""Offload, reload and prefetch of arrays sharded over several devices under plain ``jit``
(``NamedSharding`` inputs, GSPMD or Shardy), partitioned like elementwise ops.

Each op is a ``jax.experimental.custom_partitioning`` call whose partition rule runs jaxvmm's FFI call
on every device's local shard: nothing is gathered, and each device's host copy is its own shard.

* The token is sharded like the data. The mesh is known when the op is traced (it is part of every
  aval's sharding under ``jit``), the data's sharding only when XLA partitions the program, so the
  token's shape is fixed by the data's shape and the mesh size ``n``: ``uint32[*dims, 2]`` with
  ``dims[i] = gcd(shape[i], n)`` (see :func:`token_dims`). Whatever axes shard data dimension ``i``,
  their size divides ``dims[i]``, so token dimension ``i`` is sharded over the same axes and every
  device holds a block of cells, all holding its own ``uint32[2]`` ticket (the token jaxvmm's handlers
  read and write on one device).
* The reload's output is sharded like its token, hence like the offloaded data (each device reloads
  what it offloaded); a prefetch's token keeps its sharding.
* Propagation: with Shardy the ``sharding_rule`` ties data dimension ``i``, seen as ``(w_i q_i)`` with
  ``w_i`` the major factor of size ``dims[i]``, to token dimension ``w_i``; with GSPMD
  ``infer_sharding_from_operands`` says the same. XLA therefore has no reason to move the data.
* Replicated axes: devices that hold the same data each offload their own copy, and the token is
  replicated over those axes while its blocks hold each device's own ticket. jaxvmm reads every
  device's block; the token must not be resharded by user code (reload it as offload returned it).
"""

from __future__ import annotations

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from . import errors

TOKEN = jax.ShapeDtypeStruct((2,), jnp.uint32)

# A sharded ticket's token has one element per "token cell"; bounded so that huge meshes cannot make
# tokens large (dimensions past the bound are gathered before an offload; see token_dims).
MAX_TOKEN_CELLS = 4096


def _typeof(x):
    f = getattr(jax, "typeof", None)
    return f(x) if f is not None else jax.core.get_aval(x)


def mesh_of(x):
    """The (abstract) mesh ``x`` is laid out on when it spans several devices and no mesh axis is
    manual (plain ``jit``, or an eager array sharded over several devices); ``None`` otherwise (one
    device, inside ``shard_map``, or a jax without shardings in avals)."""
    try:
        sharding = getattr(_typeof(x), "sharding", None)
    except TypeError:
        return None
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or mesh_size(mesh) <= 1:
        return None
    if getattr(mesh, "manual_axes", ()):  # inside shard_map: each device already sees its own shard
        return None
    return mesh


def mesh_size(mesh) -> int:
    return int(np.prod(mesh.axis_sizes, dtype=np.int64))


def token_dims(shape, n: int) -> tuple:
    """The leading dimensions of a sharded ticket's token, ``uint32[*token_dims, 2]``, for data of
    ``shape`` on a mesh of ``n`` devices: ``gcd(shape[i], n)``, which every number of shards that
    dimension can have divides (so the token can be sharded exactly like the data). Trailing
    dimensions shrink to 1 while the token would have more than MAX_TOKEN_CELLS cells."""
    dims = [int(np.gcd(int(d), n)) for d in shape]
    for i in reversed(range(len(dims))):
        if int(np.prod(dims, dtype=np.int64)) <= MAX_TOKEN_CELLS:
            break
        dims[i] = 1
    return tuple(dims)


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entries(spec, ndim: int) -> list:
    spec = tuple(spec) if spec is not None else ()
    return [_axes(spec[i]) if i < len(spec) else () for i in range(ndim)]


def _fit(sharding, mesh, dims) -> list:
    """Per data dimension, the mesh axes it stays sharded over: those of ``sharding`` when the token
    dimension can follow them (their size divides ``dims[i]``), none otherwise (XLA gathers it)."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    out = []
    for axes, k in zip(_entries(getattr(sharding, "spec", None), len(dims)), dims):
        n = int(np.prod([sizes[a] for a in axes], dtype=np.int64)) if axes else 1
        out.append(axes if k % n == 0 else ())
    return out


def _spec(entries, extra: int = 0) -> P:
    return P(*[None if not a else a[0] if len(a) == 1 else a for a in entries], *([None] * extra))


def _need_mesh(mesh, what: str):
    if mesh is None or mesh.empty:
        raise errors.NotSupportedError(
            f"jaxvmm.{what}: XLA partitions this program without a mesh (the jit's inputs are not on one "
            "jax.sharding.Mesh); sharded offload needs NamedSharding inputs on one mesh", code="not_supported")
    return mesh


# ---- the per-device FFI calls (what each device runs on its shard) ----
def _local_offload(x, signature, site):
    return jax.ffi.ffi_call("jaxvmm_offload", TOKEN, vmap_method="sequential")(
        x, signature=np.int64(signature), site=np.int64(site))


def _local_reload(token, shape, dtype, signature, site):
    return jax.ffi.ffi_call("jaxvmm_reload", jax.ShapeDtypeStruct(shape, dtype), vmap_method="sequential")(
        jnp.reshape(token, (2,)), signature=np.int64(signature), site=np.int64(site))


def _local_prefetch(token, site):
    return jax.ffi.ffi_call("jaxvmm_prefetch", TOKEN, vmap_method="sequential")(
        jnp.reshape(token, (2,)), site=np.int64(site))


def _local_cells(shape, entries, mesh) -> tuple:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return tuple(int(d) // int(np.prod([sizes[a] for a in axes], dtype=np.int64)) for d, axes in zip(shape, entries))


def _rule(data_shape, dims, data_first: bool) -> tuple[str, dict]:
    """The Shardy rule tying data dimension i, ``(w_i q_i)`` (w_i major, of size dims[i]), to token
    dimension i, ``w_i``: an axis that shards one shards the other."""
    data, token, sizes = [], [], {}
    for i, (d, k) in enumerate(zip(data_shape, dims)):
        token.append(f"w{i}")
        if k == int(d):
            data.append(f"w{i}")
        elif k == 1:
            data.append(f"q{i}")
        else:
            data.append(f"(w{i} q{i})")
            sizes[f"q{i}"] = int(d) // k
    data, token = " ".join(data), " ".join(token + ["t"])
    return (f"{data} -> {token}" if data_first else f"{token} -> {data}"), sizes


# ---- offload ----
# Static arguments: signature, site, dims (the token's leading dimensions).
def _offload_global(x, signature, site, dims):
    # The meaning on one device (only used if XLA lowers it unpartitioned): the one ticket in every cell.
    return jnp.broadcast_to(_local_offload(x, signature, site), (*dims, 2))


_offload_cp = custom_partitioning(_offload_global, static_argnums=(1, 2, 3))


def _offload_partition(signature, site, dims, mesh, arg_shapes, result_shape):
    mesh = _need_mesh(mesh, "offload")
    entries = _fit(arg_shapes[0].sharding, mesh, dims)
    cells = _local_cells(dims, entries, mesh)

    def lower(x):
        return jnp.broadcast_to(_local_offload(x, signature, site), (*cells, 2))

    return (mesh, lower, NamedSharding(mesh, _spec(entries, 1)), (NamedSharding(mesh, _spec(entries)),))


def _offload_infer(signature, site, dims, mesh, arg_shapes, result_shape):
    mesh = _need_mesh(mesh, "offload")
    return NamedSharding(mesh, _spec(_fit(arg_shapes[0].sharding, mesh, dims), 1))


def _offload_user(signature, site, dims, mesh, user_shape):
    return user_shape.sharding


def _offload_rule(signature, site, dims, mesh, value_types, result_types):
    return _rule(value_types[0].shape, dims, data_first=True)


_offload_cp.def_partition(_offload_partition, infer_sharding_from_operands=_offload_infer,
                          propagate_user_sharding=_offload_user, sharding_rule=_offload_rule)


# ---- reload ----
# Static arguments: shape, dtype, signature, site.
def _first(token):
    return jnp.reshape(token, (-1, 2))[0]


def _reload_global(token, shape, dtype, signature, site):
    return _local_reload(_first(token), shape, dtype, signature, site)


_reload_cp = custom_partitioning(_reload_global, static_argnums=(1, 2, 3, 4))


def _token_entries(sharding, mesh, dims) -> list:
    # The token's own sharding, dimension by dimension (its last dimension, the ticket, never split).
    return _fit(NamedSharding(mesh, P(*tuple(getattr(sharding, "spec", ()) or ())[:len(dims)])), mesh, dims)


def _reload_partition(shape, dtype, signature, site, mesh, arg_shapes, result_shape):
    mesh = _need_mesh(mesh, "reload")
    dims = tuple(arg_shapes[0].shape[:-1])
    entries = _token_entries(arg_shapes[0].sharding, mesh, dims)
    local = _local_cells(shape, entries, mesh)

    def lower(token):
        return _local_reload(_first(token), local, dtype, signature, site)

    return (mesh, lower, NamedSharding(mesh, _spec(entries)), (NamedSharding(mesh, _spec(entries, 1)),))


def _reload_infer(shape, dtype, signature, site, mesh, arg_shapes, result_shape):
    mesh = _need_mesh(mesh, "reload")
    dims = tuple(arg_shapes[0].shape[:-1])
    return NamedSharding(mesh, _spec(_token_entries(arg_shapes[0].sharding, mesh, dims)))


def _reload_user(shape, dtype, signature, site, mesh, user_shape):
    return user_shape.sharding


def _reload_rule(shape, dtype, signature, site, mesh, value_types, result_types):
    return _rule(shape, tuple(value_types[0].shape[:-1]), data_first=False)


_reload_cp.def_partition(_reload_partition, infer_sharding_from_operands=_reload_infer,
                         propagate_user_sharding=_reload_user, sharding_rule=_reload_rule)


# ---- prefetch ----
def _prefetch_global(token, site):
    return jnp.broadcast_to(_local_prefetch(_first(token), site), token.shape)


_prefetch_cp = custom_partitioning(_prefetch_global, static_argnums=(1,))


def _prefetch_partition(site, mesh, arg_shapes, result_shape):
    mesh = _need_mesh(mesh, "prefetch")
    dims = tuple(arg_shapes[0].shape[:-1])
    entries = _token_entries(arg_shapes[0].sharding, mesh, dims)
    tok = NamedSharding(mesh, _spec(entries, 1))
    cells = _local_cells(dims, entries, mesh)

    def lower(token):
        return jnp.broadcast_to(_local_prefetch(_first(token), site), (*cells, 2))

    return mesh, lower, tok, (tok,)


def _prefetch_infer(site, mesh, arg_shapes, result_shape):
    mesh = _need_mesh(mesh, "prefetch")
    dims = tuple(arg_shapes[0].shape[:-1])
    return NamedSharding(mesh, _spec(_token_entries(arg_shapes[0].sharding, mesh, dims), 1))


def _prefetch_user(site, mesh, user_shape):
    return user_shape.sharding


def _prefetch_rule(site, mesh, value_types, result_types):
    n = len(value_types[0].shape)
    t = " ".join(f"w{i}" for i in range(n))
    return f"{t} -> {t}"


_prefetch_cp.def_partition(_prefetch_partition, infer_sharding_from_operands=_prefetch_infer,
                           propagate_user_sharding=_prefetch_user, sharding_rule=_prefetch_rule)


# ---- entry points (ops.py validates first) ----
# Each op is wrapped in a custom_vmap: custom_partitioning has no batching rule, and under jax.vmap an
# op falls back to what the unsharded path does (one FFI call per batch element, on whole elements).
def _traced(*xs) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _run(op, x):
    return op(x) if _traced(x) else jax.jit(op)(x)


def _batched(op, per_element):
    @op.def_vmap
    def rule(axis_size, in_batched, v):
        if not in_batched[0]:
            return op(v), False
        return jax.vmap(per_element)(v), True

    return op


# Explicit sharding (every mesh axis Explicit: the sharding is part of the type): the spec is known
# when tracing, and custom_partitioning's outputs would be typed replicated, so the ops are shard_maps.
def _explicit_entries(x, ndim: int, dims=None):
    """Per dimension, the axes ``x`` is sharded over when every axis of its mesh is Explicit and the
    token can follow them (``dims``); None otherwise (the custom_partitioning path)."""
    sharding = getattr(_typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    types = tuple(getattr(mesh, "axis_types", ()) or ())
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    if explicit is None or not types or any(t != explicit for t in types):
        return None
    entries = _entries(sharding.spec, ndim)
    if dims is not None and _fit(sharding, mesh, dims) != entries:
        return None
    return entries


def _shard_map(f, x, in_entries, out_spec):
    import inspect

    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    params = inspect.signature(fn).parameters
    extra = {"check_vma": False} if "check_vma" in params else {"check_rep": False} if "check_rep" in params else {}
    sharding = x.sharding if isinstance(x, jax.Array) and not _traced(x) else _typeof(x).sharding
    return fn(f, mesh=sharding.mesh, in_specs=(_spec(in_entries, x.ndim - len(in_entries)),), out_specs=out_spec,
              **extra)(x)


def offload(x, signature: int, site: int, mesh):
    """The token, ``uint32[*token_dims(x.shape, mesh size), 2]`` sharded like ``x``, of an offload of
    ``x`` in which each device offloads its own shard. Outside jit it runs as its own jitted program."""
    dims = token_dims(x.shape, mesh_size(mesh))
    entries = _explicit_entries(x, x.ndim, dims)
    if entries is not None:
        cells = _local_cells(dims, entries, mesh)

        def shard(v):
            return jnp.broadcast_to(_local_offload(v, signature, site), (*cells, 2))

        op = jax.custom_batching.custom_vmap(lambda v: _shard_map(shard, v, entries, _spec(entries, 1)))
    else:
        op = jax.custom_batching.custom_vmap(lambda v: _offload_cp(v, signature, site, dims))
    return _run(_batched(op, lambda e: _offload_global(e, signature, site, dims)), x)


def reload(token, shape, dtype, signature: int, site: int):
    shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
    entries = _explicit_entries(token, len(shape))
    if entries is not None:
        local = _local_cells(shape, entries, _typeof(token).sharding.mesh)

        def shard(t):
            return _local_reload(_first(t), local, dtype, signature, site)

        op = jax.custom_batching.custom_vmap(lambda t: _shard_map(shard, t, entries, _spec(entries)))
    else:
        op = jax.custom_batching.custom_vmap(lambda t: _reload_cp(t, shape, dtype, signature, site))
    return _run(_batched(op, lambda e: _reload_global(e, shape, dtype, signature, site)), token)


def prefetch(token, site: int):
    entries = _explicit_entries(token, token.ndim - 1)
    if entries is not None:
        def shard(t):
            return jnp.broadcast_to(_local_prefetch(_first(t), site), t.shape)

        op = jax.custom_batching.custom_vmap(lambda t: _shard_map(shard, t, entries, _spec(entries, 1)))
    else:
        op = jax.custom_batching.custom_vmap(lambda t: _prefetch_cp(t, site))
    return _run(_batched(op, lambda e: _prefetch_global(e, site)), token)
