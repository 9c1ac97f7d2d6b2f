"""`moe.fp8_dispatch`: the dispatch's ragged all-to-all moves rows in e4m3 with their scales.

    received_MD = fp8_ragged_exchange(rows_MD, input_offsets, send_sizes, output_offsets,
                                      recv_sizes, buffer_rows=M, axis_name=..., a2a_impl=..., recipe=...)

Arguments as `jax.lax.ragged_all_to_all`'s. Each row is quantised per tile of its features (the
tiles the expert GEMM quantises by: `TILE`), values and scales cross the expert axis in two
ragged all-to-alls with the same offsets, and the receiver dequantises into the rows' dtype, so
requantising in the expert GEMM gives the same fp8 values. The backward pass sends the gradient
back in the rows' dtype (quantisation passed straight through). What arrives is named
`FP8_DISPATCH_ROWS` for remat policies; `payload_bytes_per_row` gives the bytes on the wire
(0.52 of bf16's).

docs/KERNELS.md, "FP8 GEMMs" ("FP8 dispatch") has the reasoning and the byte counts.
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
