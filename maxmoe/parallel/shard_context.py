"""Entering shard_map from wherever the program is: at top level or nested in a partial-manual one.

The two-tier step (maxmoe.parallel.replicas) runs the model inside a shard_map that is manual
over `replica` only. There the context mesh marks `replica` Manual: sharding constraints must
be built on that abstract mesh, and nested shard_maps (expert dispatch, the kernels' per-shard
programs) must name it and make only the remaining axes manual; jax refuses the concrete mesh
there. Kernels and strategies alike enter shard_map through `shard_map_in_context`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec


def in_manual_context() -> bool:
    """True inside a shard_map that left some mesh axes to GSPMD (the per-replica region)."""
    context = jax.sharding.get_abstract_mesh()
    return not context.empty and bool(context.manual_axes)


def context_sharding(mesh, spec: PartitionSpec) -> NamedSharding:
    """NamedSharding for a constraint on `mesh`: on the context's abstract mesh inside a shard_map."""
    if in_manual_context():
        return NamedSharding(jax.sharding.get_abstract_mesh(), spec)
    return NamedSharding(mesh, spec)


def shard_map_in_context(f: Callable, *, mesh, in_specs, out_specs, **kwargs) -> Callable:
    """jax.shard_map over every axis of `mesh`, or, nested in a partial-manual one, over the axes still auto.

    The specs name in-domain axes only, so they stay as they are.
    """
    if in_manual_context():
        context = jax.sharding.get_abstract_mesh()
        auto = frozenset(context.axis_names) - frozenset(context.manual_axes)
        return jax.shard_map(f, mesh=context, in_specs=in_specs, out_specs=out_specs, axis_names=auto, **kwargs)
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)
