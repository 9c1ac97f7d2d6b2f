"""Parameter counts and FLOPs: the published DeepSeek-V3 figures, a hand count from the
architecture numbers, and the parameter shapes of the model itself."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore

from maxmoe.analysis.flops import count_params, flops_per_token, fp8_flops_per_token
from maxmoe.config import ConfigError, load_config
from maxmoe.convert.hf_config import model_config_from_hf
from maxmoe.model.transformer import abstract_variables, build_model

REPO = Path(__file__).resolve().parents[1]

# DeepSeek-V3 release (config.json of deepseek-ai/DeepSeek-V3), written out here on purpose.
V, D, LAYERS, DENSE = 129280, 7168, 61, 3
DENSE_MLP, EXPERT_MLP, ROUTED, SHARED, TOP_K = 18432, 2048, 256, 1, 8
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 128, 1536, 512, 128, 64, 128


def hand_count(m) -> dict[str, int]:
    """Parameters of a DeepSeek-V3 config counted by hand from its architecture numbers."""
    d, h = m.hidden_size, m.num_heads
    embedding = m.vocab_size * d
    head = d * m.vocab_size
    final_norm = d
    if m.q_lora_rank:
        query = (
            d * m.q_lora_rank  # q_a_proj
            + m.q_lora_rank  # q_a_layernorm
            + m.q_lora_rank * h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        )  # q_b_proj
    else:
        query = d * h * (m.qk_nope_head_dim + m.qk_rope_head_dim)  # q_proj
    attention = (
        query
        + d * (m.kv_lora_rank + m.qk_rope_head_dim)  # kv_a_proj_with_mqa: latent + shared rope key
        + m.kv_lora_rank  # kv_a_layernorm
        + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b_proj
        + h * m.v_head_dim * d
    )  # o_proj
    layer_norms = 2 * d  # input_layernorm, post_attention_layernorm
    dense_mlp = 3 * d * m.mlp_dim
    expert = 3 * d * m.moe_mlp_dim
    moe = m.num_experts * expert + m.num_shared_experts * expert + d * m.num_experts  # experts, shared, gate
    moe_layers = m.num_layers - m.first_k_dense
    total = (
        embedding
        + head
        + final_norm
        + m.num_layers * (attention + layer_norms)
        + m.first_k_dense * dense_mlp
        + moe_layers * moe
    )
    active = total - moe_layers * (m.num_experts - m.experts_per_token) * expert
    # Each MTP depth beyond the shared embedding and head: enorm, hnorm, eh_proj, one MoE layer, its output norm.
    mtp = m.mtp_num_layers * (d + d + 2 * d * d + attention + layer_norms + moe + d)
    return {"params_total": total, "params_active": active, "params_mtp": mtp}


def test_hand_count_671b_architecture_numbers():
    """The hand count, fed the release's numbers written out here, gives the published figures."""

    class Release:  # deepseek-ai/DeepSeek-V3 config.json
        vocab_size, hidden_size, num_layers, first_k_dense = V, D, LAYERS, DENSE
        mlp_dim, moe_mlp_dim, num_experts, num_shared_experts, experts_per_token = (
            DENSE_MLP,
            EXPERT_MLP,
            ROUTED,
            SHARED,
            TOP_K,
        )
        num_heads, q_lora_rank, kv_lora_rank = HEADS, Q_LORA, KV_LORA
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim = NOPE, ROPE, V_HEAD
        mtp_num_layers = 1

    counts = hand_count(Release)
    assert counts["params_total"] == pytest.approx(671_026_404_352, rel=1e-4)
    assert counts["params_active"] == pytest.approx(37_552_282_624, rel=5e-4)
    # The release checkpoint's 685B: the main model plus the MTP module, which stores its own copies of
    # the embedding and head.
    assert counts["params_total"] + counts["params_mtp"] + 2 * V * D == pytest.approx(685e9, rel=1e-3)
    assert counts == hand_count(load_config([str(REPO / "configs/deepseek_v3_671b.yaml")]).model)


@pytest.fixture(scope="module")
def info_671b() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "maxmoe.info", "--config", "configs/deepseek_v3_671b.yaml", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_info_671b_matches_published_figures(info_671b):
    assert info_671b["params_total"] == pytest.approx(671_026_404_352, rel=1e-4)
    assert info_671b["params_active"] == pytest.approx(37_552_282_624, rel=5e-4)
    assert info_671b["flops_per_token"] == pytest.approx(2.6e11, rel=0.03)
    assert info_671b["seq_len"] == 4096
    assert (
        info_671b["params_total"]
        == hand_count(load_config([str(REPO / "configs/deepseek_v3_671b.yaml")]).model)["params_total"]
    )


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["deepseek_v3_671b.yaml", "tiny.yaml"])
def test_hand_count_equals_count_params(name):
    model = load_config([str(REPO / "configs" / name)]).model
    assert count_params(model) == hand_count(model)


def test_hand_count_without_q_lora():
    model = load_config([str(REPO / "configs/tiny.yaml")], ["model.q_lora_rank=0", "model.num_shared_experts=2"]).model
    assert count_params(model) == hand_count(model)


def test_flops_per_token_hand_count_671b():
    """6 x active matmul params (head in, embedding out) + MTP + the causal attention core."""
    model = load_config([str(REPO / "configs/deepseek_v3_671b.yaml")]).model
    t = 4096
    attention = (
        D * Q_LORA
        + Q_LORA * HEADS * (NOPE + ROPE)
        + D * (KV_LORA + ROPE)
        + KV_LORA * HEADS * (NOPE + V_HEAD)
        + HEADS * V_HEAD * D
    )
    moe_active = (TOP_K + SHARED) * 3 * D * EXPERT_MLP + D * ROUTED
    main = LAYERS * attention + DENSE * 3 * D * DENSE_MLP + (LAYERS - DENSE) * moe_active + D * V
    mtp = 2 * D * D + attention + moe_active + D * V
    core = (LAYERS + 1) * 3 * t * HEADS * (NOPE + ROPE + V_HEAD)
    assert flops_per_token(model, t) == pytest.approx(6 * (main + mtp) + core, rel=1e-12)


def _fp8_dot_flops(jaxpr) -> float:
    """FLOPs of the dots with fp8 operands in a jaxpr: scans times their length, a cond its dearest branch."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        lhs = eqn.invars[0].aval if eqn.invars else None
        fp8 = lhs is not None and "float8" in str(getattr(lhs, "dtype", ""))
        if name == "dot_general" and fp8:
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            rhs = eqn.invars[1].aval.shape
            free = math.prod(d for i, d in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch)
            total += 2 * math.prod(lhs.shape) * free
        elif name == "ragged_dot_general" and fp8:  # forward: rows [M, K] x group weights -> [M, N]
            total += 2 * math.prod(lhs.shape) * eqn.outvars[0].aval.shape[-1]
        elif name == "cond":
            total += max(_fp8_dot_flops(branch.jaxpr) for branch in eqn.params["branches"])
        else:
            times = eqn.params.get("length", 1) if name == "scan" else 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                        total += times * _fp8_dot_flops(getattr(sub, "jaxpr", sub))
    return total


@pytest.mark.parametrize("recipe", ["none", "tensorwise", "blockwise"])
def test_fp8_flops_per_token_equals_the_models_fp8_dots(recipe):
    """The closed form against the fp8 dots of the model's traced forward pass, times 3 (forward,
    dx, dw). tiny widened so every FP8 contraction spans whole 128-tiles; mxfp8's CPU program
    multiplies dequantised f32 values, so its dots carry no fp8 dtype to count."""
    widened = [f"model.{k}={v}" for k, v in (("hidden_size", 128), ("mlp_dim", 256), ("moe_mlp_dim", 128))]
    widened += ["model.q_lora_rank=128", "model.kv_lora_rank=128", "model.v_head_dim=32"]
    model = load_config([str(REPO / "configs/tiny.yaml")], widened + [f"model.fp8={recipe}"]).model
    variables = {k: v for k, v in abstract_variables(model).items() if k in ("params", "router")}
    tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
    forward = jax.make_jaxpr(lambda v, t: build_model(model).apply(v, t, mutable=["moe_stats"]))(variables, tokens)
    assert 3 * _fp8_dot_flops(forward.jaxpr) == fp8_flops_per_token(model) * 2 * 64
    if recipe != "none":  # the router, attention core, head and MTP projection are the rest
        assert 0.5 < fp8_flops_per_token(model) / flops_per_token(model, 64) < 1.0


def _model(name):
    if name == "hf_fixture":
        path = REPO / "tests/fixtures/hf_tiny_deepseek_v3/config.json"
        return model_config_from_hf(json.loads(path.read_text()), str(path))
    if name == "tiny_plain_query":  # no query latent (no q_norm), two shared experts
        return load_config(
            [str(REPO / "configs/tiny.yaml")], ["model.q_lora_rank=0", "model.num_shared_experts=2"]
        ).model
    if name == "tiny_bare":  # no dense layers, no shared experts, no MTP
        overrides = ["model.first_k_dense=0", "model.num_shared_experts=0", "model.mtp_num_layers=0"]
        return load_config([str(REPO / "configs/tiny.yaml")], overrides).model
    return load_config([str(REPO / "configs" / f"{name}.yaml")]).model


@pytest.mark.parametrize("name", ["tiny", "tiny_plain_query", "tiny_bare", "hf_fixture", "deepseek_v3_671b"])
def test_count_params_equals_the_models_parameters(name):
    """The closed forms against the shapes the model itself creates (traced, nothing allocated)."""
    model = _model(name)
    variables = abstract_variables(model)
    params = variables["params"]
    main = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    mtp = {k: v for k, v in params.items() if k.startswith("mtp_")}
    size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    got = count_params(model)
    assert got["params_total"] == size(main)
    assert got["params_mtp"] == size(mtp)
    assert bool(mtp) == (model.mtp_num_layers > 0)
    # Router biases are state in their own collection, not parameters.
    assert size(variables["router"]) == (model.num_layers - model.first_k_dense + model.mtp_num_layers) * (
        model.num_experts
    )
    expert = 3 * model.hidden_size * model.moe_mlp_dim
    inactive = (model.num_layers - model.first_k_dense) * (model.num_experts - model.experts_per_token) * expert
    assert got["params_active"] == size(main) - inactive
    if name == "deepseek_v3_671b":
        assert (got["params_total"], got["params_active"]) == (671_026_404_352, 37_552_282_624)


def test_info_names_the_kernels_auto_resolves_to_for_cuda():
    """proxy_1gpu for CUDA (device kind unknown: Hopper): not XLA's ragged_dot, not the dense attention oracle."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "maxmoe.info", "--config", str(REPO / "configs" / "proxy_1gpu.yaml")]
    result = subprocess.run(
        argv + ["--platform", "cuda", "--json"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["platform"], report["grouped_matmul"]) == ("cuda", "mosaic_gpu")
    assert report["attention"] in ("triton", "chunked") and report["attention_reason"]


def test_kernel_report_tells_hopper_from_blackwell():
    from maxmoe.info import kernel_report

    config = load_config([str(REPO / "configs" / "proxy_1gpu.yaml")])
    assert kernel_report(config, "cuda", "NVIDIA H200")["grouped_matmul"] == "mosaic_gpu"
    # No Blackwell grouped kernel here (no tokamax): auto refuses rather than build ragged_dot's dense rewrite.
    with pytest.raises(ConfigError, match=r"grouped_matmul=auto on NVIDIA GB300: no grouped GEMM kernel for Blackwell"):
        kernel_report(config, "cuda", "NVIDIA GB300")
    named = kernel_report(config.replace(moe={"grouped_matmul": "ragged_dot"}), "cuda", "NVIDIA GB300")
    assert (named["grouped_matmul"], named["grouped_matmul_reason"]) == ("ragged_dot", "set in the config")
    assert kernel_report(config, "cpu", None)["attention"] == "chunked"
