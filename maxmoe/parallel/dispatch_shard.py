"""What one shard runs inside `shard_map` for each expert-parallel dispatch strategy.

    y_nD, dropped, routed = ragged_a2a_shard(x_nD, expert_ids_nK, weights_nK, w_gate_LDF, w_up_LDF,
        w_down_LFD, num_experts=E, buffer_rows=M, ...)      # allgather_shard, capacity_shard alike

Every function here sees local arrays only: n token rows of this (data, expert) shard, the L
local experts of this expert rank and the F slice of this tensor rank. Each returns this shard's
partial output [n, D] (a partial sum over F slices when F is sharded over `tensor`; the caller
reduces it), the number of token copies it dropped and the number of real copies it routed.
Token copies whose expert id is E are padding: never sent, never counted, output zero. Every
collective's output and the expert gate/up GEMM's output carry a checkpoint name
(`maxmoe.parallel.names`) a remat policy can keep; docs/ARCHITECTURE.md, "Remat" has each
name's value and bytes, docs/SHARDING.md, "Expert dispatch" the strategies.
Legend: n tokens of this shard, D embed, F expert_mlp slice, E experts, L = E / P local experts,
P expert-axis size, K top-k, M rows of a buffer, C capacity slots per expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.kernels.fp8_matmul import fp8_grouped_swiglu
from maxmoe.kernels.grouped_matmul import grouped_swiglu
from maxmoe.parallel.collectives import ragged_all_to_all_impl
from maxmoe.parallel.fp8_dispatch import fp8_ragged_exchange
from maxmoe.parallel.names import COMBINE_ROWS, DISPATCH_COUNTS, DISPATCH_META, DISPATCH_ROWS


def expert_swiglu(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, backend="ragged_dot", fp8="none", padded=True):
    """SwiGLU of each row through its group's expert; rows sorted by expert (gate and up as one GEMM).

    fp8: "none" or a recipe of maxmoe.kernels.fp8_matmul for both grouped GEMMs.
    padded: False when every row belongs to a group (maxmoe.kernels.grouped_matmul).
    """
    if fp8 != "none":
        return fp8_grouped_swiglu(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, fp8, backend)
    return grouped_swiglu(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, backend=backend, padded=padded)


def chunk_slices(starts, sizes, chunks):
    """Cut each ragged slice (start, size) into `chunks` consecutive pieces, slice-major.

    Piece c of a slice holds size // chunks rows, one more for the first size % chunks
    pieces (so pieces may be empty). Returns [len(starts) * chunks] starts and sizes; piece
    c of slice i is entry i * chunks + c, so the pieces bound for peer p stay in the block
    of entries a ragged all-to-all with chunks x P slices sends to p.
    """
    if chunks == 1:
        return starts, sizes
    c = jnp.arange(chunks, dtype=sizes.dtype)
    base, extra = sizes[:, None] // chunks, sizes[:, None] % chunks
    piece_sizes = base + (c[None, :] < extra).astype(sizes.dtype)
    piece_starts = starts[:, None] + c[None, :] * base + jnp.minimum(c[None, :], extra)
    return piece_starts.reshape(-1), piece_sizes.reshape(-1)


def count_copies(expert_ids, num_experts):
    """[num_experts] int32 copies per expert; ids outside [0, num_experts) are not counted."""
    flat = expert_ids.reshape(-1)
    return jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")


def inverse_permutation(perm):
    """The permutation q with q[perm[i]] = i (integer scatter, no gradient needed)."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def combine(copies_MD, weights_nK):
    """Weighted sum over k of each token's expert outputs; copies in (token, k) order."""
    n, k = weights_nK.shape
    copies_nKD = copies_MD.reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", copies_nKD, weights_nK.astype(copies_nKD.dtype))


def dropless_rows(tokens, top_k, experts_per_rank, senders):
    """Worst-case rows one expert rank can receive: every sender's tokens all pick it.

    A token's top-k experts are distinct, so it sends at most min(top_k, L) copies to
    one rank: the bound is senders x tokens x min(top_k, L).
    """
    return senders * tokens * min(top_k, experts_per_rank)


# ----------------------------------------------------------------------------------
# ragged_a2a: sort by expert, ragged all-to-all out, grouped matmul, ragged all-to-all back.


def ragged_a2a_shard(
    x_nD,
    expert_ids_nK,
    weights_nK,
    w_gate_LDF,
    w_up_LDF,
    w_down_LFD,
    *,
    num_experts,
    buffer_rows,
    expert_axis,
    a2a_impl,
    backend,
    a2a_chunks=1,
    fp8="none",
    fp8_dispatch=False,
):
    """Dropless (or buffer-bounded) dispatch with two ragged all-to-alls over `expert_axis`.

    The receive buffer holds `buffer_rows` rows, laid out source-major: rows from expert
    rank 0 first, then rank 1, ... (each source's rows sorted by local expert). When the
    rows bound for a rank exceed the buffer, the later sources' tail rows (their highest
    local experts) are not sent; they are dropped and counted. `a2a_impl` names the
    ragged all-to-all (`maxmoe.parallel.collectives.RAGGED_A2A_IMPLS`). With `a2a_chunks`
    = c > 1 each (source, rank) block travels as c consecutive slices of the same
    collective (c x P slices, `chunk_slices`); which rows go where is unchanged.
    With `fp8_dispatch` the rows go out in fp8 with their scales
    (`maxmoe.parallel.fp8_dispatch`; `fp8` names the recipe); they come back in their own dtype.
    """
    ragged_all_to_all = ragged_all_to_all_impl(a2a_impl)
    n, k = expert_ids_nK.shape
    ranks = jax.lax.axis_size(expert_axis)
    me = jax.lax.axis_index(expert_axis)
    local = w_gate_LDF.shape[0]

    flat_ids = expert_ids_nK.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # padding (id E) sorts last
    sorted_rows_MD = x_nD[order // k]
    counts_E = count_copies(flat_ids, num_experts)

    # Everyone's per-expert counts give every offset without a second exchange.
    counts_SRL = jax.lax.all_gather(counts_E, expert_axis).reshape(ranks, ranks, local)
    counts_SRL = checkpoint_name(counts_SRL, DISPATCH_COUNTS)
    wanted_SR = counts_SRL.sum(-1)  # rows source S wants to send to rank R
    before_SR = jnp.cumsum(wanted_SR, axis=0) - wanted_SR  # rows of earlier sources at R
    sent_SR = jnp.clip(buffer_rows - before_SR, 0, wanted_SR)
    recv_offset_SR = jnp.where(sent_SR > 0, before_SR, 0)  # start of S's rows in R's buffer
    send_start_SR = jnp.cumsum(wanted_SR, axis=1) - wanted_SR  # start of R's rows in S's sort

    # The dispatch sends slices (send_start, sent) of my sort to offsets recv_offset at each
    # rank; the combine sends them back, so its slices are the dispatch's seen from the receiver.
    send_starts, send_sizes = chunk_slices(send_start_SR[me], sent_SR[me], a2a_chunks)
    send_offsets, _ = chunk_slices(recv_offset_SR[me], sent_SR[me], a2a_chunks)
    back_starts, recv_sizes = chunk_slices(recv_offset_SR[:, me], sent_SR[:, me], a2a_chunks)
    back_offsets, _ = chunk_slices(send_start_SR[:, me], sent_SR[:, me], a2a_chunks)
    if fp8_dispatch:
        receive_MD = fp8_ragged_exchange(
            sorted_rows_MD,
            send_starts,
            send_sizes,
            send_offsets,
            recv_sizes,
            buffer_rows=buffer_rows,
            axis_name=expert_axis,
            a2a_impl=a2a_impl,
            recipe=fp8,
        )
    else:  # (the fp8 exchange names its fp8 payload, which is what a policy should keep)
        receive_MD = ragged_all_to_all(
            sorted_rows_MD,
            jnp.zeros((buffer_rows,) + x_nD.shape[1:], x_nD.dtype),
            send_starts,
            send_sizes,
            send_offsets,
            recv_sizes,
            axis_name=expert_axis,
        )
        receive_MD = checkpoint_name(receive_MD, DISPATCH_ROWS)

    # Regroup the received rows by local expert (stable: source-major inside an expert).
    from_me_SL = counts_SRL[:, me]
    kept_SL = jnp.clip(sent_SR[:, me, None] - (jnp.cumsum(from_me_SL, -1) - from_me_SL), 0, from_me_SL)
    block_ends = jnp.cumsum(kept_SL.reshape(-1))
    block_M = jnp.searchsorted(block_ends, jnp.arange(buffer_rows, dtype=block_ends.dtype), side="right")
    local_expert_M = jnp.where(block_M < ranks * local, block_M % local, local)
    regroup = jnp.argsort(local_expert_M, stable=True)
    out_MD = expert_swiglu(receive_MD[regroup], kept_SL.sum(0), w_gate_LDF, w_up_LDF, w_down_LFD, backend, fp8)
    out_MD = out_MD[inverse_permutation(regroup)]

    returned_MD = ragged_all_to_all(
        out_MD,
        jnp.zeros(sorted_rows_MD.shape, out_MD.dtype),
        back_starts,
        recv_sizes,
        back_offsets,
        send_sizes,
        axis_name=expert_axis,
    )
    returned_MD = checkpoint_name(returned_MD, COMBINE_ROWS)
    y_nD = combine(returned_MD[inverse_permutation(order)], weights_nK)
    dropped = (wanted_SR[me] - sent_SR[me]).sum()
    return y_nD, dropped, counts_E.sum()


# ----------------------------------------------------------------------------------
# allgather: every expert rank sees all tokens of its expert group, reduce-scatter back.


def allgather_shard(
    x_nD, expert_ids_nK, weights_nK, w_gate_LDF, w_up_LDF, w_down_LFD, *, num_experts, expert_axis, backend, fp8="none"
):
    """All-gather tokens over `expert_axis`, run the local experts, reduce-scatter back."""
    n, k = expert_ids_nK.shape
    ranks = jax.lax.axis_size(expert_axis)
    me = jax.lax.axis_index(expert_axis)
    local = w_gate_LDF.shape[0]

    all_x_ND = checkpoint_name(jax.lax.all_gather(x_nD, expert_axis, tiled=True), DISPATCH_ROWS)
    all_ids_NK = checkpoint_name(jax.lax.all_gather(expert_ids_nK, expert_axis, tiled=True), DISPATCH_META)
    all_weights_NK = checkpoint_name(jax.lax.all_gather(weights_nK, expert_axis, tiled=True), DISPATCH_META)

    local_ids = all_ids_NK.reshape(-1) - me * local
    local_ids = jnp.where((local_ids >= 0) & (local_ids < local), local_ids, local)
    order = jnp.argsort(local_ids, stable=True)  # copies for other ranks sort last
    rows = min(ranks * n * k, dropless_rows(n, k, local, ranks))
    out_MD = expert_swiglu(
        all_x_ND[order[:rows] // k], count_copies(local_ids, local), w_gate_LDF, w_up_LDF, w_down_LFD, backend, fp8
    )
    out_MD = jnp.concatenate([out_MD, jnp.zeros((ranks * n * k - rows,) + out_MD.shape[1:], out_MD.dtype)])
    partial_ND = combine(out_MD[inverse_permutation(order)], all_weights_NK)
    y_nD = jax.lax.psum_scatter(partial_ND, expert_axis, scatter_dimension=0, tiled=True)
    return y_nD, jnp.zeros((), jnp.int32), count_copies(expert_ids_nK, num_experts).sum()


# ----------------------------------------------------------------------------------
# capacity: fixed slots per (source shard, expert), dense all-to-all, batched matmul.


def capacity_shard(
    x_nD, expert_ids_nK, weights_nK, w_gate_LDF, w_up_LDF, w_down_LFD, *, num_experts, capacity, expert_axis
):
    """GShard-style dispatch: `capacity` slots per expert per shard; overflow dropped.

    Copies fill an expert's slots in (token, k) order; those past `capacity` are dropped.
    """
    n, k = expert_ids_nK.shape
    ranks = jax.lax.axis_size(expert_axis)
    local = w_gate_LDF.shape[0]
    d = x_nD.shape[1]

    flat_ids = expert_ids_nK.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    counts_E = count_copies(flat_ids, num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E

    slots_C = jnp.arange(capacity)
    filled_EC = slots_C[None, :] < counts_E[:, None]
    source_EC = jnp.clip(starts_E[:, None] + slots_C[None, :], 0, n * k - 1)
    send_ECD = jnp.where(filled_EC[..., None], x_nD[order[source_EC] // k], jnp.zeros((), x_nD.dtype))

    # Tiled all_to_all splits E into P blocks of L experts: block r goes to rank r.
    receive_ECD = checkpoint_name(jax.lax.all_to_all(send_ECD, expert_axis, 0, 0, tiled=True), DISPATCH_ROWS)
    rows_LMD = receive_ECD.reshape(ranks, local, capacity, d).transpose(1, 0, 2, 3).reshape(local, -1, d)
    gate = jnp.einsum("lmd,ldf->lmf", rows_LMD, w_gate_LDF, preferred_element_type=jnp.float32)
    up = jnp.einsum("lmd,ldf->lmf", rows_LMD, w_up_LDF, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(x_nD.dtype)
    out_LMD = jnp.einsum("lmf,lfd->lmd", hidden, w_down_LFD, preferred_element_type=jnp.float32).astype(x_nD.dtype)
    out_ECD = out_LMD.reshape(local, ranks, capacity, d).transpose(1, 0, 2, 3).reshape(-1, capacity, d)
    back_ECD = checkpoint_name(jax.lax.all_to_all(out_ECD, expert_axis, 0, 0, tiled=True), COMBINE_ROWS)

    # Copy q sits at sorted position inverse_order[q], slot inverse_order[q] - start of its expert.
    expert_M = jnp.clip(flat_ids, 0, num_experts - 1)
    slot_M = inverse_permutation(order) - starts_E[expert_M]
    kept_M = (flat_ids < num_experts) & (slot_M < capacity)
    copies_MD = jnp.where(
        kept_M[:, None], back_ECD[expert_M, jnp.clip(slot_M, 0, capacity - 1)], jnp.zeros((), back_ECD.dtype)
    )
    dropped = jnp.maximum(counts_E - capacity, 0).sum()
    return combine(copies_MD, weights_nK), dropped, counts_E.sum()
