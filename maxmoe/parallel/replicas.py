"""Two tiers of data parallelism: GSPMD inside a scale-up domain, once per step across domains.

Under mesh.across_domains=zero1 the mesh has a `replica` axis (data parallelism across domains)
outside the in-domain axes. Per step: `compute_copy` gathers the float32 ZeRO-1 master weights
to the compute dtype on the in-domain shardings (one all-gather over `replica`); the micro-batch
loop runs per replica inside `over_replicas` (a shard_map manual over `replica` only, so nothing
inside crosses a domain: maxmoe.training.accumulate); `reduce_to_zero1` returns the sums to
ZeRO-1 (one reduce-scatter over `replica`), or, under mesh.zero1_reduce=per_layer, `LayerGrads`
reduce-scatters each layer's inside the last micro-batch's backward loop. docs/SHARDING.md
("Two tiers") has why a shard_map and what crosses domains.
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


def over_replicas(per_replica: Callable, mesh, layer_plan: dict | None = None) -> Callable:
    """per_replica(weights, extra, batch) run once per replica: manual over `replica` only.

    `weights` and `extra` enter whole on every replica, `batch` split over it (rows
    replica-major); outputs gain a leading replica dimension. With a `layer_plan`
    (`plan_layer_grads`) per_replica returns a fourth output, {path: share split by `split_share`},
    whose replica dimension is the split one. `check_vma=False`: nothing differentiates through
    this shard_map (autodiff runs inside), and with vma checks on, jax 0.10-0.12 fail to lower
    the nested dispatch shard_map under autodiff.
    """
    out_specs = PartitionSpec(REPLICA)
    if layer_plan is not None:
        layer_specs = {p: PartitionSpec(*(None,) * (g.dim + 2), REPLICA) for p, g in layer_plan.items()}
        out_specs = (PartitionSpec(REPLICA),) * 3 + (layer_specs,)
    return jax.shard_map(
        per_replica,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(REPLICA)),
        out_specs=out_specs,
        axis_names={REPLICA},
        check_vma=False,
    )


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
    its dimensions other than `layers` (Layout.zero1_shardings under mesh.zero1_reduce=per_layer).
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
    """The last micro-batch's per-layer gradient sink under mesh.zero1_reduce=per_layer
    (maxmoe.training.layer_grads.reducing routes each stacked weight through it).

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


def split_share(share, g: LayerGrad):
    """A stacked share [L, ..., ways x rest, ...] as [L, ..., ways, 1, rest, ...] (the 1: `replica`):
    what the per-replica region returns for `assemble_layer_grads`."""
    d = g.dim + 1
    return share.reshape(*share.shape[:d], g.ways, 1, share.shape[d] // g.ways, *share.shape[d + 1 :])


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
