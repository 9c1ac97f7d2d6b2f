"""DeepSeek-V3 router: fp32 scores, a correction bias for choice only, group-limited top-k.

Axis legend: N tokens, E routed experts, G expert groups, K chosen experts per token.

The correction bias (aux-loss-free balancing) is non-trainable state in the `router`
collection; the train step moves it by `rate * sign(mean_load - load)`. The per-expert
load and the sequence-wise balance loss of each call are written to the `moe_stats`
collection beside it, so the step can pair every bias with its own layer's load.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxmoe.model.layers import logical_param


class Routing(NamedTuple):
    # Leading dims as the logits' ([N] or [B, T]).
    expert_ids_NK: jax.Array  # int32 chosen experts
    weights_NK: jax.Array  # float32 combine weights (normalised and scaled)
    scores_NE: jax.Array  # float32 affinity scores before the bias


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis as k rounds of max / argmax (ties: the lower index first, as top_k).

    XLA's SPMD partitioner all-gathers the tokens of a sharded operand for its TopK (every
    token dim, e.g. a sequence sharded over `context`); max and argmax are reductions over
    the last axis alone, partitioned where the tokens lie. k is small (2, the groups, 8).
    """
    values, indices = [], []
    positions = jnp.arange(x.shape[-1])
    for _ in range(k):
        index = jnp.argmax(x, axis=-1)
        values.append(x.max(axis=-1))
        indices.append(index)
        x = jnp.where(positions == index[..., None], -jnp.inf, x)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1).astype(jnp.int32)


def route(logits_NE: jax.Array, bias_E: jax.Array, config) -> Routing:
    """Choose top-k experts per token: scores + bias pick, unbiased scores weigh.

    Tokens may have any leading dims ([N, E] or [B, T, E]); the routing keeps them, so a
    sequence sharded over the mesh (context parallelism) is routed where it lies.
    """
    c = config
    if c.score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits_NE)
    else:
        scores = jax.nn.softmax(logits_NE, axis=-1)
    choice = scores + bias_E
    e = scores.shape[-1]
    if c.num_expert_groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], c.num_expert_groups, e // c.num_expert_groups)
        group_score_NG = top_k(grouped, 2)[0].sum(-1)
        _, top_groups = top_k(group_score_NG, c.topk_groups)
        # A one-hot of the chosen groups (no scatter: per token, whatever its leading dims).
        keep_NG = (top_groups[..., None] == jnp.arange(c.num_expert_groups)).any(-2)
        keep_NE = jnp.repeat(keep_NG, e // c.num_expert_groups, axis=-1)
        choice = jnp.where(keep_NE, choice, -jnp.inf)
    _, expert_ids = top_k(choice, c.experts_per_token)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * c.routed_scaling_factor
    return Routing(expert_ids.astype(jnp.int32), weights, scores)


def expert_load(expert_ids_NK: jax.Array, num_experts: int) -> jax.Array:
    """Token copies routed to each expert [E] (float32)."""
    return jnp.zeros((num_experts,), jnp.float32).at[expert_ids_NK.reshape(-1)].add(1.0)


def sequence_balance_loss(scores_BTE: jax.Array, expert_ids_BTK: jax.Array, config) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss, sum_i f_i P_i averaged over sequences.

    f_i = E / (K T) * (tokens of the sequence sent to expert i); P_i = mean over the
    sequence of the scores normalised to sum to one per token. The caller multiplies by alpha.
    """
    b, t, e = scores_BTE.shape
    k = expert_ids_BTK.shape[-1]
    counts_BE = jax.vmap(lambda ids: expert_load(ids, e))(expert_ids_BTK)
    f_BE = counts_BE * e / (k * t)
    p_BE = (scores_BTE / (scores_BTE.sum(-1, keepdims=True) + 1e-20)).mean(axis=1)
    return (f_BE * p_BE).sum(-1).mean()


class Router(nn.Module):
    """Gate weights [D, E] (trainable), correction bias [E] (state); returns the routing."""

    config: Any

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> Routing:
        c = self.config
        e = c.num_experts
        w_DE = logical_param(self, "w_gate", (c.hidden_size, e), (None, None), std=c.init_std)
        bias = self.variable("router", "bias", lambda: jnp.zeros((e,), jnp.float32))
        # Routed as [B, T, E]: flattening tokens first would reshuffle a sequence-sharded batch.
        logits_BTE = x_BTD.astype(jnp.float32) @ w_DE
        routing = route(logits_BTE, jax.lax.stop_gradient(bias.value), c)
        seq_aux = sequence_balance_loss(routing.scores_NE, routing.expert_ids_NK, c)
        # Statistics for the train step and metrics; written, never read by the model. Not at
        # init, so that initialisation depends on no input (flax's lazy_init).
        load = self.variable("moe_stats", "load", lambda: jnp.zeros((e,), jnp.float32))
        aux = self.variable("moe_stats", "seq_aux", lambda: jnp.zeros((), jnp.float32))
        if not self.is_initializing():
            load.value = expert_load(jax.lax.stop_gradient(routing.expert_ids_NK), e)
            aux.value = seq_aux
        return routing
