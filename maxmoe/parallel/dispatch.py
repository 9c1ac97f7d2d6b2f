"""Routed-expert computation: token copies sorted by expert, grouped SwiGLU, weighted combine.

Axis legend: B batch, T time, D embed, E experts, F expert_mlp, N tokens, K top-k, M rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxmoe.parallel.grouped_matmul import grouped_matmul


def expert_swiglu(x_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, backend="ragged_dot"):
    """SwiGLU of each row through its group's expert; rows sorted by expert."""
    gate = grouped_matmul(x_MD, w_gate_EDF, group_sizes_E, backend=backend)
    up = grouped_matmul(x_MD, w_up_EDF, group_sizes_E, backend=backend)
    return grouped_matmul(jax.nn.silu(gate) * up, w_down_EFD, group_sizes_E, backend=backend)


def local_routed_experts(x_ND, expert_ids_NK, weights_NK, w_gate_EDF, w_up_EDF, w_down_EFD, backend="ragged_dot"):
    """All experts on one device: sort the N*K token copies by expert, grouped matmul, unsort, combine."""
    n, k = expert_ids_NK.shape
    e = w_gate_EDF.shape[0]
    flat_ids = expert_ids_NK.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows_MD = x_ND[order // k]
    group_sizes_E = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    out_MD = expert_swiglu(rows_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, backend)
    copies_NKD = jnp.zeros_like(out_MD).at[order].set(out_MD).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", copies_NKD, weights_NK.astype(copies_NKD.dtype))


def routed_experts(x_BTD, expert_ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, *, plan=None):
    """Routed MoE output [B, T, D] and the fraction of token copies dropped.

    `plan` is None on one device (all experts local); otherwise it selects the
    expert-parallel strategy and carries the mesh.
    """
    b, t, d = x_BTD.shape
    k = expert_ids_BTK.shape[-1]
    if plan is None:
        y = local_routed_experts(x_BTD.reshape(b * t, d), expert_ids_BTK.reshape(b * t, k),
                                 weights_BTK.reshape(b * t, k), w_gate_EDF, w_up_EDF, w_down_EFD)
        return y.reshape(b, t, d), jnp.zeros((), jnp.float32)
    return plan.routed_experts(x_BTD, expert_ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD)
