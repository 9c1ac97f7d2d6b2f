"""DeepSeek-V3 router against a NumPy transcription of the paper and the release's gate.

The oracle below is written from the DeepSeek-V3 report (sections 2.1.2, 2.1.3) and the
release's `Gate.forward`: sigmoid (or softmax) affinities s; s + b picks experts; groups are
ranked by the sum of their two best biased scores and only the best `topk_groups` groups may
supply experts; weights are the *unbiased* s of the chosen experts, normalised to sum to one
and multiplied by `routed_scaling_factor`. It is a per-token Python loop over argsort and
shares no code with maxmoe.model.router.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import ModelConfig
from maxmoe.model.router import expert_load, route, sequence_balance_loss

TOL = dict(rtol=1e-5, atol=1e-5)


def model_config(**kw) -> ModelConfig:
    base = dict(
        num_experts=16,
        num_expert_groups=4,
        topk_groups=2,
        experts_per_token=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        score_func="sigmoid",
    )
    base.update(kw)
    return ModelConfig(**base)


def numpy_route(logits, bias, c: ModelConfig):
    """Per-token reference: returns (ids [N, K] in descending biased score, weights [N, K], scores [N, E])."""
    logits = np.asarray(logits, np.float64)
    if c.score_func == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    n, e = scores.shape
    group_size = e // c.num_expert_groups
    ids = np.zeros((n, c.experts_per_token), np.int64)
    weights = np.zeros((n, c.experts_per_token))
    for tok in range(n):
        biased = scores[tok] + np.asarray(bias, np.float64)
        allowed = np.ones(e, bool)
        if c.num_expert_groups > 1:
            group_scores = []
            for g in range(c.num_expert_groups):
                members = np.sort(biased[g * group_size : (g + 1) * group_size])[::-1]
                group_scores.append(members[0] + members[1])
            kept_groups = np.argsort(-np.asarray(group_scores), kind="stable")[: c.topk_groups]
            allowed[:] = False
            for g in kept_groups:
                allowed[g * group_size : (g + 1) * group_size] = True
        masked = np.where(allowed, biased, -np.inf)
        chosen = np.argsort(-masked, kind="stable")[: c.experts_per_token]
        w = scores[tok, chosen]
        if c.norm_topk_prob:
            w = w / w.sum()
        ids[tok] = chosen
        weights[tok] = w * c.routed_scaling_factor
    return ids, weights, scores


def sorted_pairs(ids, weights):
    """Compare routings regardless of the order of the k slots."""
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


def random_inputs(seed, n, e, bias_scale=0.3):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, e)).astype(np.float32) * 2.0
    bias = (rng.normal(size=(e,)) * bias_scale).astype(np.float32)
    return logits, bias


@pytest.mark.smoke
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_experts=8, num_expert_groups=4, topk_groups=2, experts_per_token=2),
        dict(num_expert_groups=1, topk_groups=1),
        dict(norm_topk_prob=False, routed_scaling_factor=1.0),
        dict(score_func="softmax", num_expert_groups=8, topk_groups=3, experts_per_token=3),
    ],
)
def test_route_matches_numpy_reference(kw):
    c = model_config(**kw)
    logits, bias = random_inputs(0, 64, c.num_experts)
    got = route(jnp.asarray(logits), jnp.asarray(bias), c)
    ids, weights, scores = numpy_route(logits, bias, c)
    np.testing.assert_allclose(np.asarray(got.scores_NE), scores, **TOL)
    got_ids, got_w = sorted_pairs(np.asarray(got.expert_ids_NK), np.asarray(got.weights_NK))
    want_ids, want_w = sorted_pairs(ids, weights)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, **TOL)
    assert got.expert_ids_NK.dtype == jnp.int32


def test_group_limit_excludes_experts_outside_top_groups():
    c = model_config()  # 16 experts in 4 groups of 4, keep 2 groups, top-4
    logits, bias = random_inputs(1, 256, c.num_experts)
    got = np.asarray(route(jnp.asarray(logits), jnp.asarray(bias), c).expert_ids_NK)
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    biased = (scores + bias).reshape(-1, 4, 4)
    group_score = np.sort(biased, axis=-1)[..., -2:].sum(-1)  # [N, G]: top-2 sum per group
    kept = np.argsort(-group_score, axis=-1)[:, :2]
    for tok in range(got.shape[0]):
        assert set(got[tok] // 4) <= set(kept[tok]), tok
    # The limit actually binds somewhere: unrestricted top-4 would leave the kept groups.
    unrestricted = np.argsort(-(scores + bias), axis=-1)[:, :4]
    assert any(not set(unrestricted[t] // 4) <= set(kept[t]) for t in range(got.shape[0]))


def test_group_limit_ranks_by_top2_sum_not_max():
    """One group has the single best expert but a poor second; the top-2 sum must drop it."""
    c = model_config(num_experts=8, num_expert_groups=4, topk_groups=1, experts_per_token=2)
    p = np.array([[0.99, 0.01, 0.80, 0.79, 0.3, 0.3, 0.2, 0.2]])
    logits = np.log(p / (1 - p)).astype(np.float32)  # sigmoid(logits) = p
    got = np.asarray(route(jnp.asarray(logits), jnp.zeros(8, jnp.float32), c).expert_ids_NK)
    assert sorted(got[0].tolist()) == [2, 3]


def test_bias_changes_choice_but_not_weights():
    c = model_config(
        num_expert_groups=1, topk_groups=1, experts_per_token=2, norm_topk_prob=False, routed_scaling_factor=1.0
    )
    p = np.full((1, 16), 0.1)
    p[0, 0], p[0, 1], p[0, 2] = 0.9, 0.8, 0.2
    logits = np.log(p / (1 - p)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[2] = 1.0  # 0.2 + 1.0 beats 0.8 for choice
    got = route(jnp.asarray(logits), jnp.asarray(bias), c)
    ids, w = sorted_pairs(np.asarray(got.expert_ids_NK), np.asarray(got.weights_NK))
    assert ids[0].tolist() == [0, 2]
    np.testing.assert_allclose(w[0], [0.9, 0.2], **TOL)  # unbiased sigmoid scores


def test_normalisation_and_scaling():
    c = model_config(num_expert_groups=1, topk_groups=1, experts_per_token=3, routed_scaling_factor=2.5)
    logits, bias = random_inputs(2, 32, 16)
    got = route(jnp.asarray(logits), jnp.asarray(bias), c)
    np.testing.assert_allclose(np.asarray(got.weights_NK).sum(-1), np.full(32, 2.5), **TOL)
    c_raw = dataclasses.replace(c, norm_topk_prob=False, routed_scaling_factor=1.0)
    raw = route(jnp.asarray(logits), jnp.asarray(bias), c_raw)
    np.testing.assert_array_equal(np.asarray(raw.expert_ids_NK), np.asarray(got.expert_ids_NK))
    expected = np.asarray(raw.weights_NK) / np.asarray(raw.weights_NK).sum(-1, keepdims=True) * 2.5
    np.testing.assert_allclose(np.asarray(got.weights_NK), expected, **TOL)


def test_softmax_scores_sum_to_one():
    c = model_config(
        score_func="softmax", num_expert_groups=1, topk_groups=1, norm_topk_prob=False, routed_scaling_factor=1.0
    )
    logits, _ = random_inputs(3, 16, 16)
    got = route(jnp.asarray(logits), jnp.zeros(16, jnp.float32), c)
    np.testing.assert_allclose(np.asarray(got.scores_NE).sum(-1), np.ones(16), **TOL)
    top = np.sort(np.asarray(got.scores_NE), axis=-1)[:, ::-1][:, :4]
    np.testing.assert_allclose(np.sort(np.asarray(got.weights_NK), axis=-1)[:, ::-1], top, **TOL)


def numpy_sequence_balance_loss(scores_BTE, ids_BTK):
    """DeepSeek-V3 eq. 17-20 without alpha: sum_i f_i P_i per sequence, averaged over sequences."""
    b, t, e = scores_BTE.shape
    k = ids_BTK.shape[-1]
    losses = []
    for seq in range(b):
        total = 0.0
        for i in range(e):
            f_i = e / (k * t) * sum(int(i in ids_BTK[seq, tok]) for tok in range(t))
            p_i = np.mean([scores_BTE[seq, tok, i] / scores_BTE[seq, tok].sum() for tok in range(t)])
            total += f_i * p_i
        losses.append(total)
    return float(np.mean(losses))


def test_sequence_balance_loss_matches_paper_formula():
    c = model_config()
    b, t = 3, 20
    logits, bias = random_inputs(4, b * t, c.num_experts)
    routing = route(jnp.asarray(logits), jnp.asarray(bias), c)
    scores = np.asarray(routing.scores_NE).reshape(b, t, -1)
    ids = np.asarray(routing.expert_ids_NK).reshape(b, t, -1)
    got = sequence_balance_loss(jnp.asarray(scores), jnp.asarray(ids), c)
    np.testing.assert_allclose(float(got), numpy_sequence_balance_loss(scores.astype(np.float64), ids), **TOL)


def test_sequence_balance_loss_is_one_when_perfectly_balanced():
    """Uniform scores and every expert chosen equally often in each sequence: f_i = 1, P_i = 1/E."""
    e, k, t = 8, 2, 8
    scores = jnp.full((2, t, e), 0.5)
    ids = jnp.asarray(np.stack([np.arange(t * k).reshape(t, k) % e] * 2), jnp.int32)
    got = sequence_balance_loss(scores, ids, model_config(num_experts=e, experts_per_token=k))
    np.testing.assert_allclose(float(got), 1.0, **TOL)


def test_expert_load_counts():
    ids = np.array([[0, 3], [3, 5], [5, 3], [7, 0]], np.int32)
    got = np.asarray(expert_load(jnp.asarray(ids), 8))
    np.testing.assert_array_equal(got, [2, 0, 0, 3, 0, 2, 0, 1])
    assert got.dtype == np.float32


def test_route_is_jittable_and_gradients_flow_only_through_weights():
    c = model_config(num_experts=8, num_expert_groups=4, topk_groups=2, experts_per_token=2)
    logits, bias = random_inputs(5, 8, 8)

    def f(lg, b):
        return route(lg, b, c).weights_NK.sum()

    g_logits, g_bias = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(logits), jnp.asarray(bias))
    assert np.all(np.isfinite(np.asarray(g_logits)))
    assert np.any(np.asarray(g_logits) != 0)
    np.testing.assert_array_equal(np.asarray(g_bias), 0.0)  # the bias never weighs
