"""DeepSeek-V3 config.json (release or transformers 5.x key style) <-> maxmoe ModelConfig."""

from __future__ import annotations

from typing import Any

from maxmoe.config import ConfigError, ModelConfig, UserError, build_model_config


def _get(hf: dict, key: str, default: Any = ..., *, null: Any = ..., where: str = "config.json") -> Any:
    """hf[key]; `default` when the key is absent and `null` when it is null (else a one-line error)."""
    if key not in hf:
        if default is ...:
            raise UserError(f"{where}: missing required key '{key}'")
        return default
    if hf[key] is None:
        if null is ...:
            raise UserError(f"{where}: key '{key}' is null")
        return null
    return hf[key]


def _number(mapping: dict, key: str, where: str, default: Any = ...) -> float:
    """mapping[key] as a float; a one-line error when it is not a JSON number."""
    value = _get(mapping, key, default, where=where)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: '{key}' is {value!r}, expected a number")
    return float(value)


def _integer(mapping: dict, key: str, where: str) -> int:
    value = _get(mapping, key, where=where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: '{key}' is {value!r}, expected an integer")
    return value


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A maxmoe ModelConfig from a DeepSeek-V3 config.json (release or transformers 5.x keys)."""
    if not isinstance(hf, dict):
        raise UserError(f"{where}: expected a JSON object of config keys, not a {type(hf).__name__}")
    model_type = hf.get("model_type", "deepseek_v3")
    if model_type != "deepseek_v3":
        raise UserError(f"{where}: model_type {model_type!r} is not supported (expected deepseek_v3)")
    for key, expected in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("moe_layer_freq", 1),
        ("tie_word_embeddings", False),
    ):
        if key in hf and hf[key] is not None and hf[key] != expected:
            raise UserError(f"{where}: {key}={hf[key]!r} is not supported (maxmoe needs {expected!r})")
    if hf.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
        raise UserError(f"{where}: topk_method={hf['topk_method']!r} is not supported (maxmoe routes as noaux_tc)")
    heads = _integer(hf, "num_attention_heads", where)
    if hf.get("num_key_value_heads") not in (None, heads):
        raise UserError(
            f"{where}: num_key_value_heads={hf['num_key_value_heads']} must equal num_attention_heads "
            f"({heads}) in multi-head latent attention"
        )
    layers = _integer(hf, "num_hidden_layers", where)

    def need(key, null=...):
        return _get(hf, key, null=null, where=where)

    model = dict(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        num_layers=layers,
        first_k_dense=min(_integer(hf, "first_k_dense_replace", where), layers),
        mlp_dim=need("intermediate_size"),
        moe_mlp_dim=need("moe_intermediate_size"),
        num_heads=heads,
        q_lora_rank=need("q_lora_rank", null=0),
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        num_experts=need("n_routed_experts"),
        num_shared_experts=need("n_shared_experts", null=0),
        experts_per_token=need("num_experts_per_tok"),
        num_expert_groups=need("n_group", null=1),
        topk_groups=need("topk_group", null=1),
        norm_topk_prob=need("norm_topk_prob"),
        routed_scaling_factor=need("routed_scaling_factor"),
        score_func=_get(hf, "scoring_func", "sigmoid", where=where),  # transformers' config has no such key
        rms_norm_eps=need("rms_norm_eps"),
        max_position_embeddings=need("max_position_embeddings"),
        mtp_num_layers=_get(hf, "num_nextn_predict_layers", 0, null=0, where=where),
    )
    model.update(_rope_from_hf(hf, where))
    try:
        return build_model_config(model)
    except ConfigError as e:
        raise UserError(f"{where}: {e}") from None


def _rope_from_hf(hf: dict, where: str) -> dict:
    """The rope keys of ModelConfig from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise UserError(f'{where}: \'{key}\' is {params!r}, expected an object like {{"type": "yarn", ...}} or null')
    rope_where = f"{where} {key}"
    theta = (
        _number(params, "rope_theta", rope_where) if "rope_theta" in params else _number(hf, "rope_theta", where, 1e4)
    )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": "none"}
    if kind != "yarn":
        raise UserError(f"{where}: rope type {kind!r} is not supported (maxmoe has default and yarn)")
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise UserError(f"{where}: yarn 'attention_factor' / 'truncate: false' are not supported")
    mscale = None if params.get("mscale") is None else _number(params, "mscale", rope_where)
    mscale_all_dim = _number(params, "mscale_all_dim", rope_where, 0.0) if params.get("mscale_all_dim") else 0.0
    if mscale is None and mscale_all_dim:
        # transformers then uses the default temperature on cos/sin, which ModelConfig cannot express.
        raise UserError(f"{where}: yarn with mscale_all_dim but no mscale is not supported")
    original = _number(params, "original_max_position_embeddings", rope_where)
    if original != int(original):
        raise UserError(f"{rope_where}: 'original_max_position_embeddings' is {original!r}, expected an integer")
    return {
        "rope_theta": theta,
        "rope_scaling": "yarn",
        "rope_factor": _number(params, "factor", rope_where),
        "rope_original_max_position": int(original),
        "rope_beta_fast": _number(params, "beta_fast", rope_where) if params.get("beta_fast") else 32.0,
        "rope_beta_slow": _number(params, "beta_slow", rope_where) if params.get("beta_slow") else 1.0,
        "rope_mscale": 1.0 if mscale is None else mscale,
        "rope_mscale_all_dim": mscale_all_dim,
    }


def hf_config_from_model(m: ModelConfig, dtype: str) -> dict:
    """config.json in the DeepSeek-V3 release's key style (rope_scaling + rope_theta)."""
    rope_scaling = None
    if m.rope_scaling == "yarn":
        rope_scaling = {
            "type": "yarn",
            "factor": m.rope_factor,
            "original_max_position_embeddings": m.rope_original_max_position,
            "beta_fast": m.rope_beta_fast,
            "beta_slow": m.rope_beta_slow,
            "mscale": m.rope_mscale,
            "mscale_all_dim": m.rope_mscale_all_dim,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.mlp_dim,
        "moe_intermediate_size": m.moe_mlp_dim,
        "num_hidden_layers": m.num_layers,
        "num_nextn_predict_layers": m.mtp_num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "n_shared_experts": m.num_shared_experts,
        "n_routed_experts": m.num_experts,
        "routed_scaling_factor": m.routed_scaling_factor,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank or None,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "n_group": m.num_expert_groups,
        "topk_group": m.topk_groups,
        "num_experts_per_tok": m.experts_per_token,
        "moe_layer_freq": 1,
        "first_k_dense_replace": m.first_k_dense,
        "norm_topk_prob": m.norm_topk_prob,
        "scoring_func": m.score_func,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": False,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": dtype,
    }
