"""FP8 GEMMs with their own VJP: dense projections and the grouped expert GEMM (`model.fp8`).

    y = fp8_matmul(x, w_KN, recipe, kernels)                                a dense projection
    y_MF = fp8_grouped_matmul(x_MD, w_GDF, group_sizes_G, recipe, backend)  rows sorted by group
    y_MD = fp8_grouped_swiglu(x_MD, group_sizes_G, w_gate_GDF, w_up_GDF, w_down_GFD, recipe, backend)

Every GEMM of a layer (forward y = x @ w, dx = dy @ w^T, dw = x^T @ dy) quantises both operands
along its own contraction axis (`maxmoe.kernels.fp8_quant`), multiplies the fp8 values with
float32 accumulation and rescales. Recipes (`RECIPES`): tensorwise, blockwise (DeepSeek-V3's:
partial sums promoted to float32 every 128 of the contraction) and mxfp8. Master weights stay
float32 (callers cast), operands arrive in the compute dtype, gradients leave in the operands'
dtypes; inputs are saved for the backward pass unquantised.

docs/KERNELS.md, "FP8 GEMMs" has each recipe's GEMM programs and the grouped backends' paths.
Legend: M rows, K contraction, N output columns, D embed, F expert_mlp, G groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.kernels.attention import triton_lowers_here
from maxmoe.kernels.fp8_grouped import (
    DENSE_GEMM_NAME,
    balanced_blockwise_gemm,
    balanced_grouped_wgrad,
    blockwise_grouped_gemm,
    fp8_grouped_wgrad,
)
from maxmoe.kernels.fp8_quant import E4M3, E5M2, expand_scales, quantize, round_trip, segment_quantize
from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN, WGRAD_DIMS, grouped_matmul, grouped_wgrad
from maxmoe.kernels.varying import sum_over_blocks, vary_alike, vary_as
from maxmoe.parallel.names import EXPERT_GATE_UP, FP8_DENSE_OUT, GROUPED_GEMM_SCOPE

RECIPES = ("tensorwise", "blockwise", "mxfp8")
TILE = 128  # DeepSeek-V3's tile and block edge
MX_BLOCK = 32  # OCP MX block
# Grouped backends that are kernels (jax's Mosaic GPU ragged dot, tokamax; in the dry run their
# balanced stand-in): they take bf16 only, so tensorwise and mxfp8 feed them the fp8 values as
# bf16 (exact) rather than XLA's ragged_dot, which on GPU costs G x the FLOPs (and a masked
# [G, M, D] copy of the rows for a weight gradient); with them blockwise runs
# maxmoe.kernels.fp8_grouped (the dry run: its stand-ins).
KERNEL_BACKENDS = ("mosaic_gpu", "tokamax", BALANCED_STAND_IN)


class BlockwiseKernels(NamedTuple):
    """The two GEMMs blockwise runs on instead of XLA's program (maxmoe.kernels.fp8_grouped's contracts)."""

    gemm: Callable  # blockwise_grouped_gemm
    wgrad: Callable  # fp8_grouped_wgrad
    dense: Callable | None = None  # a dense projection's GEMM (one group); None: `gemm`


# Per recipe and GEMM: (lhs dtype, lhs block, rhs dtype, rhs block); the lhs contraction is its
# columns, the rhs contraction its rows. 0 = the whole dimension.
GEMMS = {
    "tensorwise": {
        "forward": (E4M3, (0, 0), E4M3, (0, 0)),
        "dgrad": (E5M2, (0, 0), E4M3, (0, 0)),
        "wgrad": (E4M3, (0, 0), E5M2, (0, 0)),
    },
    "blockwise": {
        "forward": (E4M3, (1, TILE), E4M3, (TILE, TILE)),
        "dgrad": (E4M3, (1, TILE), E4M3, (TILE, TILE)),
        "wgrad": (E4M3, (1, TILE), E4M3, (TILE, 1)),
    },
    "mxfp8": dict.fromkeys(("forward", "dgrad", "wgrad"), (E4M3, (1, MX_BLOCK), E4M3, (MX_BLOCK, 1))),
}


def scaled_dot(a_MK, b_KN, recipe: str, gemm: str, kernels: BlockwiseKernels | None = None, out_dtype=jnp.float32):
    """a @ b through `recipe`'s fp8 `gemm` ('forward', 'dgrad' or 'wgrad'), accumulated in float32
    and returned in `out_dtype` (one rounding).

    kernels: blockwise through their block-scaled GEMM (one group): on one device's shard only
    (maxmoe.kernels.fp8_dense), where XLA need not partition the kernel call.
    """
    if recipe == "mxfp8":
        return _mx_dot(a_MK, b_KN, out_dtype)
    return _scaled_f32(a_MK, b_KN, recipe, gemm, kernels).astype(out_dtype)


def _scaled_f32(a_MK, b_KN, recipe: str, gemm: str, kernels: BlockwiseKernels | None):
    a_dtype, a_block, b_dtype, b_block = GEMMS[recipe][gemm]
    aq, a_scale = quantize(a_MK, a_dtype, a_block)
    bq, b_scale = quantize(b_KN, b_dtype, b_block)
    m, k = a_MK.shape
    n = b_KN.shape[1]
    a_rows = expand_scales(a_scale, (m, a_scale.shape[1]), (a_block[0], 1))  # [M, Kb]
    b_cols = expand_scales(b_scale, (b_scale.shape[0], n), (1, b_block[1]))  # [Kb, N]
    if a_block[1] == 0:
        out = jax.lax.dot(aq, bq, preferred_element_type=jnp.float32)
        return out * a_rows * b_cols
    if kernels:
        return _kernel_gemm(aq, a_rows, bq, b_cols, kernels)
    blocks = a_scale.shape[1]
    pad = blocks * TILE - k
    aq_MBT = jnp.pad(aq, ((0, 0), (0, pad))).reshape(m, blocks, TILE)
    bq_BTN = jnp.pad(bq, ((0, pad), (0, 0))).reshape(blocks, TILE, n)
    return jax.lax.platform_dependent(aq_MBT, bq_BTN, a_rows, b_cols, cuda=_blocks_scanned, default=_blocks_batched)


def _kernel_gemm(aq_MK, a_rows_MB, bq_KN, b_cols_BN, kernels: BlockwiseKernels):
    """The block-scaled kernel GEMM (one group) of fp8 operands and their per-row / per-column
    scales for each 128 of the contraction; K padded to whole tiles."""
    pad = a_rows_MB.shape[1] * TILE - aq_MK.shape[1]
    aq_MK = jnp.pad(aq_MK, ((0, 0), (0, pad)))
    bq_1NK = jnp.pad(bq_KN, ((0, pad), (0, 0))).T[None]
    gemm = kernels.dense or kernels.gemm
    return gemm(aq_MK, a_rows_MB, bq_1NK, b_cols_BN[None], jnp.full((1,), aq_MK.shape[0], jnp.int32))


def blockwise_dot_quantized(a_MK, bq_KN, b_scale, kernels: BlockwiseKernels):
    """a @ b in float32 for b given as e4m3 values with one scale per 128x128 block (quantize's
    grid): a quantised per 1x128 tile, the product through the kernels' block-scaled GEMM.
    Equal to scaled_dot(a, b, "blockwise", "forward" or "dgrad", kernels) when (bq, b_scale) =
    quantize(b, E4M3, (128, 128))."""
    aq, a_rows = quantize(a_MK, E4M3, (1, TILE))  # a scale per row and 128-tile: [M, Kb]
    b_cols = expand_scales(b_scale, (b_scale.shape[0], bq_KN.shape[1]), (1, TILE))
    return _kernel_gemm(aq, a_rows, bq_KN, b_cols, kernels)


def _blocks_batched(aq_MBT, bq_BTN, a_rows_MB, b_cols_BN):
    """sum_b a_rows[:, b] (aq[:, b] @ bq[b]) b_cols[b]: one batched dot, [B, M, N] partials."""
    partial_BMN = jax.lax.dot_general(aq_MBT, bq_BTN, (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)
    return jnp.einsum("bmn,mb,bn->mn", partial_BMN, a_rows_MB, b_cols_BN)


def _blocks_scanned(aq_MBT, bq_BTN, a_rows_MB, b_cols_BN):
    """The same sum, one block at a time: an [M, N] float32 sum instead of B partial products
    (at 671B, an attention output projection's 128 blocks of [4096, 7168] would be 15 GB)."""

    def add_block(acc_MN, inputs):
        aq_MT, bq_TN, a_rows_M, b_cols_N = inputs
        partial_MN = jax.lax.dot(aq_MT, bq_TN, preferred_element_type=jnp.float32)
        return acc_MN + partial_MN * a_rows_M[:, None] * b_cols_N[None, :], None

    return sum_over_blocks(add_block, (aq_MBT.transpose(1, 0, 2), bq_BTN, a_rows_MB.T, b_cols_BN))


def _mx_dot(a_MK, b_KN, out_dtype):
    """MXFP8 a @ b in `out_dtype`: jax.nn.scaled_matmul (cuDNN) on CUDA, the exact dequantised
    product elsewhere.

    The GEMM writes `out_dtype` itself, so that where the partitioner sums it over shards
    (a weight gradient over the batch, a row-parallel output) the sum moves that dtype, as
    `none`'s bf16 dots do, not float32. The emulation rounds the dequantised values to
    `out_dtype` (exact: an e4m3 value times a power of two), so an FSDP weight it gathers
    holds values that wide, as the dry run counts it (the GPU's custom partitioning of
    scaled_matmul gathers the e4m3 values and e8m0 scales, about half that), and multiplies
    in float32.
    """
    k = a_MK.shape[1]
    pad = -k % MX_BLOCK  # scaled_matmul infers the block from K / scales: K must be whole blocks
    a_MK = jnp.pad(a_MK, ((0, 0), (0, pad)))
    b_KN = jnp.pad(b_KN, ((0, pad), (0, 0)))
    aq, a_scale = quantize(a_MK, E4M3, (1, MX_BLOCK), power_of_two=True)
    bq, b_scale = quantize(b_KN, E4M3, (MX_BLOCK, 1), power_of_two=True)

    def native(aq, a_scale, bq, b_scale):
        e8m0 = jnp.float8_e8m0fnu
        a_scale, b_scale = a_scale.astype(e8m0)[None], b_scale.T.astype(e8m0)[None]
        out = jax.nn.scaled_matmul(aq[None], bq.T[None], a_scale, b_scale, preferred_element_type=out_dtype)[0]
        # Inside shard_map the call's output carries no mark: it varies as its operands do.
        return vary_as(out, aq, bq)

    def dequantize(q, scale):  # exact in out_dtype, multiplied in float32 (as XLA:CPU would anyway)
        return (q.astype(out_dtype) * scale.astype(out_dtype)).astype(jnp.float32)

    def emulated(aq, a_scale, bq, b_scale):
        a = dequantize(aq, jnp.repeat(a_scale, MX_BLOCK, axis=1))
        b = dequantize(bq, jnp.repeat(b_scale, MX_BLOCK, axis=0))
        return jax.lax.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=out_dtype)

    return jax.lax.platform_dependent(aq, a_scale, bq, b_scale, cuda=native, default=emulated)


def fp8_matmul(x, w_KN, recipe: str, kernels: BlockwiseKernels | None = None):
    """x [..., K] @ w [K, N] with every GEMM of forward and backward in fp8 (`recipe` in RECIPES).

    Returns [..., N] in x's dtype, named FP8_DENSE_OUT for the remat policies (what
    `dots_with_no_batch_dims_saveable` is to a bf16 dot: the GEMM hides in a custom VJP, and
    under mxfp8 in a platform switch, where no dot policy sees it); the gradients come back in
    x's and w's dtypes. kernels (`blockwise_kernels`): blockwise's three GEMMs through them, for
    a call on one device's shards.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; expected one of {RECIPES}")
    lead = x.shape[:-1]
    x, w_KN = vary_alike(x, w_KN)
    y_MN = _dense(x.reshape(-1, x.shape[-1]), w_KN, recipe, kernels if recipe == "blockwise" else None)
    return checkpoint_name(y_MN, FP8_DENSE_OUT).reshape(*lead, w_KN.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x_MK, w_KN, recipe, kernels):
    return scaled_dot(x_MK, w_KN, recipe, "forward", kernels, x_MK.dtype)


def _dense_fwd(x_MK, w_KN, recipe, kernels):
    return _dense(x_MK, w_KN, recipe, kernels), (x_MK, w_KN)


def _dense_bwd(recipe, kernels, saved, dy_MN):
    x_MK, w_KN = saved
    dx_MK = scaled_dot(dy_MN, w_KN.T, recipe, "dgrad", kernels, x_MK.dtype)
    dw_KN = scaled_dot(x_MK.T, dy_MN, recipe, "wgrad", kernels, w_KN.dtype)
    return dx_MK, dw_KN


_dense.defvjp(_dense_fwd, _dense_bwd)


# ----------------------------------------------------------------------------------
# Grouped GEMM: rows sorted by group, each times its group's weight.


def row_groups(group_sizes_G, rows: int):
    """Group of each row; rows past sum(group_sizes) get G (no group)."""
    return jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(rows), side="right").astype(jnp.int32)


def blockwise_kernels(backend: str) -> BlockwiseKernels | None:
    """The GEMMs blockwise runs on beside the grouped `backend`, or None for XLA's program:
    maxmoe.kernels.fp8_grouped's Triton kernels beside a GPU kernel backend where
    Triton lowers (not when lowering for CUDA without a GPU under jax >= 0.11), their stand-ins
    beside the dry run's balanced stand-in."""
    if backend == BALANCED_STAND_IN:
        return BlockwiseKernels(balanced_blockwise_gemm, balanced_grouped_wgrad)
    if backend in KERNEL_BACKENDS and not triton_lowers_here():
        dense = functools.partial(blockwise_grouped_gemm, name=DENSE_GEMM_NAME)
        return BlockwiseKernels(blockwise_grouped_gemm, fp8_grouped_wgrad, dense)
    return None


def _grouped_scaled(a_MK, b_GKN, group_sizes_G, recipe: str, gemm: str, backend: str = "ragged_dot"):
    """Row m of a times b[group of m] in float32, both operands fp8 along K."""
    a_dtype, a_block, b_dtype, b_block = GEMMS[recipe][gemm]
    g, k, n = b_GKN.shape
    m = a_MK.shape[0]
    aq, a_scale = quantize(a_MK, a_dtype, a_block)
    if recipe == "tensorwise":  # one scale for all the groups' weights together
        bq_GKN, b_scale = quantize(b_GKN.reshape(g * k, n), b_dtype, b_block)
        bq_GKN = bq_GKN.reshape(g, k, n)
        if backend in KERNEL_BACKENDS:
            # Every e4m3 / e5m2 value is a bfloat16 value and the scales factor out of the sum:
            # the bf16 kernel computes the fp8 GEMM's exact products, only not at fp8 speed.
            out = grouped_matmul(aq.astype(jnp.bfloat16), bq_GKN.astype(jnp.bfloat16), group_sizes_G, backend=backend)
            out = out.astype(jnp.float32)
        else:
            out = jax.lax.ragged_dot(aq, bq_GKN, group_sizes_G, preferred_element_type=jnp.float32)
        return out * a_scale * b_scale
    bq_GKN, b_scale = jax.vmap(lambda b: quantize(b, b_dtype, b_block))(b_GKN)
    blocks = a_scale.shape[1]
    pad = blocks * TILE - k
    b_cols_GBN = jax.vmap(lambda s: expand_scales(s, (blocks, n), (1, b_block[1])))(b_scale)
    kernels = blockwise_kernels(backend)
    if kernels:  # the block-scaled kernel, contraction last for both operands
        aq_MK = jnp.pad(aq, ((0, 0), (0, pad)))
        bq_GNK = jnp.pad(bq_GKN, ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1)
        return kernels.gemm(aq_MK, a_scale, bq_GNK, b_cols_GBN, group_sizes_G)
    groups_M = jnp.minimum(row_groups(group_sizes_G, m), g - 1)  # rows past the groups come out zero anyway
    aq_BMT = jnp.pad(aq, ((0, 0), (0, pad))).reshape(m, blocks, TILE).transpose(1, 0, 2)
    bq_BGTN = jnp.pad(bq_GKN, ((0, 0), (0, pad), (0, 0))).reshape(g, blocks, TILE, n).transpose(1, 0, 2, 3)

    def add_block(acc_MN, inputs):
        aq_MT, bq_GTN, a_scale_M, b_cols_GN = inputs
        partial_MN = jax.lax.ragged_dot(aq_MT, bq_GTN, group_sizes_G, preferred_element_type=jnp.float32)
        return acc_MN + partial_MN * a_scale_M[:, None] * b_cols_GN[groups_M], None

    return sum_over_blocks(add_block, (aq_BMT, bq_BGTN, a_scale.T, b_cols_GBN.transpose(1, 0, 2)))


def _exact_wgrad(xq_MD, dyq_MF, group_sizes_G, backend: str, precision=None):
    """grouped_wgrad of values exact in bfloat16 (fp8, or MXFP8-rounded), float32: a kernel
    backend's own weight gradient on them as bf16, else XLA's ragged_dot_general."""
    if backend in KERNEL_BACKENDS:
        bf16 = jnp.bfloat16
        return grouped_wgrad(xq_MD.astype(bf16), dyq_MF.astype(bf16), group_sizes_G, backend=backend)
    return jax.lax.ragged_dot_general(
        xq_MD, dyq_MF, group_sizes_G, WGRAD_DIMS, precision=precision, preferred_element_type=jnp.float32
    )


def _grouped_wgrad(x_MD, dy_MF, group_sizes_G, recipe: str, backend: str = "ragged_dot"):
    """dw[g] = x[rows of g]^T @ dy[rows of g] in float32, operands fp8 along the rows."""
    g = group_sizes_G.shape[0]
    if recipe == "tensorwise":
        xq, x_scale = quantize(x_MD, E4M3)
        dyq, dy_scale = quantize(dy_MF, E5M2)
        return _exact_wgrad(xq, dyq, group_sizes_G, backend) * x_scale * dy_scale
    groups_M = row_groups(group_sizes_G, x_MD.shape[0])
    xq, x_scale_GD = segment_quantize(x_MD, groups_M, g)
    dyq, dy_scale_GF = segment_quantize(dy_MF, groups_M, g)
    kernels = blockwise_kernels(backend)
    if kernels:  # the rows (the contraction) last in both operands
        out = kernels.wgrad(xq.T, dyq.T, group_sizes_G)
    else:
        out = jax.lax.ragged_dot_general(xq, dyq, group_sizes_G, WGRAD_DIMS, preferred_element_type=jnp.float32)
    return out * x_scale_GD[:, :, None] * dy_scale_GF[:, None, :]


def fp8_grouped_matmul(x_MD, w_GDF, group_sizes_G, recipe: str, backend: str = "ragged_dot"):
    """`maxmoe.kernels.grouped_matmul.grouped_matmul` with its GEMMs in fp8 (`recipe` in RECIPES).

    `backend` runs mxfp8 (on the exactly rounded bf16/f32 values) and, when it is a kernel
    (KERNEL_BACKENDS), tensorwise's GEMMs and mxfp8's weight gradient on the fp8 values as bf16
    and blockwise's on `blockwise_kernels`; otherwise jax.lax.ragged_dot multiplies fp8
    operands. Rows past sum(group_sizes) give zeros.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; expected one of {RECIPES}")
    x_MD, w_GDF, group_sizes_G = vary_alike(x_MD, w_GDF, group_sizes_G)
    with jax.named_scope(GROUPED_GEMM_SCOPE):  # a profile's grouped-GEMM class (maxmoe.analysis.trace_breakdown)
        return _grouped(x_MD, w_GDF, group_sizes_G, recipe, backend)


def _mx_round(x_RC, block):
    """MXFP8-rounded values in x's dtype: exact, since the scales are powers of two."""
    return round_trip(x_RC, E4M3, block, power_of_two=True).astype(x_RC.dtype)


def _mx_round_groups(w_GKN):
    return jax.vmap(lambda w: _mx_round(w, (MX_BLOCK, 1)))(w_GKN)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x_MD, w_GDF, group_sizes_G, recipe, backend):
    if recipe == "mxfp8":
        x = _mx_round(x_MD, (1, MX_BLOCK))
        return grouped_matmul(x, _mx_round_groups(w_GDF), group_sizes_G, backend=backend)
    return _grouped_scaled(x_MD, w_GDF, group_sizes_G, recipe, "forward", backend).astype(x_MD.dtype)


def _grouped_fwd(x_MD, w_GDF, group_sizes_G, recipe, backend):
    return _grouped(x_MD, w_GDF, group_sizes_G, recipe, backend), (x_MD, w_GDF, group_sizes_G)


def _grouped_bwd(recipe, backend, saved, dy_MF):
    x_MD, w_GDF, group_sizes_G = saved
    w_GFD = w_GDF.transpose(0, 2, 1)
    if recipe == "mxfp8":
        dy = _mx_round(dy_MF, (1, MX_BLOCK))
        dx_MD = grouped_matmul(dy, _mx_round_groups(w_GFD), group_sizes_G, backend=backend)
        x_rows = _mx_round(x_MD, (MX_BLOCK, 1)).astype(jnp.float32)
        dy_rows = _mx_round(dy_MF, (MX_BLOCK, 1)).astype(jnp.float32)
        dw_GDF = _exact_wgrad(x_rows, dy_rows, group_sizes_G, backend, jax.lax.Precision.HIGHEST)
    else:
        dx_MD = _grouped_scaled(dy_MF, w_GFD, group_sizes_G, recipe, "dgrad", backend)
        dw_GDF = _grouped_wgrad(x_MD, dy_MF, group_sizes_G, recipe, backend)
    return dx_MD.astype(x_MD.dtype), dw_GDF.astype(w_GDF.dtype), None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def fp8_grouped_swiglu(x_MD, group_sizes_G, w_gate_GDF, w_up_GDF, w_down_GFD, recipe: str, backend: str):
    """`maxmoe.kernels.grouped_matmul.grouped_swiglu` with its two grouped GEMMs in fp8 (the gate/up
    output carries the same name for the remat policies)."""
    f = w_gate_GDF.shape[2]
    w_gate_up_GD2F = jnp.concatenate([w_gate_GDF, w_up_GDF], axis=2)
    gate_up_M2F = checkpoint_name(
        fp8_grouped_matmul(x_MD, w_gate_up_GD2F, group_sizes_G, recipe, backend), EXPERT_GATE_UP
    )
    hidden_MF = jax.nn.silu(gate_up_M2F[:, :f]) * gate_up_M2F[:, f:]
    return fp8_grouped_matmul(hidden_MF, w_down_GFD, group_sizes_G, recipe, backend)
