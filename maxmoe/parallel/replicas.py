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
axes manual (maxmoe.kernels.shard_context); jax refuses the concrete mesh there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from maxmoe.kernels.shard_context import axes_of, context_sharding

REPLICA = "replica"  # maxmoe.config.REPLICA_AXIS (parallel imports nothing of ours but parallel)


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
        with jax.named_scope("float32_copy" if keep else "compute_copy"):
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


def make_accumulate(grad_fn: Callable, accum: int, mesh, in_domain_specs: Any) -> Callable:
    """accumulate(compute, extra, batch) -> (loss_R, aux_R, grads_R): each replica's sums over its micro-batches.

    grad_fn(params, extra, micro_batch) -> ((loss, aux), grads). `compute` and `extra` enter
    replicated over `replica`, `batch` sharded over it (rows replica-major). Every output
    gets a leading dimension of size R (one entry per replica, sharded over `replica`);
    gradients are float32 sums constrained to `in_domain_specs` on every micro-batch.
    """

    def on_domain(tree):
        return jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(x, context_sharding(mesh, s)), tree, in_domain_specs
        )

    def per_replica(compute, extra, batch):
        micro = micro_batches(batch, accum)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(grad_fn, compute, extra, first)
        (loss0, aux0), grads0 = jax.tree.map(lambda s: jnp.zeros(s.shape, _sum_dtype(s.dtype)), shapes)

        def body(carry, mb):
            loss, aux, grads = carry
            (loss_m, aux_m), grads_m = grad_fn(compute, extra, mb)
            grads = on_domain(jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), grads, grads_m))
            return (loss + loss_m, jax.tree.map(jnp.add, aux, aux_m), grads), None

        (loss, aux, grads), _ = jax.lax.scan(body, (loss0, aux0, on_domain(grads0)), micro)
        return jax.tree.map(lambda x: x[None], (loss, aux, grads))

    return over_replicas(per_replica, mesh)


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

    with jax.named_scope("reduce_to_zero1"):
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
