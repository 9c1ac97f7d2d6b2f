"""Next-token cross-entropy: from whole logits, or fused with the head projection in chunks.

The head's float32 logits are the largest activation of a step ([B, T, V]: 17 GB for the
main head and MTP of proxy_1gpu). `head_cross_entropy` never builds them: it cuts the
sequence into blocks of `chunk` positions and, for each, projects to the vocabulary,
takes the log-sum-exp and the target's logit, and keeps only the per-token loss. Each
block is rematerialised in the backward pass (jax.checkpoint inside the scan), so at most
one block's logits (and their gradient) exist at a time; the head's gradient is summed
over blocks. Same loss and gradients as projecting first, up to float32 summation order.

Axis legend: B batch, T time, D embed, V vocab, C positions per chunk.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in float32 (over mask == 1 positions)."""
    logits = logits_BTV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    nll = logz - picked
    if mask_BT is None:
        return nll.mean()
    return (nll * mask_BT).sum() / jnp.maximum(mask_BT.sum(), 1.0)


def _chunk(t: int, preferred: int) -> int:
    return next(c for c in range(min(t, preferred), 0, -1) if t % c == 0)


def head_cross_entropy(
    h_BTD: jax.Array,
    w_head_DV: jax.Array,
    targets_BT: jax.Array,
    mask_BT: jax.Array | None = None,
    *,
    chunk: int = 512,
    dtype: Any = jnp.bfloat16,
    constrain=None,
) -> jax.Array:
    """cross_entropy(h @ w_head, targets, mask) without the whole [B, T, V] logits.

    Args:
        h_BTD: final-normed hidden states.
        w_head_DV: the head (cast to `dtype`, as the model's head does).
        targets_BT, mask_BT: as for `cross_entropy`.
        chunk: positions per block (the largest divisor of T up to this); 0 = one block.
        dtype: the matmul's compute dtype; logits accumulate in float32.
        constrain: fn(x, logical_axes) placing each block's logits on the mesh (the layout's).

    Returns:
        The float32 mean cross-entropy over mask == 1 positions.
    """
    b, t, d = h_BTD.shape
    c = _chunk(t, chunk) if chunk > 0 else t
    n = t // c
    mask_BT = jnp.ones((b, t), jnp.float32) if mask_BT is None else mask_BT.astype(jnp.float32)
    w = w_head_DV.astype(dtype)

    @jax.checkpoint
    def block_nll(h_BCD, targets_BC, mask_BC):
        logits = jnp.einsum("bcd,dv->bcv", h_BCD.astype(dtype), w, preferred_element_type=jnp.float32)
        if constrain is not None:
            logits = constrain(logits, ("batch", "seq", "vocab"))
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets_BC[..., None], axis=-1)[..., 0]
        return ((logz - picked) * mask_BC).sum()

    def body(total, block):
        return total + block_nll(*block), None

    blocks = (
        h_BTD.reshape(b, n, c, d).swapaxes(0, 1),
        targets_BT.reshape(b, n, c).swapaxes(0, 1),
        mask_BT.reshape(b, n, c).swapaxes(0, 1),
    )
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), blocks)
    return total / jnp.maximum(mask_BT.sum(), 1.0)
