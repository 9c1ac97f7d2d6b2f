"""Multi-head Latent Attention (DeepSeek-V2/V3).

Queries go through a low-rank latent (q_lora_rank; 0 means a plain projection). Keys and
values come from one compressed latent of kv_lora_rank, normalised, then expanded per head.
Each head's query/key is [nope | rope]: the rope part of the key is one vector shared by all
heads (decoupled RoPE), so the cache would hold only the latent and one rope key.

Axis legend: B batch, T query time, S key time, D embed, H heads, K head dim, L latent.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxmoe.kernels.attention import kernel, length_problem
from maxmoe.kernels.choice import resolve_attention, target
from maxmoe.model.attention_ops import (
    chunked_attention,
    latent_attention_backward,
    latent_attention_forward,
    xla_attention,
)
from maxmoe.model.layers import RMSNorm, constrain, logical_param, project
from maxmoe.model.rope import apply_rope, attention_scale


def attention_core(config, layout: Any = None):
    """fn(q, k, v, scale) for `config.attention` (resolved by the layout; no layout: this process's platform)."""
    if layout is not None:
        name = layout.attention.name
    else:
        name = resolve_attention(config.attention, *target(), config.compute_dtype).name
    if name == "xla":
        return xla_attention
    if name == "chunked":
        return lambda q, k, v, scale: chunked_attention(q, k, v, scale, config.attention_chunk)
    if layout is not None:
        return layout.attention_fn(name)
    return lambda q, k, v, scale: kernel(name)(q, k, v, scale, interpret=jax.default_backend() != "gpu")


def attention_for_length(config, seq_len: int):
    """`config` (a ModelConfig), or a copy with the `xla` core where the kernel its attention
    resolves to on this process's platform cannot take `seq_len` tokens; a warning says so."""
    name = resolve_attention(config.attention, *target(), config.compute_dtype).name
    problem = length_problem(name, seq_len)
    if not problem:
        return config
    warnings.warn(f"attention {name} cannot run this call, xla attention runs instead: {problem}", stacklevel=3)
    return dataclasses.replace(config, attention="xla")


class MLA(nn.Module):
    """Multi-head latent attention over a causal sequence."""

    config: Any  # ModelConfig
    dtype: Any = jnp.float32
    layout: Any = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array) -> jax.Array:
        c = self.config
        d, h, nope, rope, v = c.hidden_size, c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        std, dt = c.init_std, self.dtype

        def param(name, shape, axes):
            return logical_param(self, name, shape, axes, std=std).astype(dt)

        def mm(x, x_axes, w, w_axes, equation=None):
            """x [B, T, K...] times w [K..., N...]: `equation` (or x @ w) for model.fp8=none, else the
            recipe's FP8 GEMMs; the attention core stays out of FP8."""
            if c.fp8 == "none":
                return x @ w if equation is None else jnp.einsum(equation, x, w)
            return project(x, w, c.fp8, self.layout, (x_axes, w_axes), contract=len(x_axes) - 2)

        def proj(x, x_axes, name, shape, w_axes, equation=None):
            return mm(x, x_axes, param(name, shape, w_axes), w_axes, equation)

        btd, up = ("batch", "seq", "embed"), "btl,lhk->bthk"
        bthk = ("batch", "seq", "heads", "head_dim")
        x = x_BTD.astype(dt)
        if c.q_lora_rank:
            q_latent = proj(x, btd, "w_q_down", (d, c.q_lora_rank), ("embed", "q_lora"))
            q_latent = RMSNorm(c.rms_norm_eps, "q_lora", name="q_norm")(q_latent)
            q_shape, q_axes = (c.q_lora_rank, h, nope + rope), ("q_lora", "heads", "head_dim")
            q_BTHK = proj(q_latent, ("batch", "seq", "q_lora"), "w_q_up", q_shape, q_axes, up)
        else:
            q_BTHK = proj(x, btd, "w_q", (d, h, nope + rope), ("embed", "heads", "head_dim"), "btd,dhk->bthk")
        q_BTHK = constrain(self.layout, q_BTHK, bthk)
        q_nope, q_rope = q_BTHK[..., :nope], q_BTHK[..., nope:]

        kv_latent = proj(x, btd, "w_kv_down", (d, c.kv_lora_rank), ("embed", "kv_lora"))
        kv_latent = RMSNorm(c.rms_norm_eps, "kv_lora", name="kv_norm")(kv_latent)
        k_rope_BT1R = proj(x, btd, "w_k_rope", (d, rope), ("embed", "head_dim"))[:, :, None, :]
        latent_axes, up_axes = ("batch", "seq", "kv_lora"), ("kv_lora", "heads", "head_dim")
        w_k_up = param("w_k_up", (c.kv_lora_rank, h, nope), up_axes)
        w_v_up = param("w_v_up", (c.kv_lora_rank, h, v), up_axes)

        def materialised(q, positions, latent_BSL, k_rope_BSR, w_k_up, w_v_up):
            """Keys and values up-projected for the whole sequence, then the attention core."""
            k_nope = mm(latent_BSL, latent_axes, w_k_up, up_axes, up)
            v_BSHK = mm(latent_BSL, latent_axes, w_v_up, up_axes, up)
            k_rope_BS1R = k_rope_BSR[:, :, None, :]
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope_BS1R, k_nope.shape[:3] + (rope,))], axis=-1)
            k = constrain(self.layout, k, bthk)
            out = attention_core(c, self.layout)(q, k, v_BSHK, attention_scale(c))
            return constrain(self.layout, out, bthk)

        q = jnp.concatenate([q_nope, apply_rope(q_rope, positions_BT, c)], axis=-1)
        k_rope_BTR = apply_rope(k_rope_BT1R, positions_BT, c)[:, :, 0]
        # The layout may run the core on the latents itself (context parallelism: they travel,
        # keys and values are made inside its key loop); else keys and values are materialised.
        blocks = {"scale": attention_scale(c), "block": c.attention_chunk}
        forward = functools.partial(latent_attention_forward, **blocks)
        backward = functools.partial(latent_attention_backward, **blocks)
        core = None if self.layout is None else self.layout.latent_attention(forward, backward)
        out_BTHK = (core or materialised)(q, positions_BT, kv_latent, k_rope_BTR, w_k_up, w_v_up)
        return proj(out_BTHK, bthk, "w_out", (h, v, d), ("heads", "head_dim", "embed"), "bthk,hkd->btd")
