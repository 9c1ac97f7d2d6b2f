"""DeepSeek-V3's block-scaled FP8 grouped GEMMs as Pallas Triton kernels (NVIDIA GPUs).

    out_MN = blockwise_grouped_gemm(aq_MK, a_scale_MC, bq_GNK, b_scale_GCN, group_sizes_G)
    dw_GDF = fp8_grouped_wgrad(xq_DM, dyq_FM, group_sizes_G)     # scales applied by the caller

The forward and input-gradient GEMMs of `model.fp8=blockwise` (maxmoe.kernels.fp8_matmul) and
its weight gradient: rows sorted by group, aq with a float32 scale per 1x128 tile, bq per 128x128
block; one fp8 dot per 128 of the contraction, scaled and added into a float32 sum; no padding
of the groups; rows past sum(group_sizes) come out zero; K a multiple of 128 (callers pad).
`interpret=True` runs the same kernels in Pallas' interpreter (CPU tests); the dry run calls
`balanced_blockwise_gemm` and `balanced_grouped_wgrad` in their place.

docs/KERNELS.md, "FP8 GEMMs" ("Blockwise kernels") has the kernels' schedule and why.
Legend: M rows, K contraction, N output columns, G groups, C = K / 128 contraction blocks,
T row tiles; D, F the weight gradient's rows and columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN, balanced_blocks, grouped_wgrad, keep_live
from maxmoe.kernels.varying import sum_over_blocks, vary_alike

TILE = 128  # the recipe's contraction block; also the kernel's K step
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
NUM_STAGES = 4  # (128 x 128 + 128 x 128) fp8 per stage: 128 KiB of shared memory at 4
# The kernels' names in the lowered program (a Triton custom call's `name`): what
# maxmoe.analysis.lowering finds the experts' grouped GEMMs by. A dense projection's GEMM (one
# group, maxmoe.kernels.fp8_dense) runs the same kernel under its own name.
GEMM_NAME, WGRAD_NAME, DENSE_GEMM_NAME = "fp8_blockwise_grouped_gemm", "fp8_grouped_wgrad", "fp8_blockwise_gemm"


def _pallas():
    """(pallas, pallas.triton), imported when a kernel is built: importing them costs every
    maxmoe command about 0.4 s otherwise."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    return pl, plgpu


def tile_schedule(group_sizes_G, rows: int, block_m: int = BLOCK_M):
    """[T, 4] int32 (group, row block, first row, end row) per row tile; T = ceil(rows / block_m) + G - 1.

    Tiles past those the groups need have first row = end row (nothing to do).
    """
    g = group_sizes_G.shape[0]
    tiles = -(-rows // block_m) + g - 1
    sizes = group_sizes_G.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first_block = starts // block_m
    count = jnp.where(ends > starts, -(-ends // block_m) - first_block, 0)
    tile_end = jnp.cumsum(count)
    t = jnp.arange(tiles, dtype=jnp.int32)
    group_T = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), g - 1).astype(jnp.int32)
    block_T = first_block[group_T] + t - (tile_end[group_T] - count[group_T])
    live = t < tile_end[-1]
    lo = jnp.where(live, jnp.maximum(starts[group_T], block_T * block_m), 0)
    hi = jnp.where(live, jnp.minimum(ends[group_T], (block_T + 1) * block_m), 0)
    return jnp.stack([group_T, jnp.where(live, block_T, 0), lo, hi], axis=1)


def _kernel(schedule_ref, aq_ref, a_scale_ref, bq_ref, b_scale_ref, out_ref, *, block_m, block_n, blocks):
    pl, plgpu = _pallas()
    t, j = pl.program_id(0), pl.program_id(1)
    group, block = schedule_ref[t, 0], schedule_ref[t, 1]
    lo, hi = schedule_ref[t, 2], schedule_ref[t, 3]
    n = bq_ref.shape[1]
    rows = block * block_m + jnp.arange(block_m)
    cols = j * block_n + jnp.arange(block_n)
    row_ok = (rows >= lo) & (rows < hi)
    col_ok = cols < n
    row_slice, col_slice = pl.ds(block * block_m, block_m), pl.ds(j * block_n, block_n)

    def add_block(c, acc):
        k_slice = pl.ds(c * TILE, TILE)
        a = plgpu.load(aq_ref.at[row_slice, k_slice], mask=row_ok[:, None], other=0.0)
        b = plgpu.load(bq_ref.at[group, col_slice, k_slice], mask=col_ok[:, None], other=0.0)
        a_scale = plgpu.load(a_scale_ref.at[c, row_slice], mask=row_ok, other=0.0)
        b_scale = plgpu.load(b_scale_ref.at[group, c, col_slice], mask=col_ok, other=0.0)
        partial = plgpu.dot(a, b, trans_b=True)  # float32, a fresh accumulator per 128
        return acc + partial * a_scale[:, None] * b_scale[None, :]

    acc = jnp.zeros((block_m, block_n), jnp.float32)
    # No blocks for a tile with no rows. Not `jnp.where(hi > lo, blocks, 0)`: Pallas Triton lowers
    # that select of two constants in the predicate's type (i1), an invalid loop bound.
    trips = (hi > lo).astype(jnp.int32) * blocks
    acc = jax.lax.fori_loop(0, trips, add_block, acc)
    plgpu.store(out_ref.at[row_slice, col_slice], acc.astype(out_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def _call(kernel, name, grid, inputs, out_shape, out_dtype, interpret):
    """pallas_call with every operand whole (the kernels index themselves); inside shard_map the
    operands vary alike and the output varies as they do."""
    pl, plgpu = _pallas()
    inputs = vary_alike(*inputs)
    manual = getattr(jax.typeof(inputs[1]), "manual_axis_type", None)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(x.shape) for x in inputs],
        out_specs=whole(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype, manual_axis_type=manual),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=name,
    )(*inputs)


def blockwise_grouped_gemm(
    aq_MK, a_scale_MC, bq_GNK, b_scale_GCN, group_sizes_G, *, out_dtype=jnp.float32, interpret=False, name=GEMM_NAME
):
    """Row m of aq times bq[group of m]^T with DeepSeek-V3's block scales, in out_dtype.

    aq_MK / bq_GNK: float8 values; a_scale_MC [M, K/128] and b_scale_GCN [G, K/128, N]: float32.
    name: the kernel's name in the program (GEMM_NAME; DENSE_GEMM_NAME for one group's projection).
    """
    m, k = aq_MK.shape
    g, n, _ = bq_GNK.shape
    if k % TILE:
        raise ValueError(f"the contraction ({k}) must be a multiple of {TILE}; pad it with zeros")
    schedule = tile_schedule(group_sizes_G, m)
    out = _call(
        functools.partial(_kernel, block_m=BLOCK_M, block_n=BLOCK_N, blocks=k // TILE),
        name,
        (schedule.shape[0], -(-n // BLOCK_N)),
        (schedule, aq_MK, a_scale_MC.T, bq_GNK, b_scale_GCN),
        (m, n),
        out_dtype,
        interpret,
    )
    # Rows no tile covers (past the groups) were never written.
    valid = jnp.arange(m) < jnp.sum(group_sizes_G)
    return jnp.where(valid[:, None], out, jnp.zeros((), out_dtype))


def _wgrad_kernel(offsets_ref, xq_ref, dyq_ref, out_ref, *, block_d, block_f):
    pl, plgpu = _pallas()
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = offsets_ref[g], offsets_ref[g + 1]
    d_ok = i * block_d + jnp.arange(block_d) < xq_ref.shape[0]
    f_ok = j * block_f + jnp.arange(block_f) < dyq_ref.shape[0]
    d_slice, f_slice = pl.ds(i * block_d, block_d), pl.ds(j * block_f, block_f)

    def add_block(c, acc):
        rows = c * TILE + jnp.arange(TILE)
        row_ok = (rows >= start) & (rows < end)
        r_slice = pl.ds(c * TILE, TILE)
        x = plgpu.load(xq_ref.at[d_slice, r_slice], mask=d_ok[:, None] & row_ok[None, :], other=0.0)
        dy = plgpu.load(dyq_ref.at[f_slice, r_slice], mask=f_ok[:, None] & row_ok[None, :], other=0.0)
        return acc + plgpu.dot(x, dy, trans_b=True)  # float32, promoted every 128 rows

    first = start // TILE
    last = jnp.where(end > start, (end + TILE - 1) // TILE, first)
    acc = jax.lax.fori_loop(first, last, add_block, jnp.zeros((block_d, block_f), jnp.float32))
    plgpu.store(out_ref.at[g, d_slice, f_slice], acc, mask=d_ok[:, None] & f_ok[None, :])


def fp8_grouped_wgrad(xq_DM, dyq_FM, group_sizes_G, *, interpret=False):
    """out[g] = xq[:, rows of g] @ dyq[:, rows of g]^T in float32: [G, D, F].

    The weight gradient's GEMM with its contraction (the rows) last in both operands, as fp8
    tensor cores want it; a group's scales are per (group, column) (`fp8_quant.segment_quantize`),
    so they factor out and the caller applies them. Empty groups give zeros.
    """
    d, m = xq_DM.shape
    f = dyq_FM.shape[0]
    g = group_sizes_G.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), m)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    return _call(
        functools.partial(_wgrad_kernel, block_d=BLOCK_M, block_f=BLOCK_N),
        WGRAD_NAME,
        (g, -(-d // BLOCK_M), -(-f // BLOCK_N)),
        (offsets, xq_DM, dyq_FM),
        (g, d, f),
        jnp.float32,
        interpret,
    )


# ----------------------------------------------------------------------------------
# Dry-run stand-ins: the kernels do not compile for a CPU, so the dry run's GPU-shaped program
# (grouped backend `balanced_stand_in`) calls these instead: the kernels' operands, result and
# FLOPs, groups taken as G equal blocks of rows as the bf16 stand-in takes them
# (maxmoe.kernels.grouped_matmul). With M/G rows in every group their values are the kernels'.


def balanced_blockwise_gemm(aq_MK, a_scale_MC, bq_GNK, b_scale_GCN, group_sizes_G, *, out_dtype=jnp.float32):
    """blockwise_grouped_gemm's contract for balanced groups: one batched fp8 dot per 128 of the
    contraction, scaled and added into one float32 sum (the kernel's promotion, as a scan)."""
    m, k = aq_MK.shape
    g, n, _ = bq_GNK.shape
    c = k // TILE
    a_CGRT = balanced_blocks(aq_MK.reshape(m, c, TILE), g).transpose(2, 0, 1, 3)
    s_CGR = balanced_blocks(a_scale_MC, g).transpose(2, 0, 1)
    b_CGNT = bq_GNK.reshape(g, n, c, TILE).transpose(2, 0, 1, 3)

    def add_block(acc_GRN, inputs):
        a_GRT, s_GR, b_GNT, b_scale_GN = inputs
        partial_GRN = jnp.einsum("grt,gnt->grn", a_GRT, b_GNT, preferred_element_type=jnp.float32)
        return acc_GRN + partial_GRN * s_GR[:, :, None] * b_scale_GN[:, None, :], None

    out_GRN = sum_over_blocks(add_block, (a_CGRT, s_CGR, b_CGNT, b_scale_GCN.transpose(1, 0, 2)))
    return keep_live(out_GRN.reshape(-1, n)[:m], group_sizes_G).astype(out_dtype)


def balanced_grouped_wgrad(xq_DM, dyq_FM, group_sizes_G):
    """fp8_grouped_wgrad's contract for balanced groups: one batched fp8 dot over G equal row blocks."""
    return grouped_wgrad(xq_DM.T, dyq_FM.T, group_sizes_G, backend=BALANCED_STAND_IN)
