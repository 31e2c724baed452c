"""Train a small model with its remat residuals offloaded by jaxvmm.checkpoint.

    python examples/train_offload.py

The model is a stack of MLP blocks ``x + W2 gelu(W1 x)`` (hidden 4D) run by ``lax.scan`` over layers;
each block names its hidden activation ``checkpoint_name(h, "mlp_hidden")``. The training step (jitted
``value_and_grad`` + SGD, parameters donated) wraps the block in

    jaxvmm.checkpoint(block, policy=jaxvmm.policies.offload_only_these_names("mlp_hidden"))

so each layer's hidden activation goes to pinned host memory in the forward pass and comes back
(prefetched in reverse order) in the backward pass; the rest is recomputed. The script prints the loss
and time of every step, XLA's temp bytes with the hidden activations saved on the device
(``jax.checkpoint`` with ``save_only_these_names("mlp_hidden")``) and offloaded (the memory saved), and
jaxvmm's engine stats. It exits non-zero if the loss does not decrease, if the gradients differ from
``jax.checkpoint`` with the same saving policy, or if the engine reports errors or leftover tickets.
Shapes: float32, B=1024, D=256, L=6 on cpu (a few seconds); B=8192, D=2048, L=16 on GPU.

Flax (linen) recipe
-------------------
``nn.remat(Block, policy=jaxvmm.policies....)`` is not enough: flax calls ``jax.checkpoint`` itself, and
jaxvmm policies are jax policies, so what they mark offloadable goes through XLA's own host offload
(``Offloadable``), not through jaxvmm. ``nn.map_variables`` and ``nn.custom_vjp`` are not needed. What works
is lifting ``jaxvmm.checkpoint`` exactly the way flax lifts ``jax.checkpoint``
(``flax.core.lift.checkpoint``), then using the lifted transform like ``nn.remat``, alone or under
``nn.scan``. Tested with flax 0.12.8 on
jax 0.10.2 (cpu): parameters from ``init`` and gradients, dropout included, are bit-identical to
``nn.remat(Block, policy=jax.checkpoint_policies.save_only_these_names("mlp_hidden"))``; one offload and
one reload per layer and step; XLA temp bytes drop accordingly.

    import functools
    import jax
    import flax.linen as nn
    from flax.core import lift
    from jax.ad_checkpoint import checkpoint_name
    import jaxvmm

    def _vmm_checkpoint(fn, variables=True, rngs=True, policy=None, prevent_cse=True):
        # flax.core.lift.checkpoint with jax.checkpoint replaced by jaxvmm.checkpoint
        def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
            def rematted(variable_groups, rng_groups, *args):
                scope = scope_fn(variable_groups, rng_groups)
                return fn(scope, *args, **kwargs), repack_fn(scope)

            return jaxvmm.checkpoint(rematted, policy=policy, prevent_cse=prevent_cse)(
                variable_groups, rng_groups, *args)

        return lift.pack(inner, (variables,), (variables,), (rngs,), name="vmm_remat", enable_kwargs=True)

    def vmm_remat(target, *, policy, variables=True, rngs=True, prevent_cse=True, methods=None):
        \"\"\"nn.remat whose saved residuals (what `policy` saves) leave the device through jaxvmm.\"\"\"
        return nn.transforms.lift_transform(_vmm_checkpoint, target, variables=variables, rngs=rngs,
                                            policy=policy, prevent_cse=prevent_cse, methods=methods)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = checkpoint_name(nn.gelu(nn.Dense(4 * x.shape[-1])(x)), "mlp_hidden")
            return x + nn.Dense(x.shape[-1])(h), None

    policy = jaxvmm.policies.offload_only_these_names("mlp_hidden")
    Stack = nn.scan(vmm_remat(Block, policy=policy), variable_axes={"params": 0},
                    split_rngs={"params": True, "dropout": True}, length=24)
    # or as a method decorator:  @functools.partial(vmm_remat, policy=policy) above @nn.compact

Use it under ``nn.scan`` (or ``lax.scan``): in an unrolled Python loop of blocks the offloads happen and
the gradients are right, but (seen on cpu) XLA schedules each reload right after its offload, so no
device memory is saved. Keyword arguments are closed over: Python values (``deterministic=True``) act
as static, arrays become inputs through jaxvmm.checkpoint's closure conversion (gradients reach them;
inputs are never offloaded); ``nn.scan`` itself drops keyword arguments. ``Block`` must name what to
offload with ``checkpoint_name`` inside it.

With flax NNX no lifting is needed (tested likewise: gradients bit-identical, one offload per layer):
``graphdef, state = nnx.split(blocks)`` (blocks built with ``nnx.vmap``, so ``state`` is stacked), then
``jaxvmm.checkpoint(lambda state, x: nnx.merge(graphdef, state)(x), policy=policy)`` as the body of a
``lax.scan`` over ``state``.
"""

import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave device memory to jaxvmm's staging
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

import jaxvmm  # noqa: E402

MiB = 1 << 20
NAME = "mlp_hidden"
ON_GPU = jax.default_backend() == "gpu"
B, D, L = (8192, 2048, 16) if ON_GPU else (1024, 256, 6)
STEPS, LR = 8, 0.1


def block(x, w):
    h = checkpoint_name(jax.nn.gelu(x @ w["w1"]), NAME)
    return x + h @ w["w2"]


def make_step(layer):
    def loss_fn(params, x, target):
        y, _ = jax.lax.scan(lambda c, w: (layer(c, w), None), x, params)
        return jnp.mean(jnp.square(y - target))

    def step(params, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        return loss, jax.tree.map(lambda p, g: p - LR * g, params, grads), grads

    return jax.jit(step, donate_argnums=0)


saved = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names(NAME))
offloaded = jaxvmm.checkpoint(block, policy=jaxvmm.policies.offload_only_these_names(NAME))


@jax.jit
def init(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = {"w1": jax.random.normal(k1, (L, D, 4 * D)) / D**0.5,
              "w2": jax.random.normal(k2, (L, 4 * D, D)) * (0.1 / (4 * D) ** 0.5)}
    x = jax.random.normal(k3, (B, D))
    target = jnp.tanh(x @ (jax.random.normal(k4, (D, D)) / D**0.5))  # a fixed teacher to regress onto
    return params, x, target


params, x, target = init(jax.random.key(0))
specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x, target))
step_saved = make_step(saved).lower(*specs).compile()
step_vmm = make_step(offloaded).lower(*specs).compile()
temp_saved = step_saved.memory_analysis().temp_size_in_bytes
temp_vmm = step_vmm.memory_analysis().temp_size_in_bytes
residuals = L * B * 4 * D * 4  # one float32 [B, 4D] hidden activation per layer
print(f"model: {L} MLP blocks, B={B}, D={D}, hidden {4 * D}, float32, on {jax.devices()[0]}")
print(f"XLA temp, hidden activations saved on device: {temp_saved / MiB:8.1f} MiB")
print(f"XLA temp, hidden activations offloaded:       {temp_vmm / MiB:8.1f} MiB  "
      f"(saved {(temp_saved - temp_vmm) / MiB:.1f} MiB; the residuals are {residuals / MiB:.1f} MiB)")

# Gradients of one step, from the same parameters, against jax.checkpoint with the same saving policy.
_, _, g_ref = step_saved(jax.tree.map(jnp.copy, params), x, target)
losses = []
for i in range(STEPS):
    t0 = time.perf_counter()
    loss, params, grads = step_vmm(params, x, target)
    loss = float(jax.block_until_ready(loss))
    dt = time.perf_counter() - t0
    if i == 0:
        g_vmm = grads
    losses.append(loss)
    print(f"step {i}: loss {loss:.6f}  {dt * 1e3:8.1f} ms")

jaxvmm.synchronize()
jaxvmm.check()  # raises the first asynchronous engine error, if any
for dev, s in jaxvmm.engine_stats().items():
    print(f"{dev}: offloads {s['offloads']}, reloads {s['reloads']}, prefetch hits {s['prefetch_hits']} / "
          f"misses {s['prefetch_misses']}, pinned pool {s['pinned_bytes'] / MiB:.0f} MiB (peak in use "
          f"{s['pinned_peak_in_use_bytes'] / MiB:.1f} MiB), staging cells {s['staging_cells']} (peak {s['staging_peak_bytes'] / MiB:.0f} MiB), "
          f"tickets live {s['tickets_live']}, errors {s['errors']}")
print(f"jaxvmm peak mapped staging bytes: {jaxvmm.stats()['peak_mapped_bytes'] / MiB:.1f} MiB")

scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g_ref))
diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_vmm)))
print(f"gradients vs jax.checkpoint(save_only_these_names): max |diff| {diff:.3g} (max |grad| {scale:.3g})")

failures = []
if not (np.isfinite(losses).all() and losses[-1] < losses[0]):
    failures.append(f"loss did not decrease: {losses}")
if diff > 1e-4 * scale:
    failures.append(f"gradients differ from jax.checkpoint with the same policy (max |diff| {diff:.3g})")
stats = jaxvmm.engine_stats().values()
if any(s["errors"] or s["tickets_live"] for s in stats) or sum(s["offloads"] for s in stats) != L * STEPS:
    failures.append("engine errors, leftover tickets, or not one offload per layer and step")
if temp_vmm >= temp_saved:
    failures.append("offloading did not reduce XLA temp bytes")
if failures:
    sys.exit("FAILED: " + "; ".join(failures))
print(f"OK: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {STEPS} steps; "
      f"{(temp_saved - temp_vmm) / MiB:.1f} MiB of device temp saved per step")
