"""DeepSeekMoE layer: shared experts plus routed experts, dispatched by maxmoe.parallel.

Axis legend: B batch, T time, D embed, E experts, F expert_mlp, N tokens, K top-k.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxmoe.model.layers import SwiGLU, logical_param
from maxmoe.model.router import Router
from maxmoe.parallel import dispatch


class MoE(nn.Module):
    """y = shared_experts(x) + sum_k weight_k * expert_k(x)."""

    config: Any  # ModelConfig
    dtype: Any = jnp.float32
    layout: Any = None  # from maxmoe.parallel.layout; carries the dispatch plan

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        c = self.config
        e, d, f = c.num_experts, c.hidden_size, c.moe_mlp_dim
        routing = Router(c, name="router")(x_BTD)
        axes = dispatch.EXPERT_WEIGHT_AXES
        w_gate_EDF = logical_param(self, "w_gate", (e, d, f), axes["w_gate"], std=c.init_std)
        w_up_EDF = logical_param(self, "w_up", (e, d, f), axes["w_up"], std=c.init_std)
        w_down_EFD = logical_param(self, "w_down", (e, f, d), axes["w_down"], std=c.init_std)
        b, t, _ = x_BTD.shape
        plan = None if self.layout is None else self.layout.dispatch_plan
        # One device: the layout's resolved grouped GEMM; no layout (model-only use): XLA's.
        grouped = "ragged_dot" if self.layout is None else self.layout.grouped_matmul.name
        routed_BTD, dropped = dispatch.routed_experts(
            x_BTD.astype(self.dtype),
            routing.expert_ids_NK.reshape(b, t, -1),
            routing.weights_NK.reshape(b, t, -1),
            w_gate_EDF.astype(self.dtype),
            w_up_EDF.astype(self.dtype),
            w_down_EFD.astype(self.dtype),
            plan=plan,
            grouped_matmul=grouped,
            fp8=c.fp8,
        )
        dropped_var = self.variable("moe_stats", "dropped", lambda: jnp.zeros((), jnp.float32))
        if not self.is_initializing():
            dropped_var.value = dropped
        out = routed_BTD
        if c.num_shared_experts:
            shared = SwiGLU(d, f * c.num_shared_experts, self.dtype, c.init_std, self.layout, c.fp8, name="shared")
            out = out + shared(x_BTD)
        return out
