"""FP8 dense projections on each device's shards, where a kernel call needs no partitioning.

    project = sharded_fp8_projection(mesh, x_spec, w_spec, recipe, kernels)
    y = project(x, w_KN)                        # x [..., K], w [K, N] -> [..., N]

XLA's SPMD partitioner cannot split a custom call, so with `model.fp8=blockwise` on a GPU target
the dense projections run inside a `shard_map` laid out from the projection's logical axes
(`projection_specs`) and their three GEMMs go through `maxmoe.kernels.fp8_grouped` with one
group. An FSDP weight is quantised on its shard in 128x128 blocks and gathered as e4m3 values
plus float32 scales where every gathered dimension is whole blocks (`fp8_gather_axes`),
otherwise gathered in bf16 and quantised after; the values are the whole weight's either way.

docs/KERNELS.md, "FP8 GEMMs" ("Dense projections on each device's shards") has the layout and
its backward.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec

from maxmoe.kernels.fp8_matmul import TILE, blockwise_dot_quantized, fp8_matmul, scaled_dot
from maxmoe.kernels.fp8_quant import E4M3, quantize
from maxmoe.kernels.varying import vary_alike, vary_over, varying_axes
from maxmoe.parallel.shard_context import axes_of, shard_map_in_context


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _weight_entries(w_spec: PartitionSpec) -> tuple:
    """The two entries (K, N) of a weight's spec, a missing one whole."""
    return tuple(w_spec) + (None,) * (2 - len(tuple(w_spec)))


def projection_specs(x_spec: PartitionSpec, w_spec: PartitionSpec, x_ndim: int):
    """(x, w, y) PartitionSpecs of the shard_map and the axes y is summed over."""
    x_entries = tuple(x_spec) + (None,) * (x_ndim - len(tuple(x_spec)))
    batch = x_entries[:-1]
    k_axes = axes_of(x_entries[-1])
    used = {a for entry in batch for a in axes_of(entry)} | set(k_axes)
    w_entries = _weight_entries(w_spec)
    n_axes = tuple(a for a in axes_of(w_entries[1]) if a not in used)
    k, n = _entry(k_axes), _entry(n_axes)
    return PartitionSpec(*batch, k), PartitionSpec(k, n), PartitionSpec(*batch, n), k_axes


def fp8_gather_axes(mesh, x_in: PartitionSpec, w_spec: PartitionSpec, w_in: PartitionSpec, w_shape):
    """Per dimension of w [K, N], the mesh axes to gather its fp8 blocks over (major first), or
    None where the weight is gathered in bf16: nothing to gather, a gathered axis that does
    not split the batch, axes kept that are not the major ones (the gather would interleave),
    or a shard that is not whole 128-blocks along a gathered dimension."""
    batch_axes = {a for entry in tuple(x_in)[:-1] for a in axes_of(entry)}
    gather = []
    for size, entry, kept_entry in zip(w_shape, _weight_entries(w_spec), tuple(w_in)):
        axes, kept = axes_of(entry), axes_of(kept_entry)
        if axes[: len(kept)] != kept:
            return None
        gathered = axes[len(kept) :]
        if not set(gathered) <= batch_axes:
            return None
        if gathered and (size // math.prod(mesh.shape[a] for a in axes)) % TILE:
            return None
        gather.append(gathered)
    return tuple(gather) if any(gather) else None


def _gathered_blocks(w_kn, gather):
    """The whole weight's e4m3 128x128 blocks and float32 block scales from one device's shard."""
    wq, scale = quantize(w_kn, E4M3, (TILE, TILE))
    for dim, axes in enumerate(gather):
        if axes:
            wq = jax.lax.all_gather(wq, axes, axis=dim, tiled=True)
            scale = jax.lax.all_gather(scale, axes, axis=dim, tiled=True)
    return wq, scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gathered_dense(x_MK, w_kn, gather, kernels):
    """x @ w for w's shard w_kn, gathered over `gather` in fp8 (blockwise, through `kernels`)."""
    wq_KN, scale = _gathered_blocks(w_kn, gather)
    return blockwise_dot_quantized(x_MK, wq_KN, scale, kernels).astype(x_MK.dtype)


def _gathered_dense_fwd(x_MK, w_kn, gather, kernels):
    return _gathered_dense(x_MK, w_kn, gather, kernels), (x_MK, w_kn)


def _gathered_dense_bwd(gather, kernels, saved, dy_MN):
    x_MK, w_kn = saved
    wq_KN, scale = _gathered_blocks(w_kn, gather)  # gathered again, as FSDP does, not kept
    dx_MK = blockwise_dot_quantized(dy_MN, wq_KN.T, scale.T, kernels)
    dw_KN = scaled_dot(x_MK.T, dy_MN, "blockwise", "wgrad", kernels, w_kn.dtype)
    for dim, axes in enumerate(gather):
        if axes:
            dw_KN = jax.lax.psum_scatter(dw_KN, axes, scatter_dimension=dim, tiled=True)
    dx_MK = vary_over(dx_MK.astype(x_MK.dtype), varying_axes(x_MK))
    return dx_MK, vary_over(dw_KN, varying_axes(w_kn))


_gathered_dense.defvjp(_gathered_dense_fwd, _gathered_dense_bwd)


def sharded_fp8_projection(mesh, x_spec: PartitionSpec, w_spec: PartitionSpec, recipe: str, kernels):
    """fn(x [..., K], w [K, N]) -> [..., N]: fp8_matmul with `kernels` on each device's shards.

    x_spec, w_spec: how the rules shard x and w (the specs of their logical axes); kernels:
    maxmoe.kernels.fp8_matmul.blockwise_kernels of the grouped backend.
    """

    def run(x, w_KN):
        x_in, w_in, y_out, k_axes = projection_specs(x_spec, w_spec, x.ndim)
        gather = None
        if recipe == "blockwise" and kernels:
            gather = fp8_gather_axes(mesh, x_in, w_spec, w_in, w_KN.shape)

        def body(x, w_kn):
            if gather is None:
                y = fp8_matmul(x, w_kn, recipe, kernels)
            else:
                x, w_kn = vary_alike(x, w_kn)
                y = _gathered_dense(x.reshape(-1, x.shape[-1]), w_kn, gather, kernels).reshape(*x.shape[:-1], -1)
            return jax.lax.psum(y, k_axes) if k_axes else y

        w_layout = w_in if gather is None else PartitionSpec(*_weight_entries(w_spec))
        return shard_map_in_context(body, mesh=mesh, in_specs=(x_in, w_layout), out_specs=y_out)(x, w_KN)

    return run
