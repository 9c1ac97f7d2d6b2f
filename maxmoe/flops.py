"""Parameter counts, model FLOPs per token, and the hardware peak table for MFU.

Counts are closed forms in the model config, module by module, so this needs neither the
model nor jax; tests/test_info.py holds them equal to the model's own parameter shapes.
FLOPs follow the usual convention:

    flops_per_token = 6 * (active matmul parameters of the main model, output head included,
                           embedding lookup excluded)
                    + 6 * (active matmul parameters of each MTP depth, its own head matmul
                           included since the shared head runs once more per depth)
                    + attention core: 6 * (causal) * L * T * H * (qk_head_dim + v_head_dim)
                      per token for each attention layer, with the causal half
                      (T/2 keys on average): 3 * T * H * (dk + dv) per layer.

6 = 2 (multiply-add) x 3 (forward + backward for inputs + backward for weights).
Activated experts: top-k routed experts + shared experts of each MoE layer.

With `model.fp8` set, fp8_flops_per_token is the part of those FLOPs that runs as FP8 GEMMs:
every attention projection, the dense MLPs, the shared and the activated routed experts, in
the main model and in each MTP depth; the router, the attention core, the head and MTP's
[2D, D] projection stay in the compute dtype (maxmoe.kernels.fp8_matmul's recipes).
"""

from __future__ import annotations

from maxmoe.config import ModelConfig

# Dense bf16 peak TFLOP/s per device (datasheet, without sparsity).
PEAK_TFLOPS_BF16 = {
    "h100": 989.0,
    "h200": 989.0,
    "b200": 2250.0,
    "gb200": 2500.0,
    "gb300": 2500.0,
}


def peak_tflops(device_kind: str) -> float | None:
    """Datasheet dense bf16 peak for a jax device_kind string, or None if unknown."""
    kind = device_kind.lower().replace(" ", "").replace("-", "")
    for name in sorted(PEAK_TFLOPS_BF16, key=len, reverse=True):  # gb200 before b200, which it contains
        if name in kind:
            return PEAK_TFLOPS_BF16[name]
    return None


def count_params(m: ModelConfig) -> dict[str, int]:
    """Trainable parameter counts: params_total (main model), params_mtp (MTP modules beyond the
    shared embedding and head), params_active (per token, main model, embedding and head included).

    Router correction biases are state, not parameters, and are not counted (nor are they in
    the published 671B figure)."""
    d = m.hidden_size
    latent_norms = m.q_lora_rank + m.kv_lora_rank  # q_norm (absent with q_lora_rank 0) and kv_norm scales
    layer = 2 * d + _attention_params(m) + latent_norms  # attn_norm, mlp_norm, attention
    dense_layer = layer + 3 * d * m.mlp_dim
    expert = 3 * d * m.moe_mlp_dim
    moe_layer = layer + d * m.num_experts + (m.num_experts + m.num_shared_experts) * expert  # router, experts
    moe_layers = m.num_layers - m.first_k_dense
    embedding_and_head = 2 * m.vocab_size * d
    total = embedding_and_head + m.first_k_dense * dense_layer + moe_layers * moe_layer + d  # final_norm
    # Each depth: emb_norm, hidden_norm, out_norm, w_proj [2D, D] and one MoE layer.
    mtp = m.mtp_num_layers * (3 * d + 2 * d * d + moe_layer)
    inactive = moe_layers * (m.num_experts - m.experts_per_token) * expert
    return {"params_total": total, "params_mtp": mtp, "params_active": total - inactive}


def _attention_params(m: ModelConfig) -> int:
    d, h = m.hidden_size, m.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = d * m.q_lora_rank + m.q_lora_rank * h * qk if m.q_lora_rank else d * h * qk
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + h * m.v_head_dim * d


def _moe_active_matmul_params(m: ModelConfig) -> int:
    return (
        3 * m.hidden_size * m.moe_mlp_dim * (m.experts_per_token + m.num_shared_experts) + m.hidden_size * m.num_experts
    )


def flops_per_token_by_part(m: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training model FLOPs per token of the model's pieces, as a pipeline places them.

    dense_layers: the first_k_dense dense layers together; moe_layer: one MoE layer; head_and_mtp:
    the output head and the MTP depths. flops_per_token = dense_layers + (num_layers -
    first_k_dense) x moe_layer + head_and_mtp.
    """
    d = m.hidden_size
    attn = _attention_params(m)
    core = 3 * seq_len * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    moe_layer = 6.0 * (attn + _moe_active_matmul_params(m)) + core
    head = 6.0 * d * m.vocab_size
    mtp_depth = 6.0 * 2 * d * d + moe_layer + head  # projection [2D, D], one MoE layer, the head again
    return {
        "dense_layers": m.first_k_dense * (6.0 * (attn + 3 * d * m.mlp_dim) + core),
        "moe_layer": moe_layer,
        "head_and_mtp": head + m.mtp_num_layers * mtp_depth,
    }


def fp8_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token of the GEMMs `model.fp8` runs in FP8 (0 with fp8 none)."""
    if m.fp8 == "none":
        return 0.0
    attn = _attention_params(m)
    experts = 3 * m.hidden_size * m.moe_mlp_dim * (m.experts_per_token + m.num_shared_experts)
    moe_layers = m.num_layers - m.first_k_dense + m.mtp_num_layers
    return 6.0 * (m.first_k_dense * (attn + 3 * m.hidden_size * m.mlp_dim) + moe_layers * (attn + experts))


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training model FLOPs per token (see the module docstring), MTP included."""
    part = flops_per_token_by_part(m, seq_len)
    return part["dense_layers"] + (m.num_layers - m.first_k_dense) * part["moe_layer"] + part["head_and_mtp"]


def mfu(tokens_per_s_per_device: float, flops_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None without a peak."""
    if not peak:
        return None
    return tokens_per_s_per_device * flops_token / (peak * 1e12)


__all__ = [
    "PEAK_TFLOPS_BF16",
    "peak_tflops",
    "count_params",
    "flops_per_token",
    "flops_per_token_by_part",
    "fp8_flops_per_token",
    "mfu",
]
