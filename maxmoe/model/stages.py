"""The Transformer cut into pipeline pieces, from its own modules: before, per chunk, after.

    first(outer, tokens)             embedding -> scanned dense layers    (stage 0, chunk 0)
    chunk(params, state, x)          S slots of the scanned MoE stack     (every stage, V chunks)
    last(outer, outer_state, h, tokens) final norm -> head, MTP depths    (stage P-1, last chunk)

Only the MoE stack (`moe_layers`) is cut into stages. The dense layers have another
parameter structure (a dense SwiGLU instead of experts), so they cannot share its slots;
at 3 of 61 layers (671B) they ride with the embedding on stage 0, and empty slots at the
front of chunk 0 (`mesh.pipeline_pad_front`) can give that stage less MoE work. MTP reads
the embedding too: every parameter outside the stack ("outer") is on every stage, and its
gradient is summed over stages once per step.

A chunk's `state` holds its router biases and a [S] mask: slots without a model layer
(layer counts that do not divide) are skipped by lax.cond, an exact no-op with zero
statistics; the mask differs only between stages, so the dispatch's collectives inside
run on all devices of a stage or on none.

The functions run inside the pipeline's shard_map, so each rebinds the layout to the mesh
jax traces under (Layout.on_context_mesh); they name logical axes only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import ModelConfig
from maxmoe.model.layers import Embed, RMSNorm, constrain
from maxmoe.model.transformer import COMPUTE_DTYPES, REMAT_POLICIES, Block, MTPLayer, _stack, head_logits, shift_left

STACK = "moe_layers"  # the variables cut into stages; everything else is "outer"


def split_stack(tree: dict) -> tuple[Any, dict]:
    """(the stack's subtree, the rest) of a params / router / stats tree."""
    return tree[STACK], {k: v for k, v in tree.items() if k != STACK}


def _positions(shape):
    b, t = shape[:2]
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _rebind(layout):
    return None if layout is None else layout.on_context_mesh()


def make_first(config: ModelConfig, layout: Any = None):
    """first(outer_params, tokens_BT) -> x_BTD: the embedding and the dense layers."""
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def first(outer, tokens_BT):
        inner = _rebind(layout)
        embed = Embed(config.vocab_size, config.hidden_size, dtype, config.init_std)
        x = constrain(inner, embed.apply({"params": outer["embed"]}, tokens_BT), ("batch", "seq", "embed"))
        if config.first_k_dense:
            dense = _stack(config, False, config.first_k_dense, "dense_layers", dtype, inner)
            x, _ = dense.apply({"params": outer["dense_layers"]}, x, _positions(tokens_BT.shape))
        return x

    return first


SLOT_PARAMS = "pipeline_slot_params"  # one slot's parameters, sliced from the chunk's


def make_chunk(config: ModelConfig, layout: Any = None):
    """chunk(params [S, ...], {"router": [S, ...], "mask": bool [S]}, x_BTD) -> ((y_BTD, seq_aux), stats [S, ...]).

    seq_aux: the chunk's sequence-wise balance losses summed over its layers; stats: each
    slot's moe_stats (zeros for empty slots). model.remat applies per layer, as in the model.

    Each slot slices its parameters from the whole chunk's inside its checkpointed layer and
    never saves the slice: the pipeline keeps a chunk's residuals for every item in flight,
    and a slice saved per layer would be a copy of the chunk's parameters per item (scanning
    over the parameters as loop inputs saves exactly that). The slice is recomputed in the
    backward from the chunk's parameters, which the pipeline does not copy.
    """
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def layer(params, router, i, x_BTD):
        params_s = jax.tree.map(lambda a: checkpoint_name(a[i], SLOT_PARAMS), params)
        router_s = jax.tree.map(lambda a: a[i], router)
        block = Block(config, True, dtype, _rebind(layout))
        (y, _), variables = block.apply(
            {"params": params_s, "router": router_s}, x_BTD, _positions(x_BTD.shape), mutable=["moe_stats"]
        )
        return y, variables["moe_stats"]

    def slot(params, router, x, inputs):
        i, on = inputs
        stats_shape = jax.eval_shape(layer, params, router, i, x)[1]

        def skip(x):
            return x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)

        return jax.lax.cond(on, lambda x: layer(params, router, i, x), skip, x)

    policies = jax.checkpoint_policies
    if config.remat == "none":
        policy = policies.save_anything_except_these_names(SLOT_PARAMS)
    else:  # none of the remat policies saves the slice: it is neither a dot's output nor a named one
        policy = REMAT_POLICIES[config.remat]
    # Checkpointed around the cond: a cond's residuals leave it as per-iteration values, which
    # the scan would stack (the chunk's parameters once per slot); the checkpoint's are its inputs.
    slot = jax.checkpoint(slot, policy=policy, prevent_cse=False)

    def chunk(params, state, x_BTD):
        router = state["router"]
        slots = jnp.arange(state["mask"].shape[0])
        y, stats = jax.lax.scan(lambda x, inputs: slot(params, router, x, inputs), x_BTD, (slots, state["mask"]))
        return (y, stats["moe"]["router"]["seq_aux"].sum()), stats

    return chunk


def make_last(config: ModelConfig, layout: Any = None, hidden_only: bool = False):
    """last(outer_params, outer_state, h_BTD, tokens_BT) -> (main, [mtp per depth], mtp stats).

    main and each MTP entry are float32 logits [B, T, V], or with hidden_only the final-normed
    hidden states [B, T, D] the chunked loss projects itself (as Transformer(hidden_only=True)).
    mtp stats: {"mtp_<k>": moe_stats} as the whole model reports them.
    """
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def last(outer, outer_state, h_BTD, tokens_BT):
        inner = _rebind(layout)
        positions = _positions(tokens_BT.shape)
        embed = Embed(config.vocab_size, config.hidden_size, dtype, config.init_std)

        def head(h):
            return h if hidden_only else head_logits(h, outer["head"], dtype, inner)

        normed = RMSNorm(config.rms_norm_eps).apply({"params": outer["final_norm"]}, h_BTD)
        h, mtp, stats = normed, [], {}
        for k in range(1, config.mtp_num_layers + 1):
            name = f"mtp_{k - 1}"
            emb = embed.apply({"params": outer["embed"]}, shift_left(tokens_BT, k))
            (h, normed_k), variables = MTPLayer(config, dtype, inner).apply(
                {"params": outer[name], "router": outer_state[name]}, h, emb, positions, mutable=["moe_stats"]
            )
            mtp.append(head(normed_k))
            stats[name] = variables["moe_stats"]
        return head(normed), mtp, stats

    return last
