"""Building blocks: parameters with logical axes, RMSNorm, embedding, SwiGLU MLP.

Axis legend: B batch, T time, D embed, F mlp, V vocab.
Parameters are float32; matmuls run in the module's compute dtype, or in FP8 (`model.fp8`)
through `project`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxmoe.kernels.fp8_matmul import fp8_matmul


def logical_param(
    module: nn.Module,
    name: str,
    shape: Sequence[int],
    axes: Sequence[str | None],
    init: Callable | None = None,
    std: float = 0.02,
) -> jax.Array:
    """A float32 parameter whose dimensions carry logical axis names (for the sharding rules)."""
    init = init or nn.initializers.normal(stddev=std)
    return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), jnp.float32)


def constrain(layout: Any, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Ask the layout (built by maxmoe.parallel.layout) to shard an activation; identity without one."""
    return x if layout is None else layout.constrain(x, tuple(axes))


def project(
    x: jax.Array,
    w: jax.Array,
    fp8: str = "none",
    layout: Any = None,
    axes: tuple[Sequence[str | None], Sequence[str | None]] | None = None,
    contract: int = 1,
) -> jax.Array:
    """x [..., K...] @ w [K..., N...] over x's last `contract` dims and w's first.

    fp8="none": the plain matmul (contract 1). Else every GEMM of forward and backward in that
    FP8 recipe (maxmoe.kernels.fp8_matmul) with x seen as [..., K] and w as [K, N]; given the
    logical axes of x and w, `axes`, the layout may run the recipe's kernels on each device's
    shards (`Layout.fp8_projection`).
    """
    if fp8 == "none":
        return x @ w
    lead = x.shape[:-contract]
    k = math.prod(x.shape[len(lead) :])
    x_K, w_KN = x.reshape(*lead, k), w.reshape(k, -1)
    fn = None if layout is None or axes is None else layout.fp8_projection(fp8, *axes, contract)
    out = fn(x_K, w_KN) if fn is not None else fp8_matmul(x_K, w_KN, fp8)
    return out.reshape(*lead, *w.shape[contract:])


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, with a learned scale."""

    eps: float = 1e-6
    axis: str | None = "embed"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = logical_param(self, "scale", (x.shape[-1],), (self.axis,), nn.initializers.ones)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(x.dtype)


class Embed(nn.Module):
    """Token embedding table [V, D]."""

    vocab_size: int
    hidden_size: int
    dtype: Any = jnp.float32
    std: float = 0.02
    layout: Any = None

    @nn.compact
    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        table_VD = logical_param(
            self, "embedding", (self.vocab_size, self.hidden_size), ("vocab", "embed"), std=self.std
        )
        if self.layout is not None:
            table_VD = self.layout.lookup_table(table_VD)
        return jnp.take(table_VD, tokens_BT, axis=0).astype(self.dtype)


class SwiGLU(nn.Module):
    """Dense gated MLP: down(silu(x @ gate) * (x @ up))."""

    hidden_size: int
    mlp_dim: int
    dtype: Any = jnp.float32
    std: float = 0.02
    layout: Any = None
    fp8: str = "none"  # model.fp8

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        d, f = self.hidden_size, self.mlp_dim
        w_gate_DF = logical_param(self, "w_gate", (d, f), ("embed", "mlp"), std=self.std).astype(self.dtype)
        w_up_DF = logical_param(self, "w_up", (d, f), ("embed", "mlp"), std=self.std).astype(self.dtype)
        w_down_FD = logical_param(self, "w_down", (f, d), ("mlp", "embed"), std=self.std).astype(self.dtype)
        x = x_BTD.astype(self.dtype)
        up_axes = (("batch", "seq", "embed"), ("embed", "mlp"))
        gate = project(x, w_gate_DF, self.fp8, self.layout, up_axes)
        h_BTF = nn.silu(gate) * project(x, w_up_DF, self.fp8, self.layout, up_axes)
        h_BTF = constrain(self.layout, h_BTF, ("batch", "seq", "mlp"))
        return project(h_BTF, w_down_FD, self.fp8, self.layout, (("batch", "seq", "mlp"), ("mlp", "embed")))
