"""Ragged all-to-all with an emulation for backends that lack the collective.

`jax.lax.ragged_all_to_all` lowers to a native collective on GPU and TPU, but XLA:CPU
has none, so without an emulation the CPU test suite could not run the dispatch path.
The emulation here is built only from `jax.lax.all_to_all` plus local gathers and
selects, has the same semantics (including which rows of `output` survive), and is
differentiable by ordinary autodiff: the transpose of gather + all_to_all + select is
select + reverse all_to_all + scatter-add, which is the reverse ragged all-to-all.

A dispatch plan names its implementation (`RAGGED_A2A_IMPLS`): "native", "emulate", or
"balanced_stand_in", which computes nothing meaningful but has the native collective's
buffers and balanced-routing bytes, so a CPU compile (the sweep's dry run) can describe
the GPU program's memory and traffic.

Legend: K slices (a multiple of the axis size), M rows of `output`, N rows of `operand`.
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.kernels.varying import vary_as
from maxmoe.parallel.names import EMULATED_OFFSETS

RAGGED_A2A_IMPLS = ("native", "emulate", "balanced_stand_in")

# Platform names as reported by `jax.default_backend()` / `Device.platform`;
# "gpu" is what jax reports for a CUDA or ROCm backend.
_NATIVE_PLATFORMS = ("cuda", "rocm", "gpu", "tpu")
_EMULATED_PLATFORMS = ("cpu",)

# The emulation exchanges the output offsets with an all_to_all of its own, and its backward
# pass needs them again (to mask what it received). Saving this name
# (maxmoe.parallel.dispatch_shard.COMM_NAMES does) keeps the emulated program, like the
# native one, from running that exchange again in the backward pass; it costs K int32.


def has_native_ragged_all_to_all(platform: str) -> bool:
    """Whether XLA on `platform` implements ragged all-to-all as a collective.

    Args:
        platform: a jax platform name: "cpu", "cuda", "rocm", "gpu" or "tpu".

    Returns:
        True for GPU and TPU platforms, False for "cpu" (which needs `emulate=True`).

    Raises:
        ValueError: for any other platform name.
    """
    name = platform.lower()
    if name in _NATIVE_PLATFORMS:
        return True
    if name in _EMULATED_PLATFORMS:
        return False
    allowed = ", ".join(repr(p) for p in _EMULATED_PLATFORMS + _NATIVE_PLATFORMS)
    raise ValueError(f"unknown platform {platform!r}; expected one of {allowed}")


def ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, emulate: bool
):
    """Ragged all-to-all over `axis_name`, natively or emulated with dense collectives.

    Semantics are exactly those of `jax.lax.ragged_all_to_all`. Call it inside
    `shard_map`; every argument is this shard's local value. With P the size of
    `axis_name` and K = len(input_offsets):

    * slice i of this shard's `operand`, rows
      `[input_offsets[i], input_offsets[i] + send_sizes[i])`, goes to peer i // (K/P);
    * it is written on that peer starting at row `output_offsets[i]`: an offset into
      the *receiver's* output buffer, chosen by the sender;
    * on the receiving side, slice j came from peer j // (K/P), is `recv_sizes[j]`
      rows long and lands at row `all_to_all(output_offsets)[j]`;
    * rows of `output` that nothing is written to keep their values.

    `axis_name` may be one axis of a multi-axis mesh; shards that differ in the other
    mesh axes do not communicate.

    Cost of the emulation: each of the K slices is padded to a full block of M rows
    (M = `output.shape[0]`) laid out at its final position, so every shard builds,
    sends and receives a dense [K, M, ...] buffer, and the backward pass moves the
    same amount again. That is K times the size of `output`, whereas the native
    collective moves only the rows actually sent. The emulation is meant for CPU
    tests and debugging, where the axis is small.

    Args:
        operand: [N, ...] rows to send, cut into slices by `input_offsets` and
            `send_sizes`.
        output: [M, ...] buffer (same dtype and trailing dims as `operand`) that the
            received rows are written into.
        input_offsets: [K] int, start row in `operand` of each slice sent.
        send_sizes: [K] int, rows in each slice sent.
        output_offsets: [K] int, start row of each sent slice in its receiver's
            `output`.
        recv_sizes: [K] int, rows in each slice received; must equal
            `all_to_all(send_sizes)`, as for the real collective.
        axis_name: the mesh axis to communicate over.
        emulate: False calls `jax.lax.ragged_all_to_all` (GPU/TPU); True uses the
            dense emulation, which runs on any backend including CPU.

    Returns:
        [M, ...] `output` with the received slices written in.
    """
    if not emulate:
        # jax types the result as varying over the mesh axes `output` varies over; received rows
        # vary as the rows sent do (and over `axis_name`): else the transpose of the rows' use
        # with varying values sums their cotangents over the devices.
        output = vary_as(output, operand, axes=axis_name)
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    return _emulated_ragged_all_to_all(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
    )


def _row_mask_KM(starts_K, sizes_K, num_rows):
    """[K, M] bool: row m lies in [starts[k], starts[k] + sizes[k])."""
    rows_M = jnp.arange(num_rows, dtype=starts_K.dtype)
    after_start = rows_M[None, :] >= starts_K[:, None]
    before_end = rows_M[None, :] < starts_K[:, None] + sizes_K[:, None]
    return after_start & before_end


def _with_row_dims(mask, rows):
    """Append unit dims to a row `mask` so it broadcasts over the dims of each row."""
    return mask.reshape(mask.shape + (1,) * (rows.ndim - 1))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    num_slices = input_offsets.shape[0]
    num_rows = output.shape[0]
    axis_size = jax.lax.axis_size(axis_name)
    if num_slices % axis_size:
        raise ValueError(
            f"ragged_all_to_all: {num_slices} slices is not a multiple of the size {axis_size} of axis {axis_name!r}"
        )
    if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        raise ValueError(
            f"ragged_all_to_all: operand {operand.dtype}{list(operand.shape)} and output "
            f"{output.dtype}{list(output.shape)} must share dtype and trailing dims"
        )
    input_offsets, send_sizes, output_offsets, recv_sizes = (
        a.astype(jnp.int32) for a in (input_offsets, send_sizes, output_offsets, recv_sizes)
    )
    rows_M = jnp.arange(num_rows, dtype=jnp.int32)

    # Sender: lay each slice out where its receiver wants it, so the receiver only
    # selects rows and never computes positions. Inside the sent range, row m of
    # block k is operand[input_offsets[k] + m - output_offsets[k]]; elsewhere 0.
    source_row_KM = input_offsets[:, None] + rows_M[None, :] - output_offsets[:, None]
    # Clipping keeps the gather in bounds; clipped rows are outside the sent range,
    # masked to zero below, so they also get no gradient.
    source_row_KM = jnp.clip(source_row_KM, 0, operand.shape[0] - 1)
    sent_KM = _row_mask_KM(output_offsets, send_sizes, num_rows)
    blocks_KM = jnp.where(_with_row_dims(sent_KM, operand), operand[source_row_KM], jnp.zeros((), operand.dtype))

    # A tiled all_to_all sends blocks [d*K/P, (d+1)*K/P) to peer d and concatenates
    # what arrives in sender order: the slice -> peer mapping of the real collective.
    received_KM = jax.lax.all_to_all(blocks_KM, axis_name, 0, 0, tiled=True)
    recv_offsets_K = checkpoint_name(jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True), EMULATED_OFFSETS)

    # Receiver: the real collective writes received slices in order, so where ranges
    # overlap the last one wins; taking the highest writing slice per row matches.
    written_KM = _row_mask_KM(recv_offsets_K, recv_sizes, num_rows)
    slice_ids_K = jnp.arange(num_slices, dtype=jnp.int32)
    writer_M = jnp.max(jnp.where(written_KM, slice_ids_K[:, None], -1), axis=0)
    received_M = received_KM[jnp.clip(writer_M, 0, num_slices - 1), rows_M]
    return jnp.where(_with_row_dims(writer_M >= 0, output), received_M, output)


def balanced_stand_in(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """Stand-in with the native collective's shapes and balanced-routing bytes (dry runs only).

    Moves min(N, M) rows with one dense all_to_all ((P-1)/P of them leave the device) and
    writes them into `output`; the values are meaningless, the buffers and bytes are the
    GPU program's.
    """
    p = jax.lax.axis_size(axis_name)
    rows = min(operand.shape[0], output.shape[0])
    padded = -(-rows // p) * p
    chunk = jnp.pad(operand[:rows], [(0, padded - rows)] + [(0, 0)] * (operand.ndim - 1))
    moved = jax.lax.all_to_all(chunk, axis_name, 0, 0, tiled=True)[:rows]
    # Keep the size arguments live, as the real op reads them.
    moved = moved + (send_sizes.sum() + recv_sizes.sum() + input_offsets[0] + output_offsets[0]).astype(moved.dtype) * 0
    return jax.lax.dynamic_update_slice(output, moved, (0,) * output.ndim)


def ragged_all_to_all_impl(impl: str):
    """The ragged all-to-all named `impl` (one of RAGGED_A2A_IMPLS).

    Returns a function with `jax.lax.ragged_all_to_all`'s arguments (operand, output,
    input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name).

    Raises:
        ValueError: for a name not in RAGGED_A2A_IMPLS.
    """
    if impl == "balanced_stand_in":
        return balanced_stand_in
    if impl not in RAGGED_A2A_IMPLS:
        raise ValueError(f"unknown ragged all-to-all implementation {impl!r}; expected one of {RAGGED_A2A_IMPLS}")
    return functools.partial(ragged_all_to_all, emulate=impl == "emulate")
