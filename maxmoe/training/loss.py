"""Next-token cross-entropy: from whole logits, or fused with the head projection in vocabulary blocks.

The head's float32 logits are the largest activation of a step ([B, T, V]: 17 GB for the
main head and MTP of proxy_1gpu). `head_cross_entropy` never builds them: it walks the
vocabulary in blocks of `chunk` columns, projecting the hidden states onto one block of
the head at a time, and keeps a running log-sum-exp and the target's logit per token
([B, T] each). Its own VJP walks the blocks again: each block's softmax gradient comes
from its recomputed logits and the saved log-sum-exp, giving that block's slice of the
head's gradient and a contribution to the hidden states' gradient. At most one block's
logits exist at a time, and, unlike blocks of positions, the head is read (gathered under
FSDP) once per pass and its gradient reduced once: each block touches its own columns.
Same loss and gradients as projecting first, up to float32 summation order.

Axis legend: S stacks of hidden states (main head, MTP depths), B batch, T time, D embed, V vocab,
C columns per block, n blocks.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in float32 (over mask == 1 positions)."""
    logits = logits_BTV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = _pick(logits, targets_BT)
    nll = logz - picked
    if mask_BT is None:
        return nll.mean()
    return (nll * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1.0)


def _pick(logits_V: jax.Array, index: jax.Array) -> jax.Array:
    """logits[..., index] (0 where index is out of range), as a masked sum over the last axis.

    Exact (one non-zero term) and, unlike take_along_axis, safe on a vocabulary sharded
    over an in-domain axis inside the two-tier step's per-replica shard_map, where XLA's
    SPMD partitioner aborts on that gather (jax 0.10-0.12).
    """
    return jnp.where(jnp.arange(logits_V.shape[-1]) == index[..., None], logits_V, 0.0).sum(-1)


def vocab_block(v: int, preferred: int) -> int:
    """The largest divisor of v that is <= preferred (0: all of v)."""
    if preferred <= 0:
        return v
    return next(c for c in range(min(v, preferred), 0, -1) if v % c == 0)


def head_cross_entropy(
    h_BTD: jax.Array,
    w_head_DV: jax.Array,
    targets_BT: jax.Array,
    mask_BT: jax.Array | None = None,
    *,
    chunk: int = 16384,
    dtype: Any = jnp.bfloat16,
    constrain=None,
) -> jax.Array:
    """cross_entropy(h @ w_head, targets, mask) without the whole [B, T, V] logits.

    Args:
        h_BTD: final-normed hidden states.
        w_head_DV: the head (cast to `dtype`, as the model's head does).
        targets_BT, mask_BT: as for `cross_entropy`.
        chunk: vocabulary columns per block (the largest divisor of V up to this); 0 = one block.
        dtype: the matmuls' compute dtype; logits and their statistics are float32.
        constrain: fn(x, logical_axes) placing each block's logits on the mesh (the layout's).

    Returns:
        The float32 mean cross-entropy over mask == 1 positions.
    """
    mask_BT = jnp.ones(targets_BT.shape, jnp.float32) if mask_BT is None else mask_BT
    return head_cross_entropies(
        h_BTD[None], w_head_DV, targets_BT[None], mask_BT[None], chunk=chunk, dtype=dtype, constrain=constrain
    )[0]


def head_cross_entropies(
    h_SBTD: jax.Array,
    w_head_DV: jax.Array,
    targets_SBT: jax.Array,
    mask_SBT: jax.Array,
    *,
    chunk: int = 16384,
    dtype: Any = jnp.bfloat16,
    constrain=None,
) -> jax.Array:
    """S losses through one head in one pass: [S] mean cross-entropies (the main head and MTP depths).

    One pass over the vocabulary serves all S stacks of hidden states, so the head is read
    once, not S times (under FSDP: one all-gather per pass instead of S).
    """
    mask_SBT = mask_SBT.astype(jnp.float32)
    c = vocab_block(w_head_DV.shape[1], chunk)
    nll_SBT = _nll(h_SBTD, w_head_DV, targets_SBT, mask_SBT, c, dtype, constrain)
    return nll_SBT.sum((1, 2)) / jnp.maximum(mask_SBT.sum((1, 2)), 1.0)


def _blocks(w_DV, c):
    """[D, V] -> [n, D, C]: block j holds columns [j C, (j + 1) C)."""
    d, v = w_DV.shape
    return w_DV.reshape(d, v // c, c).transpose(1, 0, 2)


def _block_logits(h_SBTD, w_DC, dtype, constrain):
    logits = jnp.einsum("sbtd,dc->sbtc", h_SBTD.astype(dtype), w_DC.astype(dtype), preferred_element_type=jnp.float32)
    return logits if constrain is None else constrain(logits, (None, "batch", "seq", "vocab"))


def _target_in_block(targets_SBT, j, c):
    local = targets_SBT - j * c
    return local, (local >= 0) & (local < c)


def _forward(h_SBTD, w_DV, targets_SBT, mask_SBT, c, dtype, constrain):
    """Masked token losses and the float32 log-sum-exp, both [S, B, T]."""

    def block(carry, inputs):
        row_max, row_sum, picked = carry
        w_DC, j = inputs
        logits = _block_logits(h_SBTD, w_DC, dtype, constrain)
        new_max = jnp.maximum(row_max, logits.max(-1))
        row_sum = row_sum * jnp.exp(row_max - new_max) + jnp.exp(logits - new_max[..., None]).sum(-1)
        local, _ = _target_in_block(targets_SBT, j, c)
        return (new_max, row_sum, picked + _pick(logits, local)), None

    shape = targets_SBT.shape
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    w_n = _blocks(w_DV, c)
    (row_max, row_sum, picked), _ = jax.lax.scan(block, init, (w_n, jnp.arange(w_n.shape[0])))
    lse = row_max + jnp.log(row_sum)
    return (lse - picked) * mask_SBT, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _nll(h_SBTD, w_DV, targets_SBT, mask_SBT, c, dtype, constrain):
    return _forward(h_SBTD, w_DV, targets_SBT, mask_SBT, c, dtype, constrain)[0]


def _nll_fwd(h_SBTD, w_DV, targets_SBT, mask_SBT, c, dtype, constrain):
    nll, lse = _forward(h_SBTD, w_DV, targets_SBT, mask_SBT, c, dtype, constrain)
    return nll, (h_SBTD, w_DV, targets_SBT, mask_SBT, lse)


def _nll_bwd(c, dtype, constrain, residuals, g_SBT):
    """Per block, (softmax - one-hot) x mask x g -> the block's dw columns, and dh."""
    h_SBTD, w_DV, targets_SBT, mask_SBT, lse = residuals
    scale_SBT = mask_SBT * g_SBT

    def block(dh_SBTD, inputs):
        w_DC, j = inputs
        logits = _block_logits(h_SBTD, w_DC, dtype, constrain)
        local, inside = _target_in_block(targets_SBT, j, c)
        one_hot = (jnp.arange(c) == local[..., None]) & inside[..., None]
        d_logits = (jnp.exp(logits - lse[..., None]) - one_hot) * scale_SBT[..., None]
        dw_DC = jnp.einsum(
            "sbtd,sbtc->dc", h_SBTD.astype(dtype), d_logits.astype(dtype), preferred_element_type=jnp.float32
        )
        dh_SBTD = dh_SBTD + jnp.einsum(
            "sbtc,dc->sbtd", d_logits.astype(dtype), w_DC.astype(dtype), preferred_element_type=jnp.float32
        )
        return dh_SBTD, dw_DC

    w_n = _blocks(w_DV, c)
    dh, dw_n = jax.lax.scan(block, jnp.zeros(h_SBTD.shape, jnp.float32), (w_n, jnp.arange(w_n.shape[0])))
    dw_DV = dw_n.transpose(1, 0, 2).reshape(w_DV.shape)
    return dh.astype(h_SBTD.dtype), dw_DV.astype(w_DV.dtype), None, jnp.zeros_like(mask_SBT)


_nll.defvjp(_nll_fwd, _nll_bwd)
