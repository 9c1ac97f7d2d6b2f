"""Context parallelism for MLA: sequences in zigzag chunks over `context`, the latents all-gathered.

With mesh.context = C each sequence of T tokens is cut into 2C chunks of T / 2C; device d of
the context axis holds chunks d and 2C-1-d (the zigzag split), so under the causal mask every
device has the same share of the score triangle: chunk d sees d + 1 chunks of keys, chunk
2C-1-d sees 2C - d, 2C + 1 in all on every device. The model lays its activations out in
that order from the first embedding on (`zigzag_order`: the natural positions in layout order;
positions, RoPE, MTP's shifted inputs, targets and loss masks are all computed in natural
order and then permuted by it), so everything but attention is per token and never notices.

Attention needs every earlier key. MLA makes them cheap to share: a token's keys and values
are up-projected from one normalised latent (kv_lora_rank values) and one post-RoPE key shared
by all heads (qk_rope_head_dim values), 512 + 64 for DeepSeek-V3, against 128 heads x
(192 + 128) for the materialised keys and values -- 71x fewer bytes. `latent_attention`
all-gathers those 576 values per token over `context` (one all-gather per layer, both pieces
concatenated; its transpose, a reduce-scatter, returns their gradients), puts the gathered
sequence back into natural order with a static permutation, and runs the model's attention
core on the device's own queries against the whole sequence's latents. The core
(`maxmoe.model.attention_ops.latent_attention`) up-projects the latents block by block inside
its key loop, so keys and values of the whole sequence never exist at once.

Everything outside attention treats `context` as more data parallelism: MoE layers shard
experts over context x expert (the same devices: expert parallelism does not shrink) and
dispatch each device's own tokens; gradients are reduced and ZeRO-sharded over it like
`data` (maxmoe.mesh).

Axis legend: B batch, T time (local queries), S time (all keys), L latent + rope key values,
H heads, K head dim, C context size.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxmoe.config import CONTEXT_AXIS, LATENT_GATHER
from maxmoe.kernels.shard_context import shard_map_in_context


def zigzag_order(t: int, c: int) -> np.ndarray:
    """Natural positions [T] in layout order: shard d of c holds chunks d and 2c-1-d of t / 2c tokens."""
    if t % (2 * c):
        raise ValueError(f"a sequence of {t} tokens cannot be cut into 2 x {c} zigzag chunks")
    chunks = np.arange(t).reshape(2 * c, t // (2 * c))
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * c - 1 - d]]) for d in range(c)])


def natural_from_layout(x_BS_, c: int) -> jax.Array:
    """The whole sequence gathered in layout order (shard-major, two chunks each) -> natural order.

    A static permutation written as reshapes and one reversal, so its transpose is as cheap:
    gathered chunk (d, 0) is natural chunk d, chunk (d, 1) is natural chunk 2c-1-d.
    """
    b, s = x_BS_.shape[:2]
    rest = x_BS_.shape[2:]
    chunks = x_BS_.reshape(b, c, 2, s // (2 * c), *rest)
    first, second = chunks[:, :, 0], jnp.flip(chunks[:, :, 1], axis=1)
    return jnp.concatenate([first, second], axis=1).reshape(b, s, *rest)


def latent_attention(core: Callable, mesh, batch_axes, head_axes) -> Callable:
    """fn(q, positions, latent, k_rope, w_k_up, w_v_up) -> out, running `core` on each device's queries.

    Args:
        core: core(q_BTHK, positions_BT, latent_BSL, k_rope_BSR, w_k_up, w_v_up) -> [B, T, H, V]
            with the whole sequence's latents and rope keys in natural order (positions 0..S-1)
            and the queries' natural positions.
        mesh: the layout's mesh (it has a `context` axis).
        batch_axes, head_axes: PartitionSpec entries of the batch and heads dims.

    The arrays enter in layout order, sequence sharded over `context`: q [B, T, H, K],
    positions [B, T], latent [B, T, kv_lora], k_rope [B, T, R]; the up-projections
    [kv_lora, H, *] are whole over `context`. One all-gather per call moves the latent and the
    rope key (concatenated, in their dtype) over `context`; its transpose reduce-scatters the
    gradients. Both run under the jax scope LATENT_GATHER (also the gathered array's checkpoint
    name), which the planner counts as exposed: the gather waits on the layer's own latents.
    """
    c = mesh.shape[CONTEXT_AXIS]
    seq_BT = PartitionSpec(batch_axes, CONTEXT_AXIS)
    seq_BTL = PartitionSpec(batch_axes, CONTEXT_AXIS, None)
    seq_BTHK = PartitionSpec(batch_axes, CONTEXT_AXIS, head_axes, None)
    w_LHK = PartitionSpec(None, head_axes, None)

    def shard(q_BTHK, positions_BT, latent_BTL, k_rope_BTR, w_k_up, w_v_up):
        width = latent_BTL.shape[-1]
        local = jnp.concatenate([latent_BTL, k_rope_BTR.astype(latent_BTL.dtype)], axis=-1)
        with jax.named_scope(LATENT_GATHER):
            gathered_BSL = jax.lax.all_gather(local, CONTEXT_AXIS, axis=1, tiled=True)
        gathered_BSL = jax.ad_checkpoint.checkpoint_name(natural_from_layout(gathered_BSL, c), LATENT_GATHER)
        latent_BSL, k_rope_BSR = gathered_BSL[..., :width], gathered_BSL[..., width:]
        return core(q_BTHK, positions_BT, latent_BSL, k_rope_BSR.astype(k_rope_BTR.dtype), w_k_up, w_v_up)

    return shard_map_in_context(
        shard,
        mesh=mesh,
        in_specs=(seq_BTHK, seq_BT, seq_BTL, seq_BTL, w_LHK, w_LHK),
        out_specs=seq_BTHK,
        check_vma=False,
    )
