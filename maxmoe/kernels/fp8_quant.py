"""FP8 quantisation: values in e4m3 / e5m2 with one scale per block of a 2-D array.

    q_RC, scale = quantize(x_RC, E4M3, block=(1, 128))      x ~ dequantize(q_RC, scale, block)

A block is (rows, cols) of the array; a dimension of 0 means the whole dimension (per-tensor
scaling is block (0, 0)). Float32 scales put a block's largest magnitude on the format's largest
finite value; `power_of_two=True` gives e8m0 scales, the smallest power of two that keeps the
block in range (nothing saturates). A block of zeros gets scale 1; rounding is to nearest even,
after clipping to the finite range; blocks at ragged edges are the partial blocks that remain,
scaled from their own elements. `segment_quantize` scales per (segment of rows, column).

docs/KERNELS.md, "FP8 GEMMs" ("Quantisation") has each recipe's blocks and the scaling rules.
Legend: R rows, C columns, r/c block rows/columns (the scale grid is ceil(R/r) x ceil(C/c)).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Scale-grid shape of a [R, C] array quantised in `block` (0 = whole dimension)."""
    return tuple(1 if b == 0 else math.ceil(n / b) for n, b in zip(shape, block))


def _block_size(n: int, b: int) -> int:
    return n if b == 0 else b


def _blocked(x_RC, block):
    """x padded with zeros to whole blocks and viewed as [gr, r, gc, c]."""
    rows, cols = x_RC.shape
    br, bc = _block_size(rows, block[0]), _block_size(cols, block[1])
    gr, gc = scale_grid(x_RC.shape, block)
    padded = jnp.pad(x_RC, ((0, gr * br - rows), (0, gc * bc - cols)))
    return padded.reshape(gr, br, gc, bc)


def quantize(x_RC, dtype=E4M3, block=(0, 0), power_of_two: bool = False):
    """fp8 values and float32 scales of a 2-D array, one scale per block.

    Args:
        x_RC: [R, C] array (any float dtype; amax and division in float32).
        dtype: E4M3 or E5M2.
        block: (rows, cols) of one block; 0 means the whole dimension.
        power_of_two: e8m0-style scales (MX); else amax / max.

    Returns:
        q_RC [R, C] in `dtype` and scales [ceil(R/r), ceil(C/c)] float32, x ~ q * scale.
    """
    rows, cols = x_RC.shape
    x_gr_r_gc_c = _blocked(x_RC.astype(jnp.float32), block)
    amax = jnp.max(jnp.abs(x_gr_r_gc_c), axis=(1, 3))
    top = FORMAT_MAX[dtype]
    # amax times a float32 1 / max, not amax / max: XLA may rewrite a division by a constant into
    # that product in some fusions and not others; written out, the scales are reproducible.
    inverse_top = jnp.float32(1.0 / top)
    if power_of_two:
        # ceil(log2(ratio)) from the exponent bits (a float log2 can miss exact powers of two):
        # ratio = mantissa * 2**exponent with mantissa in [0.5, 1).
        mantissa, exponent = jnp.frexp(amax * inverse_top)
        scale = jnp.ldexp(jnp.float32(1), jnp.where(mantissa == 0.5, exponent - 1, exponent))
    else:
        scale = amax * inverse_top
    scale = jnp.where(amax > 0, scale, 1.0)
    scaled = x_gr_r_gc_c / scale[:, None, :, None]
    q = jnp.clip(scaled, -top, top).astype(dtype)
    gr, br, gc, bc = q.shape
    return q.reshape(gr * br, gc * bc)[:rows, :cols], scale


def expand_scales(scale, shape: tuple[int, int], block: tuple[int, int]):
    """The scale grid repeated to one scale per element of a [R, C] array."""
    rows, cols = shape
    br, bc = _block_size(rows, block[0]), _block_size(cols, block[1])
    return jnp.repeat(jnp.repeat(scale, br, axis=0), bc, axis=1)[:rows, :cols]


def dequantize(q_RC, scale, block=(0, 0), dtype=jnp.float32):
    """q * scale per block, in `dtype` (float32 unless the product is exact in something narrower)."""
    full = expand_scales(scale, q_RC.shape, block)
    return (q_RC.astype(jnp.float32) * full).astype(dtype)


def round_trip(x_RC, dtype=E4M3, block=(0, 0), power_of_two: bool = False):
    """x rounded to what fp8 with these scales can hold (float32): the emulation of a quantised operand."""
    q, scale = quantize(x_RC, dtype, block, power_of_two)
    return dequantize(q, scale, block)


def relative_step(dtype) -> float:
    """Half the spacing between fp8 values relative to their size: 2**-(mantissa bits + 1).

    Round-to-nearest moves a normal value by at most this fraction (e4m3: 1/16, e5m2: 1/8).
    """
    return 2.0 ** -(jnp.finfo(dtype).nmant + 1)


def segment_quantize(x_MC, segment_ids_M, num_segments: int, dtype=E4M3):
    """fp8 values and float32 scales with one scale per (segment, column): tiles along rows
    that follow the segments (groups of rows), e.g. the rows each expert received.

    Rows whose segment id is out of range get scale 1 and are left to the caller to mask.

    Returns:
        q_MC in `dtype` and scales [num_segments, C] float32.
    """
    xf = x_MC.astype(jnp.float32)
    amax = jax.ops.segment_max(jnp.abs(xf), segment_ids_M, num_segments, indices_are_sorted=True)
    top = FORMAT_MAX[dtype]
    scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / top), 1.0)
    row_scale = jnp.take(scale, jnp.clip(segment_ids_M, 0, num_segments - 1), axis=0)
    row_scale = jnp.where((segment_ids_M < num_segments)[:, None], row_scale, 1.0)
    q = jnp.clip(xf / row_scale, -top, top).astype(dtype)
    return q, scale
