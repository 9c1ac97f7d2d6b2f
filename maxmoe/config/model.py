"""model: the network's architecture hyper-parameters (defaults: a tiny model) and their checks."""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field
from maxmoe.parallel.names import REMAT_CHOICES

ATTENTION_IMPLEMENTATIONS = ("xla", "chunked", "triton", "cudnn", "tokamax")  # model/attention_ops, kernels/attention
FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8")  # maxmoe.kernels.fp8_matmul
MAX_TOKEN_ID = 2**31 - 1  # tokens are int32 on the device


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The network: DeepSeek-V3 architecture hyper-parameters (defaults: a tiny model)."""

    vocab_size: int = field(
        260, gt=0, auto=True, doc="token ids 0..N-1 (byte corpus: 256 bytes + 4 specials); auto: from the data"
    )
    hidden_size: int = field(64, gt=0, doc="model width D (DeepSeek-V3: 7168)")
    num_layers: int = field(3, gt=0, doc="main-model layers (dense + MoE)")
    first_k_dense: int = field(1, ge=0, doc="leading layers with a dense SwiGLU MLP")
    mlp_dim: int = field(128, gt=0, doc="dense SwiGLU hidden size (intermediate_size)")
    moe_mlp_dim: int = field(32, gt=0, doc="per-expert hidden size (moe_intermediate_size)")
    num_heads: int = field(4, gt=0, doc="attention heads")
    q_lora_rank: int = field(32, ge=0, doc="0: plain query projection")
    kv_lora_rank: int = field(32, gt=0, doc="compressed key/value latent width (MLA)")
    qk_nope_head_dim: int = field(16, gt=0, doc="query/key head dims without rotary embedding")
    qk_rope_head_dim: int = field(8, gt=0, doc="query/key head dims with rotary embedding (decoupled RoPE)")
    v_head_dim: int = field(16, gt=0, doc="value head dims")
    num_experts: int = field(8, gt=0, doc="routed experts (n_routed_experts)")
    num_shared_experts: int = field(1, ge=0, doc="experts every token passes through")
    experts_per_token: int = field(2, gt=0, doc="routed experts per token (top-k)")
    num_expert_groups: int = field(4, gt=0, doc="n_group for group-limited routing")
    topk_groups: int = field(2, gt=0, doc="groups kept per token (topk_group)")
    norm_topk_prob: bool = field(True, doc="normalise the chosen experts' scores to sum to 1")
    routed_scaling_factor: float = field(2.5, gt=0, doc="multiplies the routed experts' combine weights")
    score_func: str = field("sigmoid", choices=("sigmoid", "softmax"), doc="router affinity (DeepSeek-V3: sigmoid)")
    rms_norm_eps: float = field(1e-6, gt=0, doc="RMSNorm epsilon")
    rope_theta: float = field(10000.0, gt=0, doc="RoPE base")
    rope_scaling: str = field("yarn", choices=("none", "yarn"), doc="none: plain RoPE; yarn: context extension")
    rope_factor: float = field(4.0, gt=0, doc="yarn: context extension factor")
    rope_original_max_position: int = field(64, gt=0, doc="yarn: context length before extension")
    rope_beta_fast: float = field(32.0, gt=0, doc="yarn: rotations above which frequencies are kept")
    rope_beta_slow: float = field(1.0, gt=0, doc="yarn: rotations below which frequencies are interpolated")
    rope_mscale: float = field(1.0, ge=0, doc="yarn: attention temperature coefficient")
    rope_mscale_all_dim: float = field(1.0, ge=0, doc="yarn: temperature coefficient shared by all dims")
    max_position_embeddings: int = field(256, gt=0, doc="longest context the model is built for")
    mtp_num_layers: int = field(1, ge=0, doc="multi-token prediction depth")
    mtp_loss_weight: float = field(0.3, ge=0, doc="weight of the mean MTP loss in the total")
    compute_dtype: str = field("bfloat16", choices=("bfloat16", "float32"), doc="matmul dtype (params stay float32)")
    remat: str = field(
        "none",
        choices=REMAT_CHOICES,
        doc="what the backward pass keeps rather than recomputes; the table in maxmoe.model.transformer",
    )
    attention: str = field(
        "auto",
        choices=("auto",) + ATTENTION_IMPLEMENTATIONS,
        doc="auto: on NVIDIA GPUs the core measured fastest there (maxmoe/kernels/rates.yaml), else cuDNN "
        "where it can run; chunked elsewhere (maxmoe.kernels.choice)",
    )
    attention_chunk: int = field(512, gt=0, doc="chunked attention: block length (largest divisor of T up to this)")
    init_std: float = field(0.02, gt=0, doc="normal init std of weight matrices")
    fp8: str = field(
        "none",
        choices=("none",) + FP8_RECIPES,
        doc="FP8 GEMMs (forward and both gradients) in the dense projections and experts: tensorwise "
        "(per-tensor scales), blockwise (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks), "
        "mxfp8 (e8m0 scale per 32); attention core, norms, router, embedding and head stay bf16/f32",
    )


def validate_model(m: ModelConfig) -> None:
    """Checks among the model's own keys."""
    if m.first_k_dense > m.num_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} exceeds model.num_layers={m.num_layers}")
    if m.experts_per_token > m.num_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} exceeds model.num_experts={m.num_experts}")
    if m.num_experts % m.num_expert_groups:
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by model.num_expert_groups={m.num_expert_groups}"
        )
    if m.topk_groups > m.num_expert_groups:
        raise ConfigError(f"model.topk_groups={m.topk_groups} exceeds model.num_expert_groups={m.num_expert_groups}")
    per_group = m.num_experts // m.num_expert_groups
    if m.num_expert_groups > 1 and per_group < 2 and m.score_func == "sigmoid":
        raise ConfigError(
            f"group-limited routing needs >= 2 experts per group (group score = top-2 sum); "
            f"got {per_group} with model.num_expert_groups={m.num_expert_groups}"
        )
    if m.topk_groups * per_group < m.experts_per_token:
        raise ConfigError(
            f"model.topk_groups={m.topk_groups} groups of {per_group} experts cannot supply "
            f"model.experts_per_token={m.experts_per_token}"
        )
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs)")


def check_model(config) -> None:
    """The model's checks that read other sections: multi-token prediction needs targets inside
    the sequence, the vocabulary fits int32 ids, the sequence fits the positions."""
    m, t = config.model, config.train
    validate_model(m)
    if m.mtp_num_layers >= t.seq_len:
        # Depth k predicts the token k + 1 ahead: at depth seq_len - 1 or more no position has a target.
        raise ConfigError(
            f"model.mtp_num_layers={m.mtp_num_layers} must be below train.seq_len={t.seq_len} "
            f"(multi-token prediction depth k needs a target k + 1 tokens ahead inside the sequence)"
        )
    if isinstance(m.vocab_size, int) and m.vocab_size > MAX_TOKEN_ID + 1:
        raise ConfigError(f"model.vocab_size={m.vocab_size}: must be <= {MAX_TOKEN_ID + 1} (token ids are int32)")
    if m.max_position_embeddings < t.seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}"
        )
