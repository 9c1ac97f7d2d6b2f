"""The Transformer cut into pipeline pieces, from its own modules: before, per chunk, after.

    first(outer, tokens)                   embedding                             (stage 0, chunk 0)
    chunk((params, shared), state, x)      S slots of the layer plan             (every stage, V chunks)
    head(outer, outer_state, h, tokens)    final norm -> head                    (stage P-1, last chunk)
    mtp(outer, outer_state, h, tokens)     final norm -> MTP depths, their head  (stage 0, the tick after)

Every layer, dense or MoE, takes a slot of the stage plan (maxmoe.parallel.pipeline_schedule.
SlotLayout). The slots hold the MoE stack (`moe_layers`, cut into stages); a dense slot reads the
dense stack from the outer parameters (`shared`), which every stage holds. A chunk's `state`
holds its router biases, a [S] mask of MoE slots and a [S] dense-layer index (-1: none); a slot
with neither is skipped. The functions (make_first, make_chunk, make_head, make_mtp) run inside
the pipeline's shard_map: each rebinds the layout to the mesh jax traces under
(Layout.on_context_mesh); they name logical axes only. docs/SHARDING.md, "Pipeline stages" has
where each piece runs and why.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import ModelConfig
from maxmoe.model.layers import Embed, RMSNorm, constrain
from maxmoe.model.transformer import COMPUTE_DTYPES, REMAT_POLICIES, Block, MTPLayer, head_logits, shift_left
from maxmoe.parallel.names import SLOT_PARAMS

STACK = "moe_layers"  # the variables cut into stages; everything else is "outer"
DENSE = "dense_layers"  # the outer variables the dense slots read


def split_stack(tree: dict) -> tuple[Any, dict]:
    """(the stack's subtree, the rest) of a params / router / stats tree."""
    return tree[STACK], {k: v for k, v in tree.items() if k != STACK}


def _positions(shape):
    b, t = shape[:2]
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def _rebind(layout):
    return None if layout is None else layout.on_context_mesh()


def make_first(config: ModelConfig, layout: Any = None):
    """first(outer_params, tokens_BT) -> x_BTD: the embedding."""
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def first(outer, tokens_BT):
        embed = Embed(config.vocab_size, config.hidden_size, dtype, config.init_std)
        return constrain(_rebind(layout), embed.apply({"params": outer["embed"]}, tokens_BT), ("batch", "seq", "embed"))

    return first


def make_chunk(config: ModelConfig, layout: Any = None):
    """chunk((params [S, ...], shared), state, x_BTD) -> ((y_BTD, seq_aux), stats [S, ...]).

    shared: {DENSE: the dense stack [first_k_dense, ...]} ({} without dense layers); state:
    {"router": [S, ...], "mask": bool [S] (MoE slots), "dense": int [S] (dense layer, -1
    none)}. seq_aux: the chunk's sequence-wise balance losses summed over its layers; stats:
    each slot's moe_stats (zeros for dense and empty slots). model.remat applies per layer,
    as in the model.

    Each slot slices its parameters from the whole chunk's (or dense stack's) inside its
    checkpointed layer and never saves the slice: the pipeline keeps a chunk's residuals for
    every item in flight, and a slice saved per layer would be a copy of the parameters per
    item (scanning over the parameters as loop inputs saves exactly that). The slice is
    recomputed in the backward from the parameters, which the pipeline does not copy.
    """
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def moe_layer(params, router, i, x_BTD):
        params_s = jax.tree.map(lambda a: checkpoint_name(a[i], SLOT_PARAMS), params)
        router_s = jax.tree.map(lambda a: a[i], router)
        block = Block(config, True, dtype, _rebind(layout))
        (y, _), variables = block.apply(
            {"params": params_s, "router": router_s}, x_BTD, _positions(x_BTD.shape), mutable=["moe_stats"]
        )
        return y, variables["moe_stats"]

    def dense_layer(dense, j, x_BTD):
        params_j = jax.tree.map(lambda a: checkpoint_name(a[j], SLOT_PARAMS), dense)
        y, _ = Block(config, False, dtype, _rebind(layout)).apply({"params": params_j}, x_BTD, _positions(x_BTD.shape))
        return y

    def slot(params, dense, router, x, inputs):
        i, on, j = inputs
        stats_shape = jax.eval_shape(moe_layer, params, router, i, x)[1]

        def zeros():
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)

        branches = [lambda x: (x, zeros()), lambda x: moe_layer(params, router, i, x)]
        kind = on.astype(jnp.int32)  # 0 empty, 1 MoE, 2 dense
        if dense is not None:
            branches.append(lambda x: (dense_layer(dense, jnp.maximum(j, 0), x), zeros()))
            kind = jnp.where(j >= 0, 2, kind)
        return jax.lax.switch(kind, branches, x)

    policies = jax.checkpoint_policies
    if config.remat == "none":
        policy = policies.save_anything_except_these_names(SLOT_PARAMS)
    else:  # none of the remat policies saves the slice: it is neither a dot's output nor a named one
        policy = REMAT_POLICIES[config.remat]
    # Checkpointed around the switch: a switch's residuals leave it as per-iteration values, which
    # the scan would stack (the chunk's parameters once per slot); the checkpoint's are its inputs.
    slot = jax.checkpoint(slot, policy=policy, prevent_cse=False)

    def chunk(params_and_shared, state, x_BTD):
        params, shared = params_and_shared
        dense, router = shared.get(DENSE), state["router"]
        slots = jnp.arange(state["mask"].shape[0])
        y, stats = jax.lax.scan(
            lambda x, inputs: slot(params, dense, router, x, inputs), x_BTD, (slots, state["mask"], state["dense"])
        )
        return (y, stats["moe"]["router"]["seq_aux"].sum()), stats

    return chunk


def make_head(config: ModelConfig, layout: Any = None, hidden_only: bool = False):
    """head(outer_params, outer_state, h_BTD, tokens_BT) -> main: float32 logits [B, T, V] of the
    final-normed h, or with hidden_only the final-normed hidden states [B, T, D] the chunked
    loss projects itself (as Transformer(hidden_only=True))."""
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def head(outer, outer_state, h_BTD, tokens_BT):
        del outer_state, tokens_BT
        normed = RMSNorm(config.rms_norm_eps).apply({"params": outer["final_norm"]}, h_BTD)
        return normed if hidden_only else head_logits(normed, outer["head"], dtype, _rebind(layout))

    return head


def make_mtp(config: ModelConfig, layout: Any = None, hidden_only: bool = False):
    """mtp(outer_params, outer_state, h_BTD, tokens_BT) -> ([per depth, as `head`'s main], stats).

    h_BTD: the last layer's output, before the final norm. stats: {"mtp_<k>": moe_stats} as
    the whole model reports them.
    """
    dtype = COMPUTE_DTYPES[config.compute_dtype]

    def mtp(outer, outer_state, h_BTD, tokens_BT):
        inner = _rebind(layout)
        positions = _positions(tokens_BT.shape)
        embed = Embed(config.vocab_size, config.hidden_size, dtype, config.init_std)
        h = RMSNorm(config.rms_norm_eps).apply({"params": outer["final_norm"]}, h_BTD)
        out, stats = [], {}
        for k in range(1, config.mtp_num_layers + 1):
            name = f"mtp_{k - 1}"
            emb = embed.apply({"params": outer["embed"]}, shift_left(tokens_BT, k))
            (h, normed_k), variables = MTPLayer(config, dtype, inner).apply(
                {"params": outer[name], "router": outer_state[name]}, h, emb, positions, mutable=["moe_stats"]
            )
            out.append(normed_k if hidden_only else head_logits(normed_k, outer["head"], dtype, inner))
            stats[name] = variables["moe_stats"]
        return out, stats

    return mtp
