"""Parameter counts and FLOPs: the published DeepSeek-V3 figures, a hand count from the
architecture numbers, and the real initialised parameters of the tiny model."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import pytest

from maxmoe.config import load_config
from maxmoe.flops import count_params, flops_per_token

REPO = Path(__file__).resolve().parents[1]

# DeepSeek-V3 release (config.json of deepseek-ai/DeepSeek-V3), written out here on purpose.
V, D, LAYERS, DENSE = 129280, 7168, 61, 3
DENSE_MLP, EXPERT_MLP, ROUTED, SHARED, TOP_K = 18432, 2048, 256, 1, 8
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD = 128, 1536, 512, 128, 64, 128


def hand_count_671b() -> dict[str, int]:
    embedding = V * D
    head = D * V
    final_norm = D
    attention = (D * Q_LORA  # q_a_proj
                 + Q_LORA  # q_a_layernorm
                 + Q_LORA * HEADS * (NOPE + ROPE)  # q_b_proj
                 + D * (KV_LORA + ROPE)  # kv_a_proj_with_mqa: latent + shared rope key
                 + KV_LORA  # kv_a_layernorm
                 + KV_LORA * HEADS * (NOPE + V_HEAD)  # kv_b_proj
                 + HEADS * V_HEAD * D)  # o_proj
    layer_norms = 2 * D  # input_layernorm, post_attention_layernorm
    dense_mlp = 3 * D * DENSE_MLP
    expert = 3 * D * EXPERT_MLP
    moe = ROUTED * expert + SHARED * expert + D * ROUTED  # experts, shared expert, gate
    total = (embedding + head + final_norm + LAYERS * (attention + layer_norms) + DENSE * dense_mlp
             + (LAYERS - DENSE) * moe)
    active = total - (LAYERS - DENSE) * (ROUTED - TOP_K) * expert
    return {"params_total": total, "params_active": active}


@pytest.fixture(scope="module")
def info_671b() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "maxmoe.info", "--config", "configs/deepseek_v3_671b.yaml",
                             "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_info_671b_matches_published_figures(info_671b):
    assert info_671b["params_total"] == pytest.approx(671_026_404_352, rel=1e-4)
    assert info_671b["params_active"] == pytest.approx(37_552_282_624, rel=5e-4)
    assert info_671b["flops_per_token"] == pytest.approx(2.6e11, rel=0.03)
    assert info_671b["seq_len"] == 4096


def test_hand_count_671b_equals_count_params(info_671b):
    want = hand_count_671b()
    assert want["params_total"] == pytest.approx(671_026_404_352, rel=1e-4)  # the hand count itself
    model = load_config([str(REPO / "configs/deepseek_v3_671b.yaml")]).model
    got = count_params(model)
    assert got["params_total"] == want["params_total"]
    assert got["params_active"] == want["params_active"]
    assert info_671b["params_total"] == want["params_total"]
    # MTP module beyond the shared embedding and head: enorm, hnorm, eh_proj, one MoE layer, its norm.
    mtp = D + D + 2 * D * D + (hand_count_per_moe_layer()) + D
    assert got["params_mtp"] == mtp


def hand_count_per_moe_layer() -> int:
    attention = (D * Q_LORA + Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + D * (KV_LORA + ROPE) + KV_LORA
                 + KV_LORA * HEADS * (NOPE + V_HEAD) + HEADS * V_HEAD * D)
    return attention + 2 * D + (ROUTED + SHARED) * 3 * D * EXPERT_MLP + D * ROUTED


def test_flops_per_token_hand_count_671b():
    """6 x active matmul params (head in, embedding out) + MTP + the causal attention core."""
    model = load_config([str(REPO / "configs/deepseek_v3_671b.yaml")]).model
    t = 4096
    attention = (D * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + D * (KV_LORA + ROPE)
                 + KV_LORA * HEADS * (NOPE + V_HEAD) + HEADS * V_HEAD * D)
    moe_active = (TOP_K + SHARED) * 3 * D * EXPERT_MLP + D * ROUTED
    main = LAYERS * attention + DENSE * 3 * D * DENSE_MLP + (LAYERS - DENSE) * moe_active + D * V
    mtp = 2 * D * D + attention + moe_active + D * V
    core = (LAYERS + 1) * 3 * t * HEADS * (NOPE + ROPE + V_HEAD)
    assert flops_per_token(model, t) == pytest.approx(6 * (main + mtp) + core, rel=1e-12)


def test_tiny_count_params_equals_initialised_params():
    from maxmoe.model.transformer import init_variables

    model = load_config([str(REPO / "configs/tiny.yaml")]).model
    variables = nn.unbox(init_variables(model, jax.random.key(0)))
    params = variables["params"]
    main = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    mtp = {k: v for k, v in params.items() if k.startswith("mtp_")}
    size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    got = count_params(model)
    assert got["params_total"] == size(main)
    assert got["params_mtp"] == size(mtp)
    assert mtp, "tiny.yaml has one MTP depth"
    # Router biases are state in their own collection, not parameters.
    assert "router" in variables and size(variables["router"]) == (model.num_layers - model.first_k_dense
                                                                     + model.mtp_num_layers) * model.num_experts
    expert = 3 * model.hidden_size * model.moe_mlp_dim
    inactive = (model.num_layers - model.first_k_dense) * (model.num_experts - model.experts_per_token) * expert
    assert got["params_active"] == size(main) - inactive
