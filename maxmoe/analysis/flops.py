"""Parameter counts, model FLOPs per token, and the hardware peak table for MFU.

    count_params(model_config)                    params_total, params_mtp, params_active
    flops_per_token(model_config, seq_len)        training FLOPs per token, MTP included
    mfu(tokens_per_s_per_device, flops_token, peak_tflops(device_kind))     None without a peak

flops_per_token = 6 x the active matmul parameters (main model with its head, each MTP depth
with the head again; the embedding lookup excluded; top-k routed and shared experts) + the
causal attention core, 3 x T x H x (qk_head_dim + v_head_dim) per layer. The other
`*_per_token` functions split it by part, by GEMM class, into what remat recomputes, context
parallelism's up-projections, pipeline pieces and the FP8 share (`fp8_flops_per_token`).
Closed forms in the model config: neither the model nor jax is needed, and tests/test_info.py
holds the counts equal to the model's own parameter shapes.

docs/PERFORMANCE.md, "Model FLOPs" has the convention in full.
"""

from __future__ import annotations

from maxmoe.analysis.assumptions import SYSTEMS
from maxmoe.analysis.recompute import block_gemm_flops, block_recompute_flops, recomputed_gemms
from maxmoe.config import ModelConfig

# Dense bf16 peak TFLOP/s per device (datasheet, without sparsity): the planner's system table.
PEAK_TFLOPS_BF16 = {name: s.peak_bf16_tflops for name, s in SYSTEMS.items()}


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
    """Training model FLOPs per token of the model's pieces (a pipeline's: pipeline_piece_flops_per_token).

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


GEMM_CLASSES = ("attention", "attention_core", "router", "dense_mlp", "shared_experts", "routed_experts", "head")


def flops_per_token_by_class(m: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training model FLOPs per token by GEMM class (main model and MTP depths together).

    attention: MLA's projections; attention_core: QK^T and PV (causal half); router; dense_mlp:
    the first_k_dense MLPs; shared_experts and routed_experts (the activated ones); head: the
    output head (once per MTP depth again) and MTP's [2D, D] projections. Sums to
    flops_per_token.
    """
    d = m.hidden_size
    layers = m.num_layers + m.mtp_num_layers  # every attention block
    moe_layers = m.num_layers - m.first_k_dense + m.mtp_num_layers
    expert = 6.0 * 3 * d * m.moe_mlp_dim
    return {
        "attention": 6.0 * _attention_params(m) * layers,
        "attention_core": 3.0
        * seq_len
        * m.num_heads
        * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        * layers,
        "router": 6.0 * d * m.num_experts * moe_layers,
        "dense_mlp": 6.0 * 3 * d * m.mlp_dim * m.first_k_dense,
        "shared_experts": expert * m.num_shared_experts * moe_layers,
        "routed_experts": expert * m.experts_per_token * moe_layers,
        "head": 6.0 * d * m.vocab_size * (1 + m.mtp_num_layers) + 6.0 * 2 * d * d * m.mtp_num_layers,
    }


def recompute_flops_per_token(m: ModelConfig, seq_len: int, expert_parallel: bool = True) -> dict[str, float]:
    """FLOPs per token that `model.remat` runs again (forward passes of GEMMs) of each GEMM class, in
    the scanned blocks only (the main model's layers, not MTP): the GEMMs the policy's saved names
    leave to recompute (maxmoe.analysis.recompute; `expert_parallel`: the dispatch and combine
    rows can be saved, as they carry their names only under a dispatch plan)."""
    dense = block_recompute_flops(m, seq_len, moe=False, expert_parallel=expert_parallel)
    moe = block_recompute_flops(m, seq_len, moe=True, expert_parallel=expert_parallel)
    moe_layers = m.num_layers - m.first_k_dense
    return {k: m.first_k_dense * dense.get(k, 0.0) + moe_layers * moe.get(k, 0.0) for k in GEMM_CLASSES if k != "head"}


def head_recompute_flops_per_token(m: ModelConfig, loss_chunk: int) -> float:
    """FLOPs per token the chunked loss runs again: with train.loss_chunk > 0 its backward projects
    each vocabulary block again (maxmoe.training.loss), a forward of the head for the main model
    and each MTP depth (2 D V each); not MTP's [2D, D] projection."""
    return 2.0 * m.hidden_size * m.vocab_size * (1 + m.mtp_num_layers) if loss_chunk > 0 else 0.0


def context_flops_per_token(m: ModelConfig, context: int) -> dict[str, float]:
    """Executed FLOPs per token that context parallelism (mesh.context = C > 1) moves between
    GEMM classes; {} for C = 1. Model FLOPs do not change.

    The latent core (maxmoe.model.attention_ops.latent_attention) makes keys and values inside
    its key loop: each device up-projects the whole sequence's latents, C x its own tokens,
    forward and again in the backward pass, and takes both gradients there: 8 C u per local
    token and attention layer, u = kv_lora_rank x heads x (qk_nope + v head dims), in the
    compute dtype ("latent_up"). The projection it replaces, 6 u per token, leaves "attention"
    (and with it FP8 credit). Where model.remat runs a scanned layer's attention core again,
    the core's forward adds 2 C u and the projection's recompute, 2 u, goes.
    """
    if context <= 1:
        return {}
    u = m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
    layers = m.num_layers + m.mtp_num_layers  # every attention block
    gemms = recomputed_gemms(m.remat, moe=True, q_lora=bool(m.q_lora_rank))  # the attention part of any block
    again = m.num_layers if "core" in gemms else 0  # scanned blocks (MTP's is not rematerialised)
    projection_again = m.num_layers if "kv_up" in gemms else 0
    return {
        "attention": -6.0 * u * layers - 2.0 * u * projection_again,
        "latent_up": 8.0 * context * u * layers + 2.0 * context * u * again,
    }


# The GEMM classes each recipe runs as FP8 GEMMs on a GPU kernel backend, by architecture
# (maxmoe.kernels.fp8_matmul's table): tensorwise's dense projections are fp8 dots, its routed
# experts go to the bf16 grouped kernel (fp8 values given as bf16); mxfp8's dense projections
# are jax.nn.scaled_matmul, which lowers to an MXFP8 GEMM on Blackwell only (elsewhere the
# dequantised values in bf16), and its routed experts run the bf16 grouped kernel; blockwise
# runs every class through fp8 dots (its grouped GEMMs as maxmoe's Triton kernels).
FP8_GEMM_CLASSES = {
    ("none", "hopper"): (),
    ("none", "blackwell"): (),
    ("tensorwise", "hopper"): ("attention", "dense_mlp", "shared_experts"),
    ("tensorwise", "blackwell"): ("attention", "dense_mlp", "shared_experts"),
    ("mxfp8", "hopper"): (),
    ("mxfp8", "blackwell"): ("attention", "dense_mlp", "shared_experts"),
    ("blockwise", "hopper"): ("attention", "dense_mlp", "shared_experts", "routed_experts"),
    ("blockwise", "blackwell"): ("attention", "dense_mlp", "shared_experts", "routed_experts"),
}


def pipeline_piece_flops_per_token(
    m: ModelConfig,
    seq_len: int,
    loss_chunk: int,
    classes: tuple[str, ...] | None = None,
    expert_parallel: bool = True,
) -> dict[str, float]:
    """Executed training FLOPs per token of the pieces a pipeline places on its stages.

    dense_layer, moe_layer: one layer, plus the GEMMs `model.remat` runs again in its backward
    (maxmoe.analysis.recompute, one forward each). head: the output head with the loss; with
    loss_chunk > 0 the chunked loss's backward projects each vocabulary block again (+2 D V).
    mtp: every MTP depth -- its [2D, D] projection, its MoE block (not rematerialised) and the
    head again, as `head`. classes: only the FLOPs of these GEMM classes
    (flops_per_token_by_class's names; the head and MTP's projection are "head").
    """

    def counted(name):
        return classes is None or name in classes

    def layer(moe: bool, again: bool) -> float:
        per_gemm = block_gemm_flops(m, seq_len, moe)
        total = sum(3.0 * f for cls, f in per_gemm.values() if counted(cls))
        if again:
            total += sum(
                f for cls, f in block_recompute_flops(m, seq_len, moe, expert_parallel).items() if counted(cls)
            )
        return total

    d = m.hidden_size
    head = 6.0 * d * m.vocab_size + 2.0 * d * m.vocab_size * (loss_chunk > 0) if counted("head") else 0.0
    projection = 6.0 * 2 * d * d if counted("head") else 0.0
    return {
        "dense_layer": layer(False, True),
        "moe_layer": layer(True, True),
        "head": head,
        "mtp": m.mtp_num_layers * (projection + layer(True, False) + head),
    }


def fp8_gemm_classes(recipe: str, arch: str) -> tuple[str, ...]:
    """The GEMM classes (flops_per_token_by_class's) `model.fp8=recipe` runs in FP8 on `arch`."""
    return FP8_GEMM_CLASSES[(recipe, arch)]


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
    "pipeline_piece_flops_per_token",
    "fp8_flops_per_token",
    "flops_per_token_by_class",
    "fp8_gemm_classes",
    "recompute_flops_per_token",
    "head_recompute_flops_per_token",
    "context_flops_per_token",
    "mfu",
]
