"""Two tiers of data parallelism: GSPMD inside a scale-up domain, once per step across domains.

Under `mesh.across_domains=zero1` the mesh has a `replica` axis (data parallelism across
scale-up domains) outside the in-domain axes (data, expert, tensor). One step:

    compute = compute_copy(master)     f32 master weights on the ZeRO-1 sharding -> compute
                                       dtype on the in-domain sharding: ONE all-gather over
                                       `replica` (in the compute dtype), then in-domain ones
    grads_R = accumulate(compute, ...) shard_map, manual over `replica` only, around the scan
                                       over micro-batches: inside, the model keeps its GSPMD
                                       sharding over the in-domain axes and gradients sum in
                                       float32 on the in-domain sharding; nothing crosses a
                                       domain, because nothing inside can name `replica`
    grads   = reduce_to_zero1(grads_R) the per-replica sums [R, ...] -> ZeRO-1: ONE
                                       reduce-scatter over `replica`
    then the optimizer updates the ZeRO-1 shards elementwise.

Under mesh.reduce_per_layer the reduce-scatter of the layer stacks' weights moves into the
last micro-batch's backward pass (`make_accumulate_layer_grads`): there the model's
`layer_grad_hook` (`LayerGrads`) sends each layer's gradient, plus the earlier micro-batches'
f32 sum, across domains as soon as that layer's backward is done, one reduce-scatter per
weight and layer, beside the layers still to run; the same bytes, no longer after the loop.
It is the one place inside the per-replica region that names `replica`.

Under mesh.sum_per_layer each micro-batch adds the layer stacks' weight gradients to the
float32 sums inside its backward layer loop (maxmoe.training.layer_sums, the `sum_fn` the
accumulations take), so no micro-batch's gradient stack is held beside the sums.

Why a shard_map: under plain GSPMD the gradient of a weight replicated over `replica`,
taken on a batch sharded over it, is a sum over the whole batch, so XLA reduces it across
domains inside the loop, once per micro-batch. A manual axis keeps per-replica partial
sums until the loop ends.

`check_vma=False`: nothing differentiates through this shard_map (autodiff runs inside it,
per replica), so its inputs are plain per-device values. With vma checking on, jax 0.10-0.12
fail to lower the model's nested shard_map (the expert dispatch) under autodiff: its
residuals get out_specs naming the outer manual axis.

Inside the shard_map the context mesh marks `replica` Manual. Sharding constraints must be
built on that abstract mesh and nested shard_maps must name it and make only the remaining
axes manual (maxmoe.parallel.shard_context); jax refuses the concrete mesh there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from maxmoe.parallel.layer_hooks import route_gradient, stacked_paths
from maxmoe.parallel.names import COMPUTE_COPY, FLOAT32_COPY, REPLICA_AXIS, ZERO1_REDUCTION
from maxmoe.parallel.shard_context import axes_of, context_sharding, shard_map_in_context

REPLICA = REPLICA_AXIS


def without_axis(spec: PartitionSpec, *axis: str) -> PartitionSpec:
    """`spec` with the mesh axes `axis` removed from every dimension."""
    out = []
    for entry in spec:
        axes = tuple(a for a in axes_of(entry) if a not in axis)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def micro_batches(batch: Any, accum: int) -> Any:
    """[b, ...] -> [accum, b / accum, ...], strided: micro-batch m holds rows m, m + accum, ..."""

    def split(x):
        return x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def compute_copy(master: Any, zero1: Any, in_domain: Any, keep_f32: Any, dtype, axis: str = REPLICA) -> Any:
    """The weights for one step: `dtype` on the in-domain shardings, the same on every replica.

    Per leaf: cast on the ZeRO-1 sharding (constrained there, or the partitioner moves the
    cast after the gather and gathers float32), drop `axis` (the all-gather across domains,
    or across pipeline stages with axis="pipeline"), then the in-domain sharding (in-domain
    all-gathers of the axes the optimizer adds). Leaves whose `keep_f32` is True stay
    float32 (the model uses them so). Named scopes mark these gathers in the compiled
    program's metadata: `compute_copy` (cast) and `float32_copy` (kept).
    """

    def one(p, z, d, keep):
        with jax.named_scope(FLOAT32_COPY if keep else COMPUTE_COPY):
            if not keep:
                p = jax.lax.with_sharding_constraint(p.astype(dtype), z)
            p = jax.lax.with_sharding_constraint(p, NamedSharding(z.mesh, without_axis(z.spec, axis)))
            return jax.lax.with_sharding_constraint(p, d)

    return jax.tree.map(one, master, zero1, in_domain, keep_f32)


def _sum_dtype(dtype):
    """Sums of narrow floats (bf16 gradients of the compute copy) are kept in float32."""
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4 else dtype


def over_replicas(per_replica: Callable, mesh) -> Callable:
    """per_replica(weights, extra, batch) run once per replica: manual over `replica` only.

    `weights` and `extra` enter whole on every replica, `batch` split over it (rows
    replica-major); outputs gain a leading replica dimension. `check_vma=False`: nothing
    differentiates through this shard_map (autodiff runs inside), and with vma checks on,
    jax 0.10-0.12 fail to lower the nested dispatch shard_map under autodiff.
    """
    return jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(REPLICA)),
        out_specs=PartitionSpec(REPLICA),
        axis_names={REPLICA},
        check_vma=False,
    )


def _on_domain(mesh, in_domain_specs: Any) -> Callable:
    """tree -> the tree constrained to `in_domain_specs` (on the context mesh)."""

    def constrain(tree):
        return jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(x, context_sharding(mesh, s)), tree, in_domain_specs
        )

    return constrain


def adding(grad_fn: Callable) -> Callable:
    """grad_fn(params, extra, batch) -> ((loss, aux), grads) as sum_fn(params, extra, batch, sums)
    -> ((loss, aux), sums + grads): each gradient added to its sum in the sum's dtype."""

    def sum_fn(params, extra, batch, sums):
        (loss, aux), grads = grad_fn(params, extra, batch)
        return (loss, aux), jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), sums, grads)

    return sum_fn


def _sum_micro_batches(sum_fn: Callable, compute, extra, micro, count: int, on_domain: Callable) -> tuple:
    """(loss, aux, grads) summed over the first `count` of the micro-batches `micro` (a scan; zeros
    for 0), gradients in float32 (`_sum_dtype`) on the in-domain shardings.

    sum_fn(params, extra, batch, sums) -> ((loss, aux), sums plus the batch's gradients):
    `adding(grad_fn)`, or maxmoe.training.layer_sums.summing_grad_fn (sums inside the layer loop).
    """
    grads = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, _sum_dtype(x.dtype)), compute)
    (loss, aux), _ = jax.eval_shape(sum_fn, compute, extra, jax.tree.map(lambda x: x[0], micro), grads)
    (loss, aux), grads = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ((loss, aux), grads))

    def body(carry, mb):
        loss, aux, grads = carry
        (loss_m, aux_m), grads = sum_fn(compute, extra, mb, grads)
        return (loss + loss_m, jax.tree.map(jnp.add, aux, aux_m), on_domain(grads)), None

    carry = (loss, aux, on_domain(grads))
    if count:
        whole = count == jax.tree.leaves(micro)[0].shape[0]
        carry, _ = jax.lax.scan(body, carry, micro if whole else jax.tree.map(lambda x: x[:count], micro))
    return carry


def make_accumulate(sum_fn: Callable, accum: int, mesh, in_domain_specs: Any) -> Callable:
    """accumulate(compute, extra, batch) -> (loss_R, aux_R, grads_R): each replica's sums over its micro-batches.

    sum_fn(params, extra, micro_batch, sums) -> ((loss, aux), sums + grads) (`_sum_micro_batches`).
    `compute` and `extra` enter replicated over `replica`, `batch` sharded over it (rows
    replica-major). Every output gets a leading dimension of size R (one entry per replica,
    sharded over `replica`); gradients are float32 sums constrained to `in_domain_specs` on
    every micro-batch.
    """

    def per_replica(compute, extra, batch):
        micro = micro_batches(batch, accum)
        sums = _sum_micro_batches(sum_fn, compute, extra, micro, accum, _on_domain(mesh, in_domain_specs))
        return jax.tree.map(lambda x: x[None], sums)

    return over_replicas(per_replica, mesh)


@dataclasses.dataclass(frozen=True)
class LayerGrad:
    """Where one layer-stack weight's ZeRO-1 shard lies, seen from one layer's slice.

    dim: the slice's dimension that `replica` splits (its ZeRO-1 entry: in-domain axes, then
    `replica` as the minor factor); ways: the in-domain shards of that dimension; spec: the
    slice's ZeRO-1 sharding without `replica` (in-domain); split: the same with `dim` written
    as three, (ways, R, rest).
    """

    dim: int
    ways: int
    spec: PartitionSpec
    split: PartitionSpec


def plan_layer_grads(zero1: Any, logical: Any, keep_f32: Any, mesh_shape: dict[str, int]) -> dict[tuple, LayerGrad]:
    """{param path: LayerGrad} of the layer-stack weights whose gradient can reduce-scatter per layer.

    zero1: NamedShardings; logical: the logical PartitionSpecs (a stack's first name is
    `layers`); keep_f32: the leaves the model uses in float32 (norm scales, the router's gate:
    small, reduced after the loop with the rest). A leaf qualifies when `replica` splits one of
    its dimensions other than `layers` (Layout.zero1_shardings under mesh.reduce_per_layer).
    """
    flat_z = traverse_util.flatten_dict(zero1)
    plan = {}
    for path in stacked_paths(logical, keep_f32):
        sharding = flat_z[path]
        entries = [axes_of(e) for e in sharding.spec]
        dims = [i for i, axes in enumerate(entries) if REPLICA in axes]
        if not dims or dims[0] == 0 or entries[dims[0]][-1] != REPLICA:
            continue
        d = dims[0]
        inner = entries[d][:-1]
        per_layer = [without_axis(PartitionSpec(e), REPLICA)[0] if e else None for e in entries[1:]]
        split = (*per_layer[: d - 1], inner or None, None, None, *per_layer[d:])
        ways = math.prod(mesh_shape[a] for a in inner)
        plan[path] = LayerGrad(d - 1, ways, PartitionSpec(*per_layer), PartitionSpec(*split))
    return plan


@dataclasses.dataclass(frozen=True, eq=False)
class LayerGrads:
    """The model's `layer_grad_hook` (maxmoe.model.layers.logical_param) in the last micro-batch.

    hook(path, w, into, add) returns w; backward, one layer's gradient of w plus `add` (the
    float32 sum of the earlier micro-batches, in-domain) is reduce-scattered over `replica`
    into `into`'s gradient: this replica's ZeRO-1 rows of the layer, in the order
    `assemble_layer_grads` puts back. It runs inside the backward layer loop, so each layer's
    cross-domain reduction overlaps the layers still to run (jax scope `reduce_to_zero1`).
    """

    plan: dict
    mesh: Any
    replicas: int

    def __call__(self, path: tuple, w, into, add):
        g = self.plan[path]
        r = self.replicas
        share = into.shape

        def backward(add, ct):
            with jax.named_scope(ZERO1_REDUCTION):
                # The in-domain reduction first, in the cotangent's dtype, as a reduce-scatter onto
                # ZeRO-1's in-domain shards (the plain step reduces each micro-batch's so).
                # `add` (in-domain sums) sliced to the same shards: no traffic.
                ct, add = (jax.lax.with_sharding_constraint(x, context_sharding(self.mesh, g.spec)) for x in (ct, add))
                total = ct.astype(jnp.float32) + add
                shape = total.shape
                split = (*shape[: g.dim], g.ways, r, shape[g.dim] // (g.ways * r), *shape[g.dim + 1 :])
                # Manual over the in-domain axes too: on a partly auto operand XLA's partitioner would
                # gather the in-domain shards first and reduce the whole layer across domains.
                x = shard_map_in_context(
                    functools.partial(jax.lax.psum_scatter, axis_name=REPLICA, scatter_dimension=g.dim + 1, tiled=True),
                    mesh=self.mesh,
                    in_specs=(g.split,),
                    out_specs=g.split,
                    check_vma=False,
                )(total.reshape(split))
                return x.reshape(share)

        return route_gradient(w, into, add, backward)


def layer_grad_shape(shape: tuple, g: LayerGrad, replicas: int) -> tuple:
    """A stacked leaf's per-replica share: the rows `LayerGrads` reduce-scatters into (dim g.dim + 1)."""
    d = g.dim + 1
    return (*shape[:d], shape[d] // replicas, *shape[d + 1 :])


def assemble_layer_grads(layer: dict, plan: dict, zero1: dict, scale: float) -> dict:
    """{path: [L, ..., ways, R, rest, ...]} reduce-scattered shares -> scale x the gradients on ZeRO-1.

    Replica r's share holds, for each in-domain block i of the split dimension, block i's r-th
    R-th; the per-replica region returns it as [.., ways, 1, rest, ..] with `replica` on the 1,
    so the global array's order is (i, r, rest): ZeRO-1's (in-domain major, `replica` minor).
    Merging the three dimensions moves nothing.
    """
    out = {}
    for path, x in layer.items():
        d = plan[path].dim + 1  # the split dimension of the stacked leaf
        x = x.reshape(*x.shape[:d], x.shape[d] * x.shape[d + 1] * x.shape[d + 2], *x.shape[d + 3 :])
        out[path] = jax.lax.with_sharding_constraint(x * scale, zero1[path])
    return out


def make_accumulate_layer_grads(
    sum_fn: Callable, last_grad_fn: Callable, plan: dict, accum: int, mesh, in_domain_specs: Any
) -> Callable:
    """accumulate(compute, extra, batch) -> (loss_R, aux_R, grads_R, layer) under mesh.reduce_per_layer.

    As make_accumulate for the first accum - 1 micro-batches; the last runs
    last_grad_fn(params, extra, micro_batch, into, add) -> (loss, aux),
    differentiated w.r.t. the weights not in `plan` and `into` (zeros shaped as each planned
    leaf's share, `layer_grad_shape`), with `add` the earlier micro-batches' sums of the
    planned leaves. grads_R: flat {path: [R, ...]} float32 sums of the other leaves; layer:
    {path: [L, ..., ways, R, rest, ...]} the planned ones reduce-scattered (summed over
    replicas already; `assemble_layer_grads` merges the split dimension back). The shard_map is
    over_replicas' but for `layer`'s out_specs.
    """
    flat_specs = traverse_util.flatten_dict(in_domain_specs)

    def on_domain(flat):
        return {p: jax.lax.with_sharding_constraint(x, context_sharding(mesh, flat_specs[p])) for p, x in flat.items()}

    def per_replica(compute, extra, batch):
        micro = micro_batches(batch, accum)
        loss, aux, grads = _sum_micro_batches(
            sum_fn, compute, extra, micro, accum - 1, _on_domain(mesh, in_domain_specs)
        )
        grads = traverse_util.flatten_dict(grads)
        last = jax.tree.map(lambda x: x[-1], micro)
        flat = traverse_util.flatten_dict(compute)
        held = {p: x for p, x in flat.items() if p in plan}
        free = {p: x for p, x in flat.items() if p not in plan}
        into = {p: jnp.zeros(layer_grad_shape(x.shape, plan[p], _replicas()), jnp.float32) for p, x in held.items()}
        add = {p: grads[p] for p in held}

        def loss_of(free, into):
            params = traverse_util.unflatten_dict({**free, **held})
            unflat = traverse_util.unflatten_dict
            return last_grad_fn(params, extra, last, unflat(into), unflat(add))

        (loss_m, aux_m), (g_free, g_into) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(free, into)
        free_sums = on_domain({p: grads[p] + g.astype(grads[p].dtype) for p, g in g_free.items()})
        out = (loss + loss_m, jax.tree.map(jnp.add, aux, aux_m), free_sums)
        return (*jax.tree.map(lambda x: x[None], out), {p: _split(x, plan[p]) for p, x in g_into.items()})

    def run(compute, extra, batch):
        layer_specs = {p: PartitionSpec(*(None,) * (g.dim + 2), REPLICA) for p, g in plan.items()}
        return jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(REPLICA)),
            out_specs=(PartitionSpec(REPLICA),) * 3 + (layer_specs,),
            axis_names={REPLICA},
            check_vma=False,
        )(compute, extra, batch)

    return run


def _split(share, g: LayerGrad):
    """A stacked share [L, ..., ways x rest, ...] as [L, ..., ways, 1, rest, ...] (the 1: `replica`)."""
    d = g.dim + 1
    return share.reshape(*share.shape[:d], g.ways, 1, share.shape[d] // g.ways, *share.shape[d + 1 :])


def _replicas() -> int:
    """Size of the manual `replica` axis, inside the per-replica shard_map."""
    return jax.lax.axis_size(REPLICA)


def reduce_to_zero1(grads_R: Any, zero1: Any, scale: float, axis: str = REPLICA) -> Any:
    """scale x the sum over the leading dimension, on the ZeRO-1 shardings: one reduce-scatter over `axis` per leaf.

    grads_R: per-replica (or, with axis="pipeline", per-stage) sums [R, ...], dim 0 over
    `axis`. Each entry is first sliced to ZeRO-1-without-`axis`, which its in-domain layout
    already holds (no traffic), so the only collective left is over `axis`.
    """

    def one(g, z):
        local = NamedSharding(z.mesh, PartitionSpec(axis, *without_axis(z.spec, axis)))
        g = jax.lax.with_sharding_constraint(g, local)
        return jax.lax.with_sharding_constraint(g.sum(0) * scale, z)

    with jax.named_scope(ZERO1_REDUCTION):
        return jax.tree.map(one, grads_R, zero1)


def replica_mean(fn: Callable, mesh) -> Callable:
    """fn(params, extra, batch) -> scalar, run per replica on its rows; the mean over replicas.

    For forward-only programs (evaluation) under the two-tier layout: each replica computes
    on its own rows with the in-domain sharding, as in training.
    """

    def per_replica(params, extra, batch):
        return fn(params, extra, batch)[None]

    def run(params, extra, batch):
        return over_replicas(per_replica, mesh)(params, extra, batch).mean()

    return run
