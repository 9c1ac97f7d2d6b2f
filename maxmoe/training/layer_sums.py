"""Gradient accumulation inside the backward layer loop: each layer's weight gradient is added
to the float32 running sum in place, in the loop that computes it.

Plain accumulation differentiates each micro-batch w.r.t. the weights and adds the result to
the running sums: the backward pass of a scanned layer stack first writes every layer's
gradient into a stack of its own (the weights' size, in the dtype the model computes with),
and only after the loop is that stack added to the sums. Here the sums go through the model
instead (maxmoe.model.layers.LAYER_SUM, carried through each scanned stack) and the weights of
the stacks are not differentiated: backward, the sums are the loop's carried cotangent, and
each layer adds its gradient to its own row of them (`LayerSums`). No per-micro-batch stack
exists; the numbers are the same (each layer's gradient, in the compute dtype, added to a
float32 sum).

The mechanics, for one stacked weight w [L, ...] with running sum S [L, ...] (float32):
  - forward, S rides the stack's loop carry unchanged; layer l's `LayerSums` hook returns its
    slice of w as it is;
  - the loss gets `seed(S_out)` (value 0) whose cotangent is S itself: the backward loop's
    carry starts as the running sum, in its buffer;
  - backward, layer l's hook adds its gradient into row l of the carry (an update of zeros but
    row l, which XLA's algebraic simplifier turns into an in-place update of the carry's row);
  - the cotangent of the S that went in is then S + this micro-batch's gradient.
Differentiate with a loss cotangent of 1 (value_and_grad): `seed` returns S whatever the
cotangent it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec

from maxmoe.model.layers import LAYER_INDEX, LAYER_SUM
from maxmoe.parallel.layer_hooks import route_gradient
from maxmoe.parallel.shard_context import context_sharding


@jax.custom_vjp
def seed(sums: Any) -> jax.Array:
    """0.0, whose gradient w.r.t. `sums` is `sums` itself (see the module docstring)."""
    return jnp.zeros((), jnp.float32)


def _seed_forward(sums):
    return jnp.zeros((), jnp.float32), sums


def _seed_backward(sums, _):
    return (sums,)


seed.defvjp(_seed_forward, _seed_backward)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerSums:
    """The model's `layer_sum_hook` (maxmoe.model.layers.logical_param).

    hook(path, w, sums, index) returns w (layer `index`'s slice of a stacked weight); backward,
    its gradient, cast to float32 and constrained to `specs[path]` (the slice's sharding of the
    sums), is added to row `index` of `sums`' cotangent.
    """

    specs: dict
    mesh: Any

    def __call__(self, path: tuple, w, sums, index):
        spec = self.specs[path]

        def backward(index, ct):
            ct = jax.lax.with_sharding_constraint(ct.astype(sums.dtype), context_sharding(self.mesh, spec))
            return jax.lax.dynamic_update_index_in_dim(jnp.zeros(sums.shape, sums.dtype), ct, index, 0)

        return route_gradient(w, sums, index, backward)


def layer_specs(paths: list[tuple], in_domain_specs: Any) -> dict[tuple, PartitionSpec]:
    """{path: one layer's PartitionSpec} of the sums: the stacked spec without its `layers` entry."""
    flat = traverse_util.flatten_dict(in_domain_specs)
    return {p: PartitionSpec(*tuple(flat[p])[1:]) for p in paths}


def summing_grad_fn(loss_fn: Callable, paths: list[tuple]) -> Callable:
    """fn(params, extra, batch, sums) -> ((loss, aux), sums + this batch's gradients).

    loss_fn(params, extra, batch, more) -> (loss, aux): its model built on a layout whose
    `layer_sum_hook` is a `LayerSums`, and, given running sums in `more` (LAYER_SUM), the loss
    plus `seed` of the sums the model returns (maxmoe.training.step.make_loss_fn). sums: a tree
    like params of float32 running sums. The leaves at `paths` (scanned stacks) are summed
    inside the backward layer loop; the others are differentiated and added as usual.
    """
    held_paths = set(paths)

    def fn(params, extra, batch, sums):
        flat, flat_sums = traverse_util.flatten_dict(params), traverse_util.flatten_dict(sums)
        held = {p: x for p, x in flat.items() if p in held_paths}
        free = {p: x for p, x in flat.items() if p not in held_paths}
        index = traverse_util.unflatten_dict({p: jnp.arange(x.shape[0], dtype=jnp.int32) for p, x in held.items()})

        def loss_of(free, carried):
            weights = traverse_util.unflatten_dict({**free, **held})
            more = {LAYER_SUM: traverse_util.unflatten_dict(carried), LAYER_INDEX: index}
            return loss_fn(weights, extra, batch, more)

        carried = {p: flat_sums[p] for p in held}
        (loss, aux), (g_free, g_held) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(free, carried)
        out = {p: flat_sums[p] + g.astype(flat_sums[p].dtype) for p, g in g_free.items()}
        return (loss, aux), traverse_util.unflatten_dict({**out, **g_held})

    return fn
