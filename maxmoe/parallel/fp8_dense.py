"""FP8 dense projections on each device's shards, where a kernel call needs no partitioning.

XLA's SPMD partitioner cannot split a custom call such as maxmoe's Triton kernel: it would run
it on gathered operands. So with `model.fp8=blockwise` on a GPU target the dense projections
run inside a `shard_map` laid out from the projection's logical axes, and their three GEMMs
(forward, dx, dw) go through `maxmoe.parallel.fp8_grouped_kernel` with one group:

  x [batch..., K]  sharded as the rules give its batch dims and its contraction K
  w [K, N]         K as x's, N over its own axes not already used by x (the rest gathered,
                   as XLA gathers an FSDP weight for its dot)
  y [batch..., N]  batch dims as x, N as w; summed over K's axes when K is split (a
                   row-parallel projection: the tensor-parallel all-reduce)

In the backward jax transposes the layout: the weight's gradient is summed over the axes its
shard is replicated on, and the gather of an FSDP weight becomes a reduce-scatter.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from maxmoe.parallel.fp8_matmul import fp8_matmul
from maxmoe.parallel.replicas import axes_of, shard_map_in_context


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def projection_specs(x_spec: PartitionSpec, w_spec: PartitionSpec, x_ndim: int):
    """(x, w, y) PartitionSpecs of the shard_map and the axes y is summed over."""
    x_entries = tuple(x_spec) + (None,) * (x_ndim - len(tuple(x_spec)))
    batch = x_entries[:-1]
    k_axes = axes_of(x_entries[-1])
    used = {a for entry in batch for a in axes_of(entry)} | set(k_axes)
    w_entries = tuple(w_spec) + (None,) * (2 - len(tuple(w_spec)))
    n_axes = tuple(a for a in axes_of(w_entries[1]) if a not in used)
    k, n = _entry(k_axes), _entry(n_axes)
    return PartitionSpec(*batch, k), PartitionSpec(k, n), PartitionSpec(*batch, n), k_axes


def sharded_fp8_projection(mesh, x_spec: PartitionSpec, w_spec: PartitionSpec, recipe: str, kernels):
    """fn(x [..., K], w [K, N]) -> [..., N]: fp8_matmul with `kernels` on each device's shards.

    x_spec, w_spec: how the rules shard x and w (the specs of their logical axes); kernels:
    maxmoe.parallel.fp8_matmul.blockwise_kernels of the grouped backend.
    """

    def run(x, w_KN):
        x_in, w_in, y_out, k_axes = projection_specs(x_spec, w_spec, x.ndim)

        def body(x, w_KN):
            y = fp8_matmul(x, w_KN, recipe, kernels)
            return jax.lax.psum(y, k_axes) if k_axes else y

        return shard_map_in_context(body, mesh=mesh, in_specs=(x_in, w_in), out_specs=y_out)(x, w_KN)

    return run
