"""Autoregressive decoding with a latent KV cache: what Multi-head Latent Attention was made for.

    cache = init_cache(config, batch=1, length=prompt_len + new_tokens)
    logits_BTV, cache = decode(config, variables, prompt_BT, cache, start=0)     # prefill
    logits_BTV, cache = decode(config, variables, token_B1, cache, start=prompt_len)  # then one at a time

Per layer and position the cache holds the normalised latent and the rotated rope key shared by
all heads, not per-head keys and values; attention runs in the absorbed form (queries taken into
the latent space through w_k_up, the attention-weighted latents expanded by w_v_up). Everything
else is the training model's own modules, so the cached logits equal the full forward's
(`maxmoe.model.logits`) up to float rounding. MTP layers are not used.

docs/ARCHITECTURE.md, "Decoding" has the cache's sizes and the absorbed form.
Axis legend: B batch, T new tokens, S cache positions, D embed, H heads, K head dim,
L latent (kv_lora_rank), R rope dim, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxmoe.config import ModelConfig
from maxmoe.model.layers import RMSNorm, SwiGLU
from maxmoe.model.moe import MoE
from maxmoe.model.rope import apply_rope, attention_scale
from maxmoe.model.transformer import COMPUTE_DTYPES


def stacks(config: ModelConfig) -> dict[str, tuple[int, bool]]:
    """The model's scanned layer stacks: name -> (layers, is MoE), in order."""
    out = {}
    if config.first_k_dense:
        out["dense_layers"] = (config.first_k_dense, False)
    if config.num_layers > config.first_k_dense:
        out["moe_layers"] = (config.num_layers - config.first_k_dense, True)
    return out


def init_cache(config: ModelConfig, batch: int, length: int) -> dict:
    """An empty cache for `length` positions: per stack, latent [layers, B, S, L] and rope_key [layers, B, S, R]."""
    dtype = COMPUTE_DTYPES[config.compute_dtype]
    return {
        name: {
            "latent": jnp.zeros((layers, batch, length, config.kv_lora_rank), dtype),
            "rope_key": jnp.zeros((layers, batch, length, config.qk_rope_head_dim), dtype),
        }
        for name, (layers, _) in stacks(config).items()
    }


def _norm(config: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    return RMSNorm(config.rms_norm_eps).apply({"params": params}, x)


def cached_attention(config: ModelConfig, p: dict, x_BTD, positions_BT, latent_BSL, rope_key_BSR, start):
    """MLA for T new positions against the cache; returns (output [B, T, D], latent, rope_key) with the new entries."""
    c, dtype = config, COMPUTE_DTYPES[config.compute_dtype]
    nope = c.qk_nope_head_dim

    def weight(name):
        return p[name].astype(dtype)

    x = x_BTD.astype(dtype)
    if c.q_lora_rank:
        q_latent = _norm(c, p["q_norm"], x @ weight("w_q_down"))
        q_BTHK = jnp.einsum("btl,lhk->bthk", q_latent, weight("w_q_up"))
    else:
        q_BTHK = jnp.einsum("btd,dhk->bthk", x, weight("w_q"))
    q_rope_BTHR = apply_rope(q_BTHK[..., nope:], positions_BT, c)
    new_latent_BTL = _norm(c, p["kv_norm"], x @ weight("w_kv_down"))
    new_rope_BTR = apply_rope((x @ weight("w_k_rope"))[:, :, None, :], positions_BT, c)[:, :, 0, :]
    latent_BSL = jax.lax.dynamic_update_slice(latent_BSL, new_latent_BTL.astype(latent_BSL.dtype), (0, start, 0))
    rope_key_BSR = jax.lax.dynamic_update_slice(rope_key_BSR, new_rope_BTR.astype(rope_key_BSR.dtype), (0, start, 0))

    # Absorbed: q_nope . (latent @ w_k_up) = (q_nope @ w_k_up^T) . latent, per head.
    q_latent_BTHL = jnp.einsum("bthk,lhk->bthl", q_BTHK[..., :nope], weight("w_k_up"))
    scores_BHTS = jnp.einsum("bthl,bsl->bhts", q_latent_BTHL, latent_BSL, preferred_element_type=jnp.float32)
    scores_BHTS += jnp.einsum("bthr,bsr->bhts", q_rope_BTHR, rope_key_BSR, preferred_element_type=jnp.float32)
    scores_BHTS *= attention_scale(c)
    visible_BTS = jnp.arange(latent_BSL.shape[1])[None, None, :] <= positions_BT[:, :, None]
    scores_BHTS = jnp.where(visible_BTS[:, None], scores_BHTS, jnp.finfo(jnp.float32).min)
    probs_BHTS = jax.nn.softmax(scores_BHTS, axis=-1).astype(dtype)
    out_latent_BTHL = jnp.einsum("bhts,bsl->bthl", probs_BHTS, latent_BSL.astype(dtype))
    out_BTHK = jnp.einsum("bthl,lhk->bthk", out_latent_BTHL, weight("w_v_up"))
    return jnp.einsum("bthk,hkd->btd", out_BTHK, weight("w_out")), latent_BSL, rope_key_BSR


def _block(config: ModelConfig, moe: bool, p: dict, router: dict, x_BTD, positions_BT, cache: dict, start):
    """One decoder layer, as `maxmoe.model.transformer.Block`, with cached attention."""
    dtype = COMPUTE_DTYPES[config.compute_dtype]
    attn_BTD, latent, rope_key = cached_attention(
        config,
        p["attention"],
        _norm(config, p["attn_norm"], x_BTD),
        positions_BT,
        cache["latent"],
        cache["rope_key"],
        start,
    )
    h = x_BTD + attn_BTD.astype(x_BTD.dtype)
    mlp_in = _norm(config, p["mlp_norm"], h)
    if moe:
        y, _ = MoE(config, dtype).apply({"params": p["moe"], "router": router["moe"]}, mlp_in, mutable=["moe_stats"])
    else:
        y = SwiGLU(config.hidden_size, config.mlp_dim, dtype, config.init_std).apply({"params": p["mlp"]}, mlp_in)
    return h + y.astype(h.dtype), {"latent": latent, "rope_key": rope_key}


def decode(config: ModelConfig, variables: dict, tokens_BT, cache: dict, start) -> tuple[jax.Array, dict]:
    """Logits [B, T, V] (float32) of `tokens_BT` at positions start..start+T-1, and the cache with them added.

    `variables` are the training model's {'params', 'router'}; `start` may be traced (one
    compiled program serves every decoding step).
    """
    variables = nn.unbox(variables)
    params, router = variables["params"], variables.get("router", {})
    dtype = COMPUTE_DTYPES[config.compute_dtype]
    b, t = tokens_BT.shape
    positions_BT = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    x = jnp.take(params["embed"]["embedding"], tokens_BT, axis=0).astype(dtype)
    new_cache = {}
    for name, (_, moe) in stacks(config).items():

        def layer(x, per_layer, moe=moe):
            p, r, layer_cache = per_layer
            return _block(config, moe, p, r, x, positions_BT, layer_cache, start)

        x, new_cache[name] = jax.lax.scan(layer, x, (params[name], router.get(name, {}), cache[name]))
    normed_BTD = _norm(config, params["final_norm"], x)
    logits_BTV = jnp.einsum(
        "btd,dv->btv", normed_BTD.astype(dtype), params["head"].astype(dtype), preferred_element_type=jnp.float32
    )
    return logits_BTV, new_cache
