"""Context parallelism for MLA: sequences in zigzag chunks over `context`, the latents all-gathered.

    order_T = zigzag_order(T, C)              # the natural positions in layout order
    core = latent_attention(forward, backward, mesh, batch_axes, head_axes)    # the layout's core

With mesh.context = C device d of the context axis holds chunks d and 2C-1-d of 2C (every device
the same share of the causal scores); the model permutes once, at the embedding (positions,
targets and masks computed in natural order), so everything but attention never notices.
`latent_attention` all-gathers each token's MLA latent and rope key over `context` (one
all-gather per layer; its transpose reduce-scatters their gradients), puts them back in natural
order and runs the core (maxmoe.model.attention_ops.latent_attention) on the device's own queries.

docs/SHARDING.md, "Context parallelism" has the reasoning (zigzag, why latents, the expert fold).
Axis legend: B batch, T time (local queries), S time (all keys), L latent + rope key values,
H heads, K head dim, C context size.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxmoe.parallel.names import CONTEXT_AXIS, LATENT_GATHER
from maxmoe.parallel.shard_context import axes_of, shard_map_in_context


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


def layout_from_natural(x_BS_, c: int) -> jax.Array:
    """`natural_from_layout`'s inverse: a whole sequence in natural order -> layout order (shard-major)."""
    b, s = x_BS_.shape[:2]
    rest = x_BS_.shape[2:]
    chunks = x_BS_.reshape(b, 2 * c, s // (2 * c), *rest)
    first, second = chunks[:, :c], jnp.flip(chunks[:, c:], axis=1)
    return jnp.stack([first, second], axis=2).reshape(b, s, *rest)


def latent_attention(forward: Callable, backward: Callable, mesh, batch_axes, head_axes) -> Callable:
    """fn(q, positions, latent, k_rope, w_k_up, w_v_up) -> out: MLA on each device's queries, the latents
    all-gathered over `context`.

    Args:
        forward: forward(q_BTHK, positions_BT, latent_BSL, k_rope_BSR, w_k_up, w_v_up) -> (out, lse),
            the core with the whole sequence's latents and rope keys in natural order
            (positions 0..S-1) and the queries' natural positions;
        backward: backward(q, positions, latent, k_rope, w_k_up, w_v_up, out, lse, d_out) ->
            (dq, d_latent, d_k_rope, d_w_k_up, d_w_v_up) (maxmoe.model.attention_ops).
        mesh: the layout's mesh (it has a `context` axis).
        batch_axes, head_axes: PartitionSpec entries of the batch and heads dims.

    The arrays enter in layout order, sequence sharded over `context`: q [B, T, H, K],
    positions [B, T], latent [B, T, kv_lora], k_rope [B, T, R]; the up-projections
    [kv_lora, H, *] are whole over `context`. Forward: one all-gather moves the latent and the
    rope key (concatenated, in their dtype) over `context`; the gathered sequence is the
    backward's residual. Backward: one reduce-scatter returns their gradients; the
    up-projections' gradients are summed over the batch axes and `context`; with heads sharded
    (`tensor`) the latents' gradients are first summed over the heads' shards. The gather and
    the reduce-scatter run under the jax scope LATENT_GATHER (also the gathered array's
    checkpoint name), which the planner counts as exposed: the gather waits on the layer's own latents. The VJP is
    defined outside the shard_maps, so autodiff never traces the core's loops (under a scan
    it would stack every block's probabilities).
    """
    c = mesh.shape[CONTEXT_AXIS]
    seq_BT = PartitionSpec(batch_axes, CONTEXT_AXIS)
    seq_BTL = PartitionSpec(batch_axes, CONTEXT_AXIS, None)
    seq_BTHK = PartitionSpec(batch_axes, CONTEXT_AXIS, head_axes, None)
    whole_BSL = PartitionSpec(batch_axes, None, None)
    lse_spec = PartitionSpec(CONTEXT_AXIS, batch_axes, head_axes, None)  # [query groups, B, H, group]
    w_LHK = PartitionSpec(None, head_axes, None)
    replicated_over = (*axes_of(batch_axes), CONTEXT_AXIS)  # where the up-projections' gradients sum
    heads = axes_of(head_axes)  # the latents' gradients sum over the heads' shards

    def forward_shard(q_BTHK, positions_BT, latent_BTL, k_rope_BTR, w_k_up, w_v_up):
        local = jnp.concatenate([latent_BTL, k_rope_BTR.astype(latent_BTL.dtype)], axis=-1)
        with jax.named_scope(LATENT_GATHER):
            gathered_BSL = jax.lax.all_gather(local, CONTEXT_AXIS, axis=1, tiled=True)
        gathered_BSL = jax.ad_checkpoint.checkpoint_name(natural_from_layout(gathered_BSL, c), LATENT_GATHER)
        width = latent_BTL.shape[-1]
        out, lse = forward(q_BTHK, positions_BT, gathered_BSL[..., :width], gathered_BSL[..., width:], w_k_up, w_v_up)
        return out, lse, gathered_BSL

    def backward_shard(q_BTHK, positions_BT, gathered_BSL, w_k_up, w_v_up, out, lse, d_out):
        width = w_k_up.shape[0]
        latent_BSL, k_rope_BSR = gathered_BSL[..., :width], gathered_BSL[..., width:]
        dq, d_latent, d_rope, dw_k, dw_v = backward(
            q_BTHK, positions_BT, latent_BSL, k_rope_BSR, w_k_up, w_v_up, out, lse, d_out
        )
        d_gathered = layout_from_natural(jnp.concatenate([d_latent, d_rope.astype(d_latent.dtype)], axis=-1), c)
        if heads:
            d_gathered = jax.lax.psum(d_gathered, heads)
        with jax.named_scope(LATENT_GATHER):
            d_local = jax.lax.psum_scatter(d_gathered, CONTEXT_AXIS, scatter_dimension=1, tiled=True)
        dw_k, dw_v = jax.lax.psum((dw_k, dw_v), replicated_over)
        return dq, d_local[..., :width], d_local[..., width:], dw_k, dw_v

    forward_map = shard_map_in_context(
        forward_shard,
        mesh=mesh,
        in_specs=(seq_BTHK, seq_BT, seq_BTL, seq_BTL, w_LHK, w_LHK),
        out_specs=(seq_BTHK, lse_spec, whole_BSL),
        check_vma=False,
    )
    backward_map = shard_map_in_context(
        backward_shard,
        mesh=mesh,
        in_specs=(seq_BTHK, seq_BT, whole_BSL, w_LHK, w_LHK, seq_BTHK, lse_spec, seq_BTHK),
        out_specs=(seq_BTHK, seq_BTL, seq_BTL, w_LHK, w_LHK),
        check_vma=False,
    )

    @jax.custom_vjp
    def attend(q_BTHK, positions_BT, latent_BTL, k_rope_BTR, w_k_up, w_v_up):
        return forward_map(q_BTHK, positions_BT, latent_BTL, k_rope_BTR, w_k_up, w_v_up)[0]

    def attend_fwd(q_BTHK, positions_BT, latent_BTL, k_rope_BTR, w_k_up, w_v_up):
        out, lse, gathered = forward_map(q_BTHK, positions_BT, latent_BTL, k_rope_BTR, w_k_up, w_v_up)
        return out, (q_BTHK, positions_BT, gathered, w_k_up, w_v_up, out, lse)

    def attend_bwd(residuals, d_out):
        q_BTHK, positions_BT, gathered, w_k_up, w_v_up, out, lse = residuals
        dq, d_latent, d_rope, dw_k, dw_v = backward_map(q_BTHK, positions_BT, gathered, w_k_up, w_v_up, out, lse, d_out)
        # The rope key travels in the latent's dtype (MLA computes both in the compute dtype).
        return dq, None, d_latent, d_rope, dw_k, dw_v

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
