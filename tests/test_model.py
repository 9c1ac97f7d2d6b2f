"""The network against plain oracles written here: a loop-over-experts MoE, a per-head MLA
with explicit rotary pairs, MTP and causality probes, and gradients of the full model.

Parameters are drawn with NumPy (shapes from jax.eval_shape), with scales large enough that
attention is far from uniform and routing has clear winners; everything runs in float32 and
is compared with the oracles (float64 NumPy) at 1e-5.
"""

import math
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxmoe.model
from maxmoe.config import load_config
from maxmoe.model.attention import MLA
from maxmoe.model.moe import MoE
from maxmoe.model.transformer import MTPLayer, abstract_variables, build_model

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/tiny.yaml")
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_model(*overrides):
    return load_config([TINY], ["model.compute_dtype=float32", *overrides]).model


def random_variables(shapes, seed, std=0.3, bias_std=0.3, router_std=None):
    """NumPy draws for every variable: norm scales ~ 1 + 0.2 N, router biases ~ bias_std N,
    router gates ~ router_std N (default std), others ~ std N."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        names = [getattr(p, "key", str(p)) for p in path]
        if names[-2:] == ["router", "w_gate"] and router_std is not None:
            value = router_std * rng.normal(size=leaf.shape)
        elif names[-1] == "scale":
            value = 1.0 + 0.2 * rng.normal(size=leaf.shape)
        elif names[0] == "router":
            value = bias_std * rng.normal(size=leaf.shape)
        else:
            value = std * rng.normal(size=leaf.shape)
        return jnp.asarray(value, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def numpy_tree(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def np_rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_swiglu(x, w_gate, w_up, w_down):
    return (np_silu(x @ w_gate) * (x @ w_up)) @ w_down


# ----------------------------------------------------------------------------------------
# MoE: loop over experts.


def reference_routing(x_ND, w_router_DE, bias_E, m, margin=1e-4):
    """Per token: sigmoid/softmax scores, bias for choice, group limit by top-2 sums, top-k, weights.

    Asserts that every decision (groups kept, experts chosen) wins by `margin`, so float32
    rounding in the model cannot flip it.
    """
    logits = x_ND @ w_router_DE
    if m.score_func == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    n, e = scores.shape
    per_group = e // m.num_expert_groups
    chosen, weights = [], []
    for tok in range(n):
        biased = scores[tok] + bias_E
        allowed = np.ones(e, bool)
        if m.num_expert_groups > 1:
            group_score = np.array(
                [np.sort(biased[g * per_group : (g + 1) * per_group])[-2:].sum() for g in range(m.num_expert_groups)]
            )
            ranked = np.argsort(-group_score)
            assert group_score[ranked[m.topk_groups - 1]] - group_score[ranked[m.topk_groups]] > margin
            allowed = np.zeros(e, bool)
            for g in ranked[: m.topk_groups]:
                allowed[g * per_group : (g + 1) * per_group] = True
        candidates = np.where(allowed, biased, -np.inf)
        ranked = np.argsort(-candidates)
        if m.experts_per_token < allowed.sum():
            assert candidates[ranked[m.experts_per_token - 1]] - candidates[ranked[m.experts_per_token]] > margin
        ids = ranked[: m.experts_per_token]
        w = scores[tok, ids]
        if m.norm_topk_prob:
            w = w / w.sum()
        chosen.append(ids)
        weights.append(w * m.routed_scaling_factor)
    return np.array(chosen), np.array(weights), scores


def reference_moe(x_BTD, variables, m):
    p = numpy_tree(variables["params"])
    bias = np.asarray(variables["router"]["router"]["bias"], np.float64)
    b, t, d = x_BTD.shape
    x = x_BTD.reshape(b * t, d)
    ids, weights, scores = reference_routing(x, p["router"]["w_gate"], bias, m)
    y = np.zeros_like(x)
    for expert in range(m.num_experts):
        for tok in range(b * t):
            for slot in range(m.experts_per_token):
                if ids[tok, slot] == expert:
                    y[tok] += weights[tok, slot] * np_swiglu(
                        x[tok], p["w_gate"][expert], p["w_up"][expert], p["w_down"][expert]
                    )
    if m.num_shared_experts:
        s = p["shared"]
        y += np_swiglu(x, s["w_gate"], s["w_up"], s["w_down"])
    load = np.bincount(ids.reshape(-1), minlength=m.num_experts)
    # DeepSeek-V3 sequence-wise balance term (without alpha), per sequence then averaged.
    seq_aux = 0.0
    for seq in range(b):
        rows = slice(seq * t, (seq + 1) * t)
        counts = np.bincount(ids[rows].reshape(-1), minlength=m.num_experts)
        f = m.num_experts / (m.experts_per_token * t) * counts
        prob = (scores[rows] / scores[rows].sum(-1, keepdims=True)).mean(0)
        seq_aux += (f * prob).sum() / b
    return y.reshape(b, t, d), load, seq_aux


@pytest.mark.smoke
@pytest.mark.parametrize(
    "overrides",
    [
        (),  # tiny.yaml: 8 experts in 4 groups, top-2 groups, top-2 experts, 1 shared
        (
            "model.num_experts=16",
            "model.num_expert_groups=8",
            "model.topk_groups=3",
            "model.experts_per_token=3",
            "model.num_shared_experts=2",
            "model.norm_topk_prob=false",
            "model.routed_scaling_factor=1.5",
        ),
        ("model.num_expert_groups=1", "model.topk_groups=1", "model.experts_per_token=3", "model.num_shared_experts=0"),
    ],
    ids=["tiny", "16experts_8groups", "ungrouped_no_shared"],
)
def test_moe_matches_loop_over_experts(overrides):
    m = tiny_model(*overrides)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 12, m.hidden_size)).astype(np.float32)
    module = MoE(m)
    shapes = jax.eval_shape(lambda: nn.unbox(module.init(jax.random.key(0), jnp.asarray(x))))
    variables = random_variables(
        {k: shapes[k] for k in ("params", "router")}, seed=1, std=0.1, bias_std=0.3, router_std=0.3
    )
    e, d, f = m.num_experts, m.hidden_size, m.moe_mlp_dim
    assert shapes["params"]["w_gate"].shape == (e, d, f) and shapes["params"]["w_down"].shape == (e, f, d)
    if m.num_shared_experts:  # the shared experts fused into one SwiGLU of width F x shared
        assert shapes["params"]["shared"]["w_up"].shape == (d, f * m.num_shared_experts)
    else:
        assert "shared" not in shapes["params"]
    out, stats = jax.jit(lambda v, x: module.apply(v, x, mutable=["moe_stats"]))(variables, jnp.asarray(x))
    want, load, seq_aux = reference_moe(x.astype(np.float64), variables, m)
    assert 0.1 < np.abs(want).max() < 10  # a signal of order one, where 1e-5 means float32 agreement
    np.testing.assert_allclose(np.asarray(out), want, **TOL)
    router_stats = stats["moe_stats"]["router"]
    np.testing.assert_array_equal(np.asarray(router_stats["load"]), load)
    np.testing.assert_allclose(float(router_stats["seq_aux"]), seq_aux, **TOL)
    assert float(stats["moe_stats"]["dropped"]) == 0.0
    assert load.sum() == x.shape[0] * x.shape[1] * m.experts_per_token


def test_moe_bias_changes_routing():
    """A large bias on one expert sends every token there (the oracle above would then agree)."""
    m = tiny_model("model.num_expert_groups=1", "model.topk_groups=1")
    x = np.random.default_rng(2).normal(size=(1, 8, m.hidden_size)).astype(np.float32)
    module = MoE(m)
    shapes = jax.eval_shape(lambda: nn.unbox(module.init(jax.random.key(0), jnp.asarray(x))))
    variables = random_variables({k: shapes[k] for k in ("params", "router")}, seed=3, bias_std=0.0)
    variables["router"]["router"]["bias"] = jnp.zeros(m.num_experts).at[5].set(10.0)
    _, stats = jax.jit(lambda v, x: module.apply(v, x, mutable=["moe_stats"]))(variables, jnp.asarray(x))
    assert float(stats["moe_stats"]["router"]["load"][5]) == 8.0


# ----------------------------------------------------------------------------------------
# MLA: a per-head loop with rotary pairs as complex numbers.


def reference_frequencies(m):
    """DeepSeek-V3 YaRN frequencies (release model.py), written out independently."""
    dim, base = m.qk_rope_head_dim, m.rope_theta
    freqs = np.array([base ** (-2.0 * i / dim) for i in range(dim // 2)])
    if m.rope_scaling != "yarn":
        return freqs

    def correction(rotations):
        return dim * math.log(m.rope_original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(m.rope_beta_fast)), 0)
    high = min(math.ceil(correction(m.rope_beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    smooth = 1.0 - np.clip((np.arange(dim // 2) - low) / (high - low), 0.0, 1.0)
    return freqs / m.rope_factor * (1 - smooth) + freqs * smooth


def np_rotate(x_TR, positions_T, freqs, magnitude=1.0):
    z = (x_TR[:, 0::2] + 1j * x_TR[:, 1::2]) * magnitude * np.exp(1j * positions_T[:, None] * freqs[None, :])
    return np.stack([z.real, z.imag], axis=-1).reshape(x_TR.shape)


def reference_mla(x_BTD, positions_BT, params, m):
    p = numpy_tree(params)
    b, t, _ = x_BTD.shape
    nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
    freqs = reference_frequencies(m)
    scale = (nope + rope) ** -0.5
    magnitude = 1.0  # Hugging Face's YaRN attention_factor on cos and sin
    if m.rope_scaling == "yarn":
        mscale_all = 0.1 * m.rope_mscale_all_dim * math.log(m.rope_factor) + 1.0
        scale *= mscale_all**2
        magnitude = (0.1 * m.rope_mscale * math.log(m.rope_factor) + 1.0) / mscale_all
    out = np.zeros_like(x_BTD)
    for batch in range(b):
        x = x_BTD[batch]
        pos = positions_BT[batch].astype(np.float64)
        latent = np_rms_norm(x @ p["w_kv_down"], p["kv_norm"]["scale"], m.rms_norm_eps)
        k_rope = np_rotate(x @ p["w_k_rope"], pos, freqs, magnitude)  # one rope key shared by all heads
        if m.q_lora_rank:
            q_latent = np_rms_norm(x @ p["w_q_down"], p["q_norm"]["scale"], m.rms_norm_eps)
        for h in range(m.num_heads):
            q = q_latent @ p["w_q_up"][:, h, :] if m.q_lora_rank else x @ p["w_q"][:, h, :]
            q = np.concatenate([q[:, :nope], np_rotate(q[:, nope:], pos, freqs, magnitude)], axis=-1)
            k = np.concatenate([latent @ p["w_k_up"][:, h, :], k_rope], axis=-1)
            v = latent @ p["w_v_up"][:, h, :]
            scores = q @ k.T * scale
            scores[np.triu(np.ones((t, t), bool), k=1)] = -np.inf
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[batch] += (probs @ v) @ p["w_out"][h]
    return out


@pytest.mark.smoke
@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.q_lora_rank=0",),
        ("model.rope_scaling=none", "model.num_heads=2", "model.qk_rope_head_dim=16"),
        ("model.rope_mscale=0.707", "model.rope_factor=40", "model.rope_original_max_position=4"),
    ],
    ids=["q_lora", "no_q_lora", "no_yarn", "yarn_mscale_differs"],
)
def test_mla_matches_per_head_attention(overrides):
    m = tiny_model(*overrides)
    rng = np.random.default_rng(4)
    b, t = 2, 10
    x = rng.normal(size=(b, t, m.hidden_size)).astype(np.float32)
    positions = np.stack([np.arange(t), np.arange(t) + 7]).astype(np.int32)  # second sequence offset
    module = MLA(m)
    shapes = jax.eval_shape(lambda: nn.unbox(module.init(jax.random.key(0), jnp.asarray(x), jnp.asarray(positions))))
    params = random_variables(shapes["params"], seed=5, std=0.15)
    assert ("w_q_down" in params) == bool(m.q_lora_rank)
    out = jax.jit(lambda p, x, pos: module.apply({"params": p}, x, pos))(params, jnp.asarray(x), jnp.asarray(positions))
    want = reference_mla(x.astype(np.float64), positions, params, m)
    assert np.abs(want).max() > 0.1  # not a vanishing signal
    np.testing.assert_allclose(np.asarray(out), want, **TOL)


# ----------------------------------------------------------------------------------------
# The whole model: causality, MTP wiring, gradients, the logits() helper.


@pytest.fixture(scope="module")
def tiny_setup():
    m = tiny_model()
    model = build_model(m)
    variables = random_variables(abstract_variables(m), seed=6, std=0.1, bias_std=0.05)
    apply = jax.jit(lambda v, tokens: model.apply(v, tokens, mutable=["moe_stats"]))
    tokens = np.random.default_rng(7).integers(0, m.vocab_size, size=(2, 16)).astype(np.int32)
    return m, model, variables, apply, tokens


def test_forward_shapes_and_types(tiny_setup):
    m, _, variables, apply, tokens = tiny_setup
    (logits, mtp), stats = apply(variables, jnp.asarray(tokens))
    assert logits.shape == (2, 16, m.vocab_size) and logits.dtype == jnp.float32
    assert len(mtp) == m.mtp_num_layers == 1
    assert mtp[0].shape == logits.shape and mtp[0].dtype == jnp.float32
    moe_layers = m.num_layers - m.first_k_dense
    assert stats["moe_stats"]["moe_layers"]["moe"]["router"]["load"].shape == (moe_layers, m.num_experts)
    assert stats["moe_stats"]["mtp_0"]["block"]["moe"]["router"]["load"].shape == (m.num_experts,)


def test_main_logits_are_causal_and_mtp_reads_the_next_token(tiny_setup):
    m, _, variables, apply, tokens = tiny_setup
    t = 6
    changed = tokens.copy()
    changed[:, t + 1] = (changed[:, t + 1] + 1 + np.arange(2) * 37) % m.vocab_size
    (logits_a, (mtp_a,)), _ = apply(variables, jnp.asarray(tokens))
    (logits_b, (mtp_b,)), _ = apply(variables, jnp.asarray(changed))
    logits_a, logits_b, mtp_a, mtp_b = map(np.asarray, (logits_a, logits_b, mtp_a, mtp_b))
    # Main model: positions <= t never see token t+1; position t+1 does.
    np.testing.assert_allclose(logits_b[:, : t + 1], logits_a[:, : t + 1], rtol=0, atol=1e-6)
    assert np.abs(logits_b[:, t + 1] - logits_a[:, t + 1]).max() > 1e-3
    # MTP depth 1 at position s sees tokens <= s + 1: position t changes, positions < t do not.
    np.testing.assert_allclose(mtp_b[:, :t], mtp_a[:, :t], rtol=0, atol=1e-6)
    assert np.all(np.abs(mtp_b[:, t] - mtp_a[:, t]).max(-1) > 1e-3)


def test_mtp_logits_compose_final_hidden_state_with_next_embedding(tiny_setup):
    """mtp[t] = head(MTPLayer(final_norm(h)[t], embed(token[t+1]))): shared embedding and head."""
    m, model, variables, apply, tokens = tiny_setup
    (_, (mtp,)), _ = apply(variables, jnp.asarray(tokens))

    @jax.jit
    def final_hidden_of(v, tokens):
        _, state = model.apply(v, tokens, capture_intermediates=True, mutable=["intermediates", "moe_stats"])
        return state["intermediates"]["final_norm"]["__call__"][0]

    @jax.jit
    def mtp_layer(v, hidden, embedding, positions):
        return MTPLayer(m).apply(v, hidden, embedding, positions, mutable=["moe_stats"])[0]

    final_hidden = final_hidden_of(variables, jnp.asarray(tokens))
    p = variables["params"]
    next_tokens = np.concatenate([tokens[:, 1:], np.zeros((2, 1), np.int32)], axis=1)
    next_embedding = np.asarray(p["embed"]["embedding"])[next_tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    _, normed = mtp_layer(
        {"params": p["mtp_0"], "router": variables["router"]["mtp_0"]},
        final_hidden,
        jnp.asarray(next_embedding),
        positions,
    )
    want = np.asarray(normed, np.float64) @ np.asarray(p["head"], np.float64)
    np.testing.assert_allclose(np.asarray(mtp)[:, :-1], want[:, :-1], **TOL)


def cross_entropy(logits_BTV, targets_BT):
    logp = jax.nn.log_softmax(logits_BTV, axis=-1)
    return -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1).mean()


def test_gradients_finite_and_reach_every_parameter(tiny_setup):
    m, model, variables, _, tokens = tiny_setup
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, m.vocab_size, size=(2, 32)), jnp.int32)

    def loss_fn(params):
        (logits, mtp), stats = model.apply(
            {"params": params, "router": variables["router"]}, tokens, mutable=["moe_stats"]
        )
        loss = cross_entropy(logits[:, :-1], tokens[:, 1:])
        for depth, mtp_logits in enumerate(mtp, start=1):
            loss = loss + cross_entropy(mtp_logits[:, : -1 - depth], tokens[:, 1 + depth :])
        seq_aux = [
            v for path, v in jax.tree_util.tree_leaves_with_path(stats) if getattr(path[-1], "key", None) == "seq_aux"
        ]
        assert len(seq_aux) == 2  # the scanned MoE stack and the MTP block
        return loss + sum(jnp.sum(a) for a in seq_aux), stats

    (loss, stats), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(variables["params"])
    assert np.isfinite(float(loss))
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert len(flat) == len(jax.tree.leaves(variables["params"]))
    for path, g in flat:
        name = jax.tree_util.keystr(path)
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), name
        assert np.any(g != 0), f"{name} gets no gradient"
    # Routed expert weights: expert e of layer l gets a gradient exactly when tokens were routed to it.
    load_LE = np.asarray(stats["moe_stats"]["moe_layers"]["moe"]["router"]["load"])
    assert (load_LE > 0).sum() >= 2
    for weight in ("w_gate", "w_up", "w_down"):
        g_LE = np.abs(np.asarray(grads["moe_layers"]["moe"][weight])).reshape(*load_LE.shape, -1).max(-1)
        np.testing.assert_array_equal(g_LE > 0, load_LE > 0, err_msg=weight)


def test_logits_helper_equals_apply(tiny_setup):
    m, _, variables, apply, tokens = tiny_setup
    (want, _), _ = apply(variables, jnp.asarray(tokens))
    got = jax.jit(lambda v, t: maxmoe.model.logits(m, v, t))(dict(variables, moe_stats={}), tokens)
    assert got.shape == (2, 16, m.vocab_size) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
