"""One gradient accumulator: the micro-batch loop of the one-tier (plain, FSDP) and two-tier steps.

    grads_fn = make_grads_fn(config, layout)
    loss, aux, grads = grads_fn(params, router, batch)     # means over train.grad_accum micro-batches

Each micro-batch's gradients are added to float32 running sums; the layer stacks' weights add
theirs inside the backward layer loop (maxmoe.training.layer_grads), so no micro-batch's
gradient stack exists beside the sums. Two things differ between steps: where the sums live
(on the parameters' shardings, GSPMD reducing each micro-batch over the data axes; or, under
mesh.across_domains=zero1, per replica on the in-domain shardings) and when they cross domains
(mesh.zero1_reduce: after the loop, or the layer stacks' inside the last micro-batch's backward
loop). The pipeline's loop is its schedule (maxmoe.training.pipeline_step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import PartitionSpec

from maxmoe.config import Config
from maxmoe.model.transformer import COMPUTE_DTYPES, abstract_variables, uses_float32
from maxmoe.parallel import replicas
from maxmoe.parallel.layer_hooks import stacked_paths
from maxmoe.parallel.shard_context import context_sharding
from maxmoe.training import layer_grads
from maxmoe.training.objective import make_loss_fn, mean_stats


def micro_batches(batch: Any, accum: int) -> Any:
    """[b, ...] -> [accum, b / accum, ...], strided: micro-batch m holds rows m, m + accum, ...
    (each micro-batch spread over every data shard)."""

    def split(x):
        return x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def float32_leaves(boxed_params: Any) -> Any:
    """True for the leaves the model uses in float32 (norm scales, the router's gate), per leaf."""
    return jax.tree_util.tree_map_with_path(lambda path, _: uses_float32(path), nn.unbox(boxed_params))


def weight_copy(
    config: Config, layout: Any, boxed_params: Any, over: Any = None, axis: str = replicas.REPLICA
) -> tuple[Callable, Any, Any]:
    """(copy, zero1, in_domain) for master weights kept ZeRO-1 (`Layout.zero1_shardings(.., over)`).

    copy(master) -> the compute-dtype copy on the in-domain shardings, gathered over `axis`
    (replicas.compute_copy; norm scales and the router's gate stay float32); zero1 / in_domain:
    the two trees of NamedShardings. Under mesh.zero1_gather=per_step (across domains) the copy
    of every weight that is not an expert's is whole inside the domain (`Layout.whole_shardings`).
    """
    zero1, in_domain = layout.zero1_shardings(boxed_params, over), layout.tree_shardings(boxed_params)
    keep = float32_leaves(boxed_params)
    dtype = COMPUTE_DTYPES[config.model.compute_dtype]
    gathered = in_domain
    if config.mesh.zero1_gather == "per_step" and axis == replicas.REPLICA:
        gathered = layout.whole_shardings(boxed_params)

    def copy(master):
        return replicas.compute_copy(master, zero1, gathered, keep, dtype, axis)

    return copy, zero1, in_domain


def _sum_dtype(dtype):
    """Sums of narrow floats (bf16 gradients of the compute copy) are kept in float32."""
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4 else dtype


@dataclasses.dataclass(frozen=True)
class _Sums:
    """How one micro-batch's gradients reach the sums: `loss_fn` of a model whose stacks route the
    weights at `paths` to the running sums; `specs` ({path: PartitionSpec}, None: unconstrained)
    the sums' shardings on `mesh`."""

    loss_fn: Callable
    paths: frozenset
    mesh: Any = None
    specs: dict | None = None

    def constrain(self, flat: dict) -> dict:
        """{path: sum} on its sharding (on the context mesh inside the per-replica region)."""
        if self.specs is None:
            return flat
        return {
            p: jax.lax.with_sharding_constraint(x, context_sharding(self.mesh, self.specs[p])) for p, x in flat.items()
        }

    def collections(self, flat: dict) -> dict:
        """The variable collections the model's stacks read: the stacked weights' sums, carried, and
        their layer numbers, scanned (maxmoe.training.layer_grads.summing)."""
        unflat = traverse_util.unflatten_dict
        index = {p: jnp.arange(flat[p].shape[0], dtype=jnp.int32) for p in self.paths}
        return {layer_grads.LAYER_SUM: unflat({p: flat[p] for p in self.paths}), layer_grads.LAYER_INDEX: unflat(index)}


def _value_and_grads(loss_fn, paths, params, extra, batch, routed: dict, more: Callable) -> tuple:
    """((loss, aux), free grads {path: g}, routed grads {path: g}) of one micro-batch.

    The weights at `paths` are not differentiated: the model routes their gradients to the
    collections more(routed) builds, and `routed`'s own gradients are what arrives there.
    """
    flat = traverse_util.flatten_dict(params)
    held = {p: x for p, x in flat.items() if p in paths}
    free = {p: x for p, x in flat.items() if p not in paths}

    def loss_of(free, routed):
        return loss_fn(traverse_util.unflatten_dict({**free, **held}), extra, batch, more(routed))

    (loss, aux), (g_free, g_routed) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(free, routed)
    return (loss, aux), g_free, g_routed


def _add_micro_batch(sums: _Sums, params, extra, batch, carry) -> tuple:
    """carry (loss, aux, {path: sum}) plus one micro-batch: the stacked weights' gradients summed
    inside the backward layer loop (their sums go in as the carried LAYER_SUM), the others after."""
    loss, aux, flat = carry
    carried = {p: flat[p] for p in sums.paths}

    def more(carried):
        return sums.collections({**flat, **carried})

    (loss_m, aux_m), g_free, g_held = _value_and_grads(sums.loss_fn, sums.paths, params, extra, batch, carried, more)
    out = {p: flat[p] + g.astype(flat[p].dtype) for p, g in g_free.items()}
    return loss + loss_m, jax.tree.map(jnp.add, aux, aux_m), sums.constrain({**out, **g_held})


def accumulate(sums: _Sums, params, extra, micro, count: int) -> tuple:
    """(loss, aux, {path: sum}) over the first `count` micro-batches of `micro` [accum, ...]: THE
    micro-batch loop (a scan; one micro-batch is called directly; zeros for none). Sums are
    float32 for narrow parameters (`_sum_dtype`), on `sums`' shardings."""
    first = jax.tree.map(lambda x: x[0], micro)
    flat = traverse_util.flatten_dict(params)
    shapes = {p: jax.ShapeDtypeStruct(x.shape, _sum_dtype(x.dtype)) for p, x in flat.items()}
    loss, aux = jax.eval_shape(lambda p, t: sums.loss_fn(p, extra, first, sums.collections(t)), params, shapes)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss, aux, shapes))
    carry = (zeros[0], zeros[1], sums.constrain(zeros[2]))
    if count == 1:
        return _add_micro_batch(sums, params, extra, first, carry)
    if count:
        whole = count == jax.tree.leaves(micro)[0].shape[0]

        def body(carry, mb):
            return _add_micro_batch(sums, params, extra, mb, carry), None

        carry, _ = jax.lax.scan(body, carry, micro if whole else jax.tree.map(lambda x: x[:count], micro))
    return carry


def _summing(config: Config, layout: Any, boxed: Any, specs: Any) -> _Sums:
    """The micro-batch sums' model and shardings (`specs`: a tree of PartitionSpecs, or None)."""
    paths = stacked_paths(nn.get_partition_spec(boxed), float32_leaves(boxed))
    mesh = None if layout is None or specs is None else layout.mesh
    flat_specs = None if mesh is None else traverse_util.flatten_dict(specs)
    one_layer = {} if mesh is None else {p: PartitionSpec(*tuple(flat_specs[p])[1:]) for p in paths}
    transform = layer_grads.summing(one_layer, mesh)
    return _Sums(make_loss_fn(config, layout, transform), frozenset(paths), mesh, flat_specs)


def make_grads_fn(config: Config, layout: Any = None) -> Callable:
    """grads(params, router, batch) -> (loss, aux, grads): means over train.grad_accum micro-batches.

    One tier (no layout, or one replica): params float32 on their shardings, the sums on the
    same. Two tiers (layout.replicas > 1): params float32 on ZeRO-1 shardings; the compute copy
    is gathered across domains once (`weight_copy`), each replica sums its micro-batches on the
    in-domain shardings, and one reduce-scatter per leaf returns the mean to ZeRO-1 (or, under
    mesh.zero1_reduce=per_layer, the layer stacks' inside the last micro-batch's backward loop).
    """
    accum = config.train.grad_accum
    boxed = abstract_variables(config.model, boxed=True)["params"]
    if layout is None or layout.replicas == 1:
        specs = None if layout is None else jax.tree.map(lambda s: s.spec, layout.tree_shardings(boxed))
        sums = _summing(config, layout, boxed, specs)

        def grads_fn(params, router, batch_BT):
            loss, aux, total = accumulate(sums, params, router, micro_batches(batch_BT, accum), accum)
            grads = traverse_util.unflatten_dict({p: g / accum for p, g in total.items()})
            return loss / accum, mean_stats(aux, accum), grads

        return grads_fn
    return _two_tier_grads_fn(config, layout, boxed)


def _two_tier_grads_fn(config: Config, layout: Any, boxed: Any) -> Callable:
    """make_grads_fn's two tiers: the per-replica loop inside replicas.over_replicas."""
    accum, r = config.train.grad_accum, layout.replicas
    copy, zero1, in_domain = weight_copy(config, layout, boxed)
    sums = _summing(config, layout, boxed, jax.tree.map(lambda s: s.spec, in_domain))
    scale = 1.0 / (accum * r)
    plan = None
    if config.mesh.zero1_reduce == "per_layer":
        plan = replicas.plan_layer_grads(zero1, nn.get_partition_spec(boxed), float32_leaves(boxed), layout.shape)
        reduce_loss = make_loss_fn(config, layout, layer_grads.reducing(replicas.LayerGrads(plan, layout.mesh, r)))

    def per_replica(compute, extra, batch):
        micro = micro_batches(batch, accum)
        if plan is None:
            return jax.tree.map(lambda x: x[None], accumulate(sums, compute, extra, micro, accum))
        loss, aux, flat = accumulate(sums, compute, extra, micro, accum - 1)
        into = {p: jnp.zeros(replicas.layer_grad_shape(flat[p].shape, g, r), jnp.float32) for p, g in plan.items()}

        def more(into):
            unflat = traverse_util.unflatten_dict
            return {
                layer_grads.LAYER_GRAD: unflat(into),
                layer_grads.LAYER_GRAD_ADD: unflat({p: flat[p] for p in plan}),
            }

        last = jax.tree.map(lambda x: x[-1], micro)
        (loss_m, aux_m), g_free, g_into = _value_and_grads(
            reduce_loss, frozenset(plan), compute, extra, last, into, more
        )
        free = {p: flat[p] + g.astype(flat[p].dtype) for p, g in g_free.items()}
        out = (loss + loss_m, jax.tree.map(jnp.add, aux, aux_m), sums.constrain(free))
        return (*jax.tree.map(lambda x: x[None], out), {p: replicas.split_share(x, plan[p]) for p, x in g_into.items()})

    run = replicas.over_replicas(per_replica, layout.mesh, layer_plan=plan)
    flat_zero1 = traverse_util.flatten_dict(zero1)

    def grads_fn(params, router, batch_BT):
        loss_R, aux_R, *sums_R = run(copy(params), router, batch_BT)
        aux = mean_stats(jax.tree.map(lambda v: v.sum(0), aux_R), accum * r)
        if plan is None:
            grads = traverse_util.unflatten_dict(replicas.reduce_to_zero1(sums_R[0], flat_zero1, scale))
        else:
            free_R, layer = sums_R
            others = replicas.reduce_to_zero1(free_R, {p: flat_zero1[p] for p in free_R}, scale)
            grads = traverse_util.unflatten_dict(
                {**others, **replicas.assemble_layer_grads(layer, plan, flat_zero1, scale)}
            )
        return loss_R.sum(0) / (accum * r), aux, grads

    return grads_fn
