"""`moe.fp8_dispatch`: the dispatch's ragged all-to-all moves rows in e4m3 with their scales.

DeepSeek-V3 quantises the activations before the dispatch so that the all-to-all carries
FP8, and keeps the combine in bf16. Here each row is quantised per tile of its features
(the tiles the expert GEMM quantises by: 1x128 with float32 scales for tensorwise and
blockwise, 1x32 with power-of-two scales for mxfp8, sent as one int8 exponent each), the
values and the scales cross the expert axis in two ragged all-to-alls with the same offsets,
and the receiver dequantises them into the rows' dtype. Requantising those rows in the
expert GEMM gives back the same fp8 values, so the exchange adds no rounding of its own.

The backward pass sends the rows' gradient back in the rows' dtype (the transpose of the
exchange, a ragged all-to-all the other way): the quantisation is passed straight through,
as FP8 training does for every quantised operand.

What arrives is named `FP8_DISPATCH_ROWS` (values and scales), the collectives' output: a remat
policy that keeps collectives' outputs keeps the fp8 payload, about half the dequantised rows'
bytes, and dequantises it again in the backward pass (elementwise; no all-to-all again).

Bytes per row of D features: D (values) + 4 D / 128 (float32 scales) or D + D / 32
(exponents), against 2 D in bf16: 0.52 and 0.52 of it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.kernels.fp8_quant import E4M3, quantize
from maxmoe.parallel.collectives import ragged_all_to_all_impl
from maxmoe.parallel.names import FP8_DISPATCH_ROWS

TILE = {"tensorwise": 128, "blockwise": 128, "mxfp8": 32}


def payload_bytes_per_row(hidden: int, recipe: str) -> float:
    """Bytes one dispatched row of `hidden` features takes on the wire under `recipe`."""
    tiles = -(-hidden // TILE[recipe])
    return hidden + tiles * (1 if recipe == "mxfp8" else 4)


def fp8_ragged_exchange(
    rows_MD, input_offsets, send_sizes, output_offsets, recv_sizes, *, buffer_rows, axis_name, a2a_impl, recipe
):
    """The dispatch's ragged all-to-all of `rows_MD` with the rows in fp8 on the wire.

    Arguments as `jax.lax.ragged_all_to_all`'s (the output buffer is `buffer_rows` rows of
    zeros); returns the received rows dequantised into rows_MD's dtype.
    """
    return _exchange(
        rows_MD, input_offsets, send_sizes, output_offsets, recv_sizes, buffer_rows, axis_name, a2a_impl, recipe
    )


def _send(x, buffer_rows, offsets, axis_name, a2a_impl):
    ragged_all_to_all = ragged_all_to_all_impl(a2a_impl)
    output = jnp.zeros((buffer_rows,) + x.shape[1:], x.dtype)
    return ragged_all_to_all(x, output, *offsets, axis_name=axis_name)


def _receive(rows_MD, offsets, buffer_rows, axis_name, a2a_impl, recipe):
    """Quantise, send values and scales, name what arrived, dequantise."""
    tile = TILE[recipe]
    power_of_two = recipe == "mxfp8"
    q_MD, scale_MT = quantize(rows_MD, E4M3, (1, tile), power_of_two)
    if power_of_two:  # an e8m0 scale is its exponent: one byte
        scale_MT = (jnp.frexp(scale_MT)[1] - 1).astype(jnp.int8)
    q_MD = _send(q_MD, buffer_rows, offsets, axis_name, a2a_impl)
    # Named as its bytes: XLA:CPU (the dry run's compiler) would hold a saved fp8 stack as f16;
    # on a GPU the bitcasts cost nothing.
    bytes_MD = checkpoint_name(jax.lax.bitcast_convert_type(q_MD, jnp.uint8), FP8_DISPATCH_ROWS)
    q_MD = jax.lax.bitcast_convert_type(bytes_MD, q_MD.dtype)
    scale_MT = checkpoint_name(_send(scale_MT, buffer_rows, offsets, axis_name, a2a_impl), FP8_DISPATCH_ROWS)
    if power_of_two:
        scale_MT = jnp.ldexp(jnp.float32(1), scale_MT.astype(jnp.int32))
    d = rows_MD.shape[1]
    full_scale_MD = jnp.repeat(scale_MT, tile, axis=1)[:, :d]
    return (q_MD.astype(jnp.float32) * full_scale_MD).astype(rows_MD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _exchange(rows_MD, input_offsets, send_sizes, output_offsets, recv_sizes, buffer_rows, axis_name, a2a_impl, recipe):
    offsets = (input_offsets, send_sizes, output_offsets, recv_sizes)
    return _receive(rows_MD, offsets, buffer_rows, axis_name, a2a_impl, recipe)


def _exchange_fwd(
    rows_MD, input_offsets, send_sizes, output_offsets, recv_sizes, buffer_rows, axis_name, a2a_impl, recipe
):
    # _receive, not _exchange: its names must sit in the differentiated program, where remat sees them.
    offsets = (input_offsets, send_sizes, output_offsets, recv_sizes)
    out = _receive(rows_MD, offsets, buffer_rows, axis_name, a2a_impl, recipe)
    return out, (rows_MD, *offsets)


def _exchange_bwd(buffer_rows, axis_name, a2a_impl, recipe, saved, received_grad_MD):
    rows_MD, *offsets = saved
    _, transpose = jax.vjp(lambda x: _send(x, buffer_rows, offsets, axis_name, a2a_impl), rows_MD)
    (rows_grad_MD,) = transpose(received_grad_MD.astype(rows_MD.dtype))
    return (rows_grad_MD, None, None, None, None)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
