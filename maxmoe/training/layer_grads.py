"""Where each layer's weight gradient goes, routed inside the backward layer loop from outside the model.

    transform = summing(paths, specs, mesh)         # a model StackTransform
    loss + seed(sums_out)  ->  d/d sums = sums + this batch's gradients, summed layer by layer

The train step does not differentiate the layer stacks' weights (`paths`): a flax
`map_variables` around each scanned block routes each layer's slice through
`route_gradient`, whose backward hands the slice's gradient to a sink: `summing` adds it to
its row of the float32 running sums carried whole through the stack (LAYER_SUM); `reducing`
adds the earlier micro-batches' sums and reduce-scatters it across domains
(maxmoe.parallel.replicas.LayerGrads). docs/ARCHITECTURE.md, "Gradients", has the mechanics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec

from maxmoe.model.transformer import StackTransform
from maxmoe.parallel.layer_hooks import route_gradient
from maxmoe.parallel.replicas import LayerGrads
from maxmoe.parallel.shard_context import context_sharding

# Variable collections beside `params`, one entry per stacked weight at `paths`:
LAYER_SUM, LAYER_INDEX = "layer_sum", "layer_index"  # the running sums (carried whole); the layer's row
LAYER_GRAD, LAYER_GRAD_ADD = "layer_grad", "layer_grad_add"  # the reduced share (its gradient); the sums


@jax.custom_vjp
def seed(sums: Any) -> jax.Array:
    """0.0, whose gradient w.r.t. `sums` is the incoming cotangent times `sums`.

    Added to the loss, it starts the backward loop's carried cotangent of the sums as the sums
    themselves (for a loss cotangent of 1, as `jax.grad` gives; XLA folds the product away).
    Linear like any gradient: a scaled objective scales the sums with it.
    """
    return jnp.zeros((), jnp.float32)


def _seed_forward(sums):
    return jnp.zeros((), jnp.float32), sums


def _seed_backward(sums, ct):
    return (jax.tree.map(lambda s: s * ct.astype(s.dtype), sums),)


seed.defvjp(_seed_forward, _seed_backward)


def _routing(route: Callable, collections: tuple[str, str], scanned: tuple, carried: tuple) -> StackTransform:
    """A StackTransform whose blocks pass each stacked weight w with entries in `collections` as
    route(path, w, *entries) (path: the stack's name, then the weight's path in the block)."""

    def wrap(block: type, stack_name: str) -> type:
        def trans_in(variables):
            entries = {c: traverse_util.flatten_dict(variables.get(c) or {}) for c in collections}
            if not entries[collections[0]]:
                return variables
            flat = traverse_util.flatten_dict(variables["params"])
            for path in entries[collections[0]]:
                full = (stack_name, *path)
                with jax.named_scope("/".join(map(str, full))):  # the weight's name on what its backward runs
                    flat[path] = route(full, flat[path], *(entries[c][path] for c in collections))
            return {**variables, "params": traverse_util.unflatten_dict(flat)}

        return nn.map_variables(block, ["params", *collections], trans_in_fn=trans_in)

    return StackTransform(wrap, scanned=scanned, carried=carried)


def summing(specs: dict[tuple, PartitionSpec], mesh: Any = None) -> StackTransform:
    """Each layer's gradient of a stacked weight added, in float32, to its row of the running sums.

    The model then takes LAYER_SUM {path: sums [L, ...]} (carried) and LAYER_INDEX {path: [L]
    layer numbers} (scanned) beside params; specs: {path: one layer's PartitionSpec of the sums}
    (the gradient is constrained to it first; no mesh: no constraint). Backward, row l of the
    carried cotangent gets the layer's gradient: add(carry, update of zeros at row l), which
    XLA's algebraic simplifier makes an in-place update of the carry's row.
    """

    def route(path, w, sums, index):
        def backward(index, ct):
            ct = ct.astype(sums.dtype)
            if mesh is not None:
                ct = jax.lax.with_sharding_constraint(ct, context_sharding(mesh, specs[path]))
            return jax.lax.dynamic_update_index_in_dim(jnp.zeros(sums.shape, sums.dtype), ct, index, 0)

        return route_gradient(w, sums, index, backward)

    return _routing(route, (LAYER_SUM, LAYER_INDEX), scanned=(LAYER_INDEX,), carried=(LAYER_SUM,))


def reducing(layer_grads: LayerGrads) -> StackTransform:
    """Each layer's gradient of a stacked weight, plus the earlier sums, reduce-scattered across domains.

    The model then takes LAYER_GRAD {path: zeros shaped as this replica's share} and
    LAYER_GRAD_ADD {path: the float32 sums so far}, both scanned; the gradient w.r.t. LAYER_GRAD
    is the reduced share (maxmoe.parallel.replicas.LayerGrads).
    """
    return _routing(layer_grads, (LAYER_GRAD, LAYER_GRAD_ADD), scanned=(LAYER_GRAD, LAYER_GRAD_ADD), carried=())
