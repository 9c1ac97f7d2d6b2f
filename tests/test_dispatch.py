"""Expert-parallel dispatch against the single-device reference, and that against a loop over experts.

Oracles:
  * `loop_over_experts`: for each expert, mask the tokens routed to it, full SwiGLU,
    weight; no sorting, no grouped matmul. `local_routed_experts` must match it.
  * `local_routed_experts` (one device): every strategy on every mesh must match it,
    output and gradients (x, routing weights, w_gate, w_up, w_down).
  * Where copies are dropped, NumPy transcriptions of each strategy's documented drop
    policy give the dropped copies; the reference then runs with their weights zeroed.

Legend: B batch, T time, D embed, F expert_mlp, E experts, K top-k, N tokens.
"""

import dataclasses
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxmoe.config import DISPATCH_STRATEGIES as STRATEGIES
from maxmoe.config import GROUPED_MATMUL_BACKENDS, MoEConfig, load_config
from maxmoe.kernels.grouped_matmul import tokamax_problem
from maxmoe.parallel.dispatch import DispatchPlan, local_routed_experts, make_dispatch_plan, routed_experts
from maxmoe.parallel.layout import build_layout

MESHES = ((1, 8, 1), (2, 4, 1), (2, 2, 2), (4, 2, 1))
WEIGHT_SPECS = {
    "w_gate": P("expert", None, "tensor"),
    "w_up": P("expert", None, "tensor"),
    "w_down": P("expert", "tensor", None),
}
# float32, the design's tolerance: strategies sum the same products in other orders.
TOL = dict(rtol=1e-5, atol=1e-5)
D, F = 8, 4


def make_mesh(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("data", "expert", "tensor"))


def make_plan(mesh, strategy, **moe):
    return make_dispatch_plan(
        mesh,
        MoEConfig(dispatch=strategy, **moe),
        token_axes=("data", "expert"),
        weight_specs=WEIGHT_SPECS,
        platform="cpu",
    )


def random_problem(seed, b, t, e, k, ids_BTK=None):
    """x, distinct top-k ids, positive weights, expert weights; scaled so values are O(1)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    x = jax.random.normal(keys[0], (b, t, D))
    if ids_BTK is None:
        scores = jax.random.uniform(keys[1], (b * t, e))
        ids_BTK = jnp.argsort(scores, axis=-1)[:, :k].reshape(b, t, k)
    weights = jax.random.uniform(keys[2], (b, t, k), minval=0.1, maxval=1.0)
    w_gate = jax.random.normal(keys[3], (e, D, F)) / math.sqrt(D)
    w_up = jax.random.normal(keys[4], (e, D, F)) / math.sqrt(D)
    w_down = jax.random.normal(keys[5], (e, F, D)) / math.sqrt(F)
    cotangent = jax.random.normal(keys[6], (b, t, D))
    return x, jnp.asarray(ids_BTK, jnp.int32), weights, w_gate, w_up, w_down, cotangent


def reference(x, ids, weights, w_gate, w_up, w_down, cotangent, keep=None):
    """Single-device output and gradients; `keep` [B, T, K] zeroes the weights of dropped copies."""
    if keep is not None:
        weights = weights * keep

    def loss(x, weights, w_gate, w_up, w_down):
        y, _ = routed_experts(x, ids, weights, w_gate, w_up, w_down, plan=None)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, weights, w_gate, w_up, w_down)
    if keep is not None:  # d/dweights of weights * keep
        grads = (grads[0], grads[1] * keep) + grads[2:]
    return y, grads


def distributed(plan, x, ids, weights, w_gate, w_up, w_down, cotangent, fsdp=False):
    """The plan's output, dropped fraction and gradients, with inputs laid out as the model lays them.

    Tokens are sharded over (data, expert) when the batch divides, else replicated.
    """
    mesh = plan.mesh

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    tokens = P(("data", "expert")) if x.shape[0] % plan.token_shards == 0 else P()
    embed = "data" if fsdp else None
    x, ids, weights, cotangent = (put(a, tokens) for a in (x, ids, weights, cotangent))
    w_gate, w_up = (put(w, P("expert", embed, "tensor")) for w in (w_gate, w_up))
    w_down = put(w_down, P("expert", "tensor", embed))

    def loss(x, weights, w_gate, w_up, w_down):
        y, dropped = routed_experts(x, ids, weights, w_gate, w_up, w_down, plan=plan)
        return jnp.sum(y * cotangent), (y, dropped)

    (_, (y, dropped)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        x, weights, w_gate, w_up, w_down
    )
    return y, float(dropped), grads


def assert_matches(plan, problem, keep=None, dropped_frac=0.0, fsdp=False):
    y_ref, grads_ref = reference(*problem, keep=keep)
    y, dropped, grads = distributed(plan, *problem, fsdp=fsdp)
    assert dropped == pytest.approx(dropped_frac, abs=1e-7)
    np.testing.assert_allclose(y, y_ref, **TOL)
    for name, g, g_ref in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, err_msg=f"gradient w.r.t. {name}", **TOL)


# ----------------------------------------------------------------------------------
# The single-device reference against a plain loop over experts.


def loop_over_experts(x_ND, ids_NK, weights_NK, w_gate, w_up, w_down):
    y = jnp.zeros_like(x_ND)
    for e in range(w_gate.shape[0]):
        weight_N = jnp.sum(jnp.where(ids_NK == e, weights_NK, 0.0), axis=-1)
        hidden = jax.nn.silu(x_ND @ w_gate[e]) * (x_ND @ w_up[e])
        y = y + weight_N[:, None] * (hidden @ w_down[e])
    return y


# mosaic_gpu needs a GPU (tests/test_kernels.py runs its wrapper on reference kernels);
# tokamax runs here through its reference path where it is installed.
@pytest.mark.parametrize(
    "backend", [b for b in GROUPED_MATMUL_BACKENDS if b != "mosaic_gpu" and (b != "tokamax" or not tokamax_problem())]
)
def test_local_routed_experts_matches_loop_over_experts(backend):
    x, ids, weights, w_gate, w_up, w_down, _ = random_problem(0, 3, 7, 8, 3)
    args = (x.reshape(21, D), ids.reshape(21, 3), weights.reshape(21, 3), w_gate, w_up, w_down)
    local = jax.jit(local_routed_experts, static_argnames="backend")(*args, backend=backend)
    np.testing.assert_allclose(local, jax.jit(loop_over_experts)(*args), **TOL)


# ----------------------------------------------------------------------------------
# Every strategy on every mesh equals the reference.


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_single_device(strategy, shape):
    plan = make_plan(make_mesh(shape), strategy, capacity_factor=4.0)  # capacity = n: nothing dropped
    assert_matches(plan, random_problem(1, 8, 4, 8, 2), fsdp=shape == (2, 4, 1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_expert_mlp_replicated_over_tensor(strategy):
    # F whole on every device of a tensor axis of 2: both tensor ranks compute the same
    # thing and no reduction over tensor may happen (it would double the output).
    specs = {"w_gate": P("expert", None, None), "w_up": P("expert", None, None), "w_down": P("expert", None, None)}
    plan = make_dispatch_plan(
        make_mesh((2, 2, 2)),
        MoEConfig(dispatch=strategy, capacity_factor=4.0),
        token_axes=("data", "expert"),
        weight_specs=specs,
        platform="cpu",
    )
    assert plan.tensor_axis is None
    assert_matches(plan, random_problem(11, 8, 4, 8, 2))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_skewed_routing_all_tokens_to_the_same_experts(strategy):
    # Every token picks experts 0 and 1: both on expert rank 0 of a (2, 4, 1) mesh,
    # which receives everything while ranks 1-3 receive nothing.
    ids = np.broadcast_to(np.array([0, 1]), (8, 4, 2))
    plan = make_plan(make_mesh((2, 4, 1)), strategy, capacity_factor=4.0)  # 8 x 4 / 2 = 16: capacity = n
    assert_matches(plan, random_problem(2, 8, 4, 8, 2, ids_BTK=ids))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shards_keep_all_tokens_on_their_own_rank(strategy):
    # Mesh (2, 2, 2), tokens over (data, expert): shard s = 2 d + r holds sequences
    # [2 s, 2 s + 2) and routes only to experts 4 r .. 4 r + 3, which live on its own
    # expert rank r: nothing crosses the expert axis.
    b, t, k, e = 8, 4, 2, 8
    rank_B = (np.arange(b) // 2) % 2
    ids = np.stack([4 * rank_B + (np.arange(b) + j) % 4 for j in range(k)], -1)
    ids = np.broadcast_to(ids[:, None, :], (b, t, k))
    plan = make_plan(make_mesh((2, 2, 2)), strategy, capacity_factor=4.0)
    assert_matches(plan, random_problem(3, b, t, e, k, ids_BTK=ids))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tokens_not_divisible_by_shards_pad_an_empty_shard(strategy):
    # 3 x 5 = 15 tokens on 8 token shards: padded to 16, 2 per shard; the last shard
    # holds one real token and one padding row that must be neither sent nor counted.
    plan = make_plan(make_mesh((1, 8, 1)), strategy, capacity_factor=8.0)
    assert_matches(plan, random_problem(4, 3, 5, 8, 2))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_top_k_equals_experts_per_rank(strategy):
    # E = 8 on 4 expert ranks: 2 local experts, top-2.
    plan = make_plan(make_mesh((2, 4, 1)), strategy, capacity_factor=4.0)
    assert_matches(plan, random_problem(5, 8, 4, 8, 2))


# ----------------------------------------------------------------------------------
# Dropping: NumPy transcriptions of each strategy's policy say which copies go.


def shard_tokens(ids_NK, shards):
    """The token indices of each token shard, in order."""
    n = ids_NK.shape[0] // shards
    return [(s * n + np.arange(n)) for s in range(shards)]


def ragged_keep(ids_BTK, mesh_shape, buffer_rows):
    """Receive buffers filled source-major (expert rank order), each source's rows by expert."""
    data, ranks, _ = mesh_shape
    b, t, k = ids_BTK.shape
    ids_NK = ids_BTK.reshape(b * t, k)
    keep = np.ones_like(ids_NK, dtype=np.float32)
    tokens = shard_tokens(ids_NK, data * ranks)
    local = 8 // ranks
    for d in range(data):
        for receiver in range(ranks):
            free = buffer_rows
            for source in range(ranks):
                rows = tokens[d * ranks + source]
                copies = [(ids_NK[n, j], n, j) for n in rows for j in range(k) if ids_NK[n, j] // local == receiver]
                for _, n, j in sorted(copies, key=lambda c: (c[0], c[1] * k + c[2])):
                    if free > 0:
                        free -= 1
                    else:
                        keep[n, j] = 0.0
    return keep.reshape(b, t, k)


def capacity_keep(ids_BTK, shards, capacity):
    """Each shard fills each expert's slots in (token, k) order."""
    b, t, k = ids_BTK.shape
    ids_NK = ids_BTK.reshape(b * t, k)
    keep = np.ones_like(ids_NK, dtype=np.float32)
    for rows in shard_tokens(ids_NK, shards):
        used = {}
        for n in rows:
            for j in range(k):
                used[ids_NK[n, j]] = used.get(ids_NK[n, j], 0) + 1
                if used[ids_NK[n, j]] > capacity:
                    keep[n, j] = 0.0
    return keep.reshape(b, t, k)


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_ragged_a2a_small_buffer_drops_exactly(shape):
    # Skewed: every token picks experts 0 and 1, on rank 0. n = 4 tokens per shard.
    ids = np.broadcast_to(np.array([0, 1]), (8, 4, 2))
    plan = make_plan(make_mesh(shape), "ragged_a2a", buffer_factor=1.5)
    n = 32 // (shape[0] * shape[1])
    buffer_rows = math.ceil(1.5 * n * 2)
    assert plan.buffer_rows(n, 2, 8) == buffer_rows
    keep = ragged_keep(ids, shape, buffer_rows)
    assert 0 < keep.sum() < keep.size
    assert_matches(plan, random_problem(6, 8, 4, 8, 2, ids_BTK=ids), keep=keep, dropped_frac=1 - keep.sum() / keep.size)


def test_ragged_a2a_buffer_factor_with_balanced_routing_drops_nothing():
    plan = make_plan(make_mesh((2, 4, 1)), "ragged_a2a", buffer_factor=2.0)
    assert_matches(plan, random_problem(7, 8, 4, 8, 2, ids_BTK=np.arange(64).reshape(8, 4, 2) % 8))


def test_capacity_drops_exactly():
    problem = random_problem(8, 8, 4, 8, 2)
    plan = make_plan(make_mesh((2, 4, 1)), "capacity", capacity_factor=1.0)  # ceil(4 x 2 / 8) = 1 slot
    assert plan.capacity(4, 2, 8) == 1
    keep = capacity_keep(np.asarray(problem[1]), 8, 1)
    assert 0 < keep.sum() < keep.size
    assert_matches(plan, problem, keep=keep, dropped_frac=1 - keep.sum() / keep.size)


# ----------------------------------------------------------------------------------
# The GPU program uses the real collective; the plan comes from the config; the plan is a module attribute.


def float_sums(stablehlo: str) -> list[str]:
    """The result types of a lowered program's float all-reduces, sorted."""
    found = re.finditer(r'"stablehlo.all_reduce".*?\}\) : \([^)]*\) -> (tensor<[^>]*f32>)', stablehlo, re.DOTALL)
    return sorted(m.group(1) for m in found)


def test_cuda_lowering_uses_native_ragged_all_to_all():
    mesh = make_mesh((2, 2, 2))
    x, ids, weights, w_gate, w_up, w_down, cotangent = random_problem(9, 8, 4, 8, 2)

    def lowered_grad(platform):
        plan = make_dispatch_plan(
            mesh, MoEConfig(), token_axes=("data", "expert"), weight_specs=WEIGHT_SPECS, platform=platform
        )

        def loss(x, weights, w_gate, w_up, w_down):
            y, _ = plan.routed_experts(x, ids, weights, w_gate, w_up, w_down)
            return jnp.sum(y * cotangent)

        traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(x, weights, w_gate, w_up, w_down)
        return plan, traced.lower(lowering_platforms=(platform,)).as_text()

    plan, text = lowered_grad("cuda")
    assert plan.strategy == "ragged_a2a" and plan.a2a_impl == "native"
    assert text.count("custom_call @ragged_all_to_all") == 4  # out and back, forward and backward
    # The emulation's signature is a dense all_to_all of [K, M, D] float blocks; the
    # native backward pass only exchanges [K] int32 offsets.
    for line in text.splitlines():
        if '"stablehlo.all_to_all"' in line:
            assert "xf32" not in line.split(":")[-1], line
    # The rows received vary over the devices as the rows sent do, so the gradient sums what the
    # emulation's does (the weights' over data, the rows' over tensor) and no row cotangents over
    # the token axes, which would hand each device every device's, summed.
    emulated_plan, emulated = lowered_grad("cpu")
    assert emulated_plan.a2a_impl == "emulate" and float_sums(emulated)
    assert float_sums(text) == float_sums(emulated)


def test_emulation_forced_and_auto():
    mesh = make_mesh((1, 8, 1))

    def make(emulate, platform):
        return make_dispatch_plan(
            mesh,
            MoEConfig(emulate_ragged_a2a=emulate),
            token_axes="expert",
            weight_specs=WEIGHT_SPECS,
            platform=platform,
        )

    assert make("auto", "cpu").a2a_impl == "emulate" and make("auto", "cuda").a2a_impl == "native"
    assert make("true", "cuda").a2a_impl == "emulate" and make("false", "cpu").a2a_impl == "native"
    with pytest.raises(ValueError, match="a2a_impl"):
        dataclasses.replace(make("auto", "cpu"), a2a_impl="bogus")


def test_build_layout_makes_the_plan():
    config = load_config(
        overrides=["mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "moe.dispatch=capacity", "mesh.fsdp=true"]
    )
    plan = build_layout(config).dispatch_plan
    assert isinstance(plan, DispatchPlan)
    assert (plan.strategy, plan.token_axes, plan.tensor_axis) == ("capacity", ("data", "expert"), "tensor")
    replicated_f = dict(config.mesh.rules, expert_mlp=[])
    config = config.replace(mesh=dataclasses.replace(config.mesh, rules=replicated_f))
    assert build_layout(config).dispatch_plan.tensor_axis is None


class _PlanHolder(nn.Module):
    plan: DispatchPlan

    @nn.compact
    def __call__(self, x, ids, weights):
        e = 8
        init = nn.initializers.normal(0.3)
        w_gate = self.param("w_gate", init, (e, D, F))
        w_up = self.param("w_up", init, (e, D, F))
        w_down = self.param("w_down", init, (e, F, D))
        return routed_experts(x, ids, weights, w_gate, w_up, w_down, plan=self.plan)


def test_plan_is_a_flax_module_attribute():
    plan = make_plan(make_mesh((1, 8, 1)), "ragged_a2a")
    x, ids, weights, *_ = random_problem(10, 8, 2, 8, 2)
    module = _PlanHolder(plan)
    params = jax.jit(module.init)(jax.random.PRNGKey(0), x, ids, weights)
    y, dropped = jax.jit(module.apply)(params, x, ids, weights)
    expected, _ = jax.jit(routed_experts)(x, ids, weights, *(params["params"][n] for n in ("w_gate", "w_up", "w_down")))
    np.testing.assert_allclose(y, expected, **TOL)
    assert float(dropped) == 0.0
