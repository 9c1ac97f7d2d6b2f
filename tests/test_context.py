"""Context parallelism (mesh.context): zigzag sequence shards, MLA latents gathered over `context`.

Oracles: the one-device run of the same tiny model (losses of three AdamW steps, step-1
gradients), the dense attention core on materialised keys and values, and hand-counted
all-gather sizes in the compiled program.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import host_init_state

from maxmoe.analysis.hlo import collective_ops, replica_groups
from maxmoe.config import load_config
from maxmoe.model import attention
from maxmoe.model.attention_ops import latent_attention, xla_attention
from maxmoe.model.rope import apply_rope
from maxmoe.parallel import context
from maxmoe.parallel.layout import build_layout
from maxmoe.parallel.names import LATENT_GATHER
from maxmoe.training import step as step_lib
from maxmoe.training.objective import make_loss_fn
from maxmoe.training.programs import build_programs

TINY = "configs/tiny.yaml"
# tiny with MTP, one dense and one MoE layer; 4-token attention blocks so the latent core's
# key loop, its block skipping and the zigzag chunks (32 / (2 x 4) = 4 tokens) all take part.
COMMON = [
    "model.compute_dtype=float32",
    "model.num_layers=2",
    "model.attention_chunk=4",
    "data.source=synthetic",
    "train.batch_size=4",
    "train.seq_len=32",
    "train.warmup_steps=0",
]
STEPS = 3


def _config(*overrides):
    return load_config([TINY], COMMON + list(overrides))


def _batches(config):
    rng = np.random.default_rng(7)
    shape = (config.train.batch_size, config.train.seq_len + 1)
    return [rng.integers(0, config.model.vocab_size, shape).astype(np.int32) for _ in range(STEPS)]


@functools.cache
def _initial_state():
    """Step 0 on the host: every layout starts from the same arrays."""
    return host_init_state(_config())


def _step_fn(config, layout, optimizer):
    """One train step that also returns the loss and its gradients (what the parity checks read)."""
    grad_fn = jax.value_and_grad(make_loss_fn(config, layout), has_aux=True)

    def run(state, batch_BT):
        (loss, aux), grads = grad_fn(state.params, state.router, batch_BT)
        new_state, _ = step_lib.apply_gradients(config, optimizer, state, loss, aux, grads)
        return new_state, loss, grads

    return run


def _train(*overrides):
    """(losses of STEPS steps, step-1 gradients, the compiled step's HLO text) on the overrides' mesh."""
    config = _config(*overrides)
    sizes = [config.mesh.data, config.mesh.context, config.mesh.expert, config.mesh.tensor]
    layout = build_layout(config, jax.devices()[: int(np.prod(sizes))])
    programs = build_programs(config, layout)
    state = jax.device_put(_initial_state(), programs.state_shardings)
    batches = [jax.device_put(b, programs.batch_sharding) for b in _batches(config)]
    compiled = (
        jax.jit(
            _step_fn(config, layout, programs.optimizer),
            in_shardings=(programs.state_shardings, programs.batch_sharding),
        )
        .lower(state, batches[0])
        .compile()
    )
    losses, first_grads = [], None
    for batch in batches:
        state, loss, grads = compiled(state, batch)
        losses.append(float(loss))
        if first_grads is None:
            first_grads = jax.tree.map(np.asarray, grads)
    return losses, first_grads, compiled.as_text()


@pytest.fixture(scope="module")
def reference():
    return _train()


@pytest.fixture(scope="module")
def folded():
    """data=2 x context=2 x expert=2: experts sharded 4-way over context x expert."""
    return _train("mesh.data=2", "mesh.context=2", "mesh.expert=2")


def _assert_parity(run, reference):
    losses, grads, _ = run
    # float32, the house default: shards sum the loss and gradients in another order (measured <= 6.1e-7)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (
        path,
        got,
    ), want in zip(flat, jax.tree.leaves(reference[1]), strict=True):
        bound = 1e-5 * max(np.linalg.norm(want), 1e-12)
        assert np.abs(got - want).max() <= bound, (jax.tree_util.keystr(path), np.abs(got - want).max(), bound)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh", [("mesh.context=2",), ("mesh.context=4",), ("mesh.context=2", "mesh.expert=2", "mesh.tensor=2")]
)
def test_context_matches_one_device(reference, mesh):
    _assert_parity(_train(*mesh), reference)


@pytest.mark.slow
def test_context_with_data_and_experts_matches_one_device(reference, folded):
    _assert_parity(folded, reference)


def _first_grads(*overrides):
    """(None, step-1 gradients) on the overrides' mesh: the backward pass without the optimizer."""
    config = _config(*overrides)
    layout = build_layout(config, jax.devices()[: config.mesh.data * config.mesh.context * config.mesh.expert])
    programs = build_programs(config, layout)
    state = jax.device_put(_initial_state(), programs.state_shardings)
    loss_fn = make_loss_fn(config, layout)
    grads = jax.jit(jax.grad(lambda p, r, b: loss_fn(p, r, b)[0]))(
        state.params, state.router, jax.device_put(_batches(config)[0], programs.batch_sharding)
    )
    return None, jax.tree.map(np.asarray, grads)


def _worst_gradient_error(run, reference):
    """max over leaves of max|g - g_ref| / |g_ref| (the parity check's ratio; it must stay <= 1e-5)."""
    return max(
        float(np.abs(got - want).max() / max(np.linalg.norm(want), 1e-12))
        for got, want in zip(jax.tree.leaves(run[1]), jax.tree.leaves(reference[1]), strict=True)
    )


@pytest.mark.slow
def test_contiguous_split_with_zigzag_gather_fails_parity(reference, monkeypatch):
    """Tokens in plain contiguous shards while the gather restores the zigzag order: caught."""
    monkeypatch.setattr(context, "zigzag_order", lambda t, c: np.arange(t))
    assert _worst_gradient_error(_first_grads("mesh.context=2"), reference) > 1e-3


@pytest.mark.slow
def test_local_rope_positions_fail_parity(reference, monkeypatch):
    """RoPE at each shard's local positions (0..T/C-1) instead of the natural ones: caught."""

    def local_rope(x, positions_BT, model):
        t = positions_BT.shape[1]  # each of the 2 shards numbers its T / 2 tokens from 0
        local_BT = jnp.broadcast_to(jnp.arange(t, dtype=positions_BT.dtype) % (t // 2), positions_BT.shape)
        return apply_rope(x, local_BT, model)

    monkeypatch.setattr(attention, "apply_rope", local_rope)
    assert _worst_gradient_error(_first_grads("mesh.context=2"), reference) > 1e-3


def _context_groups(sizes):
    """Device groups of the `context` axis in a (data, context, expert) mesh of `sizes`."""
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    return sorted(map(sorted, ids.transpose(0, 2, 1).reshape(-1, sizes[1]).tolist()))


def test_only_latents_are_gathered_over_context(folded):
    """Every all-gather over `context` is one layer's latent + rope key, in the compute dtype;
    their reduce-scatters return the gradients; nothing else is gathered over `context`."""
    config = _config("mesh.data=2", "mesh.context=2", "mesh.expert=2")
    m, hlo = config.model, folded[2]
    groups = _context_groups((2, 2, 2))
    group_of = {
        line.split("=")[0].strip().lstrip("%"): sorted(map(sorted, replica_groups(line, 8)))
        for line in hlo.splitlines()
        if " all-gather(" in line or " reduce-scatter(" in line or "-start(" in line
    }
    rows = [r for r in collective_ops(hlo, [0] * 8) if r["kind"] in ("all-gather", "reduce-scatter")]
    over_context = [r for r in rows if group_of[r["name"]] == groups]
    layers = m.num_layers + m.mtp_num_layers
    rows_per_device = config.train.batch_size // 4  # batch over data x expert
    # One gather per attention layer (remat none): B_local x T x (kv_lora_rank + qk_rope_head_dim) f32.
    latent_bytes = rows_per_device * config.train.seq_len * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    gathers = [r for r in over_context if r["kind"] == "all-gather"]
    scatters = [r for r in over_context if r["kind"] == "reduce-scatter"]
    assert [(r["dtype"], r["bytes_per_run"] * 2, r["runs"]) for r in gathers] == [("f32", latent_bytes, 1)] * layers
    assert all(LATENT_GATHER in r["op_name"] for r in gathers + scatters)  # the planner's exposed class
    assert [(r["dtype"], r["bytes_per_run"] * 2, r["runs"]) for r in scatters] == [("f32", latent_bytes, 1)] * layers


def test_latent_core_matches_dense_attention():
    """One device's zigzag queries against latents up-projected block by block = dense attention
    on materialised keys and values, outputs and every gradient."""
    b, s, h, nope, rope, v, lat, c = 2, 32, 3, 4, 2, 5, 6, 4
    keys = jax.random.split(jax.random.key(1), 6)
    q = jax.random.normal(keys[0], (b, s, h, nope + rope))
    latent, k_rope = jax.random.normal(keys[1], (b, s, lat)), jax.random.normal(keys[2], (b, s, rope))
    w_k, w_v = jax.random.normal(keys[3], (lat, h, nope)), jax.random.normal(keys[4], (lat, h, v))
    mine = context.zigzag_order(s, c).reshape(c, -1)[1]  # device 1 of 4: natural chunks 1 and 6
    positions = jnp.broadcast_to(jnp.asarray(mine), (b, mine.size))

    def dense(q, latent, k_rope, w_k, w_v):
        k_nope = jnp.einsum("bsl,lhk->bshk", latent, w_k)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + (rope,))], -1)
        return xla_attention(q, k, jnp.einsum("bsl,lhk->bshk", latent, w_v), 0.3)[:, mine]

    def core(q, latent, k_rope, w_k, w_v):
        return latent_attention(q[:, mine], positions, latent, k_rope, w_k, w_v, scale=0.3, block=4)

    args = (q, latent, k_rope, w_k, w_v)
    # float32 default: the blocked online softmax sums in another order than the dense one
    np.testing.assert_allclose(jax.jit(core)(*args), dense(*args), atol=1e-5)
    cotangent = jax.random.normal(keys[5], (b, mine.size, h, v))
    got = jax.jit(jax.grad(lambda *a: (core(*a) * cotangent).sum(), argnums=range(5)))(*args)
    want = jax.jit(jax.grad(lambda *a: (dense(*a) * cotangent).sum(), argnums=range(5)))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5 * float(np.abs(w).max()))


def test_zigzag_order_and_its_inverse():
    order = context.zigzag_order(16, 2)
    np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    laid_out = jnp.asarray(order)[None, :, None]
    np.testing.assert_array_equal(context.natural_from_layout(laid_out, 2)[0, :, 0], np.arange(16))


def _attention_temp_bytes(t: int, c: int) -> int:
    """Compiled temp bytes per device of one MLA layer's forward and backward at seq_len t over context=c."""
    config = _config(
        f"train.seq_len={t}", f"mesh.context={c}", "model.max_position_embeddings=4096", "model.attention_chunk=128"
    )
    layout = build_layout(config, jax.devices()[:c])
    m = config.model
    shapes = jax.eval_shape(
        lambda: attention.MLA(m).init(jax.random.key(0), jnp.zeros((1, 8, m.hidden_size)), jnp.zeros((1, 8), jnp.int32))
    )
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=layout.replicated()), shapes)
    b = config.train.batch_size
    x = jax.ShapeDtypeStruct((b, t, m.hidden_size), jnp.float32, sharding=layout.sharding(("batch", "seq", "embed")))
    positions = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=layout.sharding(("batch", "seq")))
    layer = attention.MLA(m, jnp.float32, layout)
    grad = jax.grad(lambda p, x, pos: layer.apply(p, x, pos).sum(), argnums=(0, 1))
    return jax.jit(grad).lower(params, x, positions).compile().memory_analysis().temp_size_in_bytes


def test_attention_temp_scales_with_seq_len_over_context():
    """Twice the sequence over context=2 needs the attention temp of the sequence on one device (within 10%)."""
    one = _attention_temp_bytes(512, 1)
    two = _attention_temp_bytes(1024, 2)
    assert abs(two - one) <= 0.1 * one, (one, two)


def test_experts_fold_over_context():
    """data=2 x context=2 x expert=2: experts 4-way over (context, expert), the sequence over context."""
    config = _config("mesh.data=2", "mesh.context=2", "mesh.expert=2")
    layout = build_layout(config, jax.devices())
    assert layout.spec(("expert", "embed", "expert_mlp"))[0] == ("context", "expert")
    assert layout.spec(("batch", "seq", "embed"))[:2] == (("data", "expert"), "context")
    assert layout.dispatch_plan.expert_ranks == 4
    assert layout.attention.name == "chunked"


def test_latent_core_keeps_no_per_block_residuals_inside_a_scan():
    """Under a layer scan the core's temp stays that of one call, not of every key block's probabilities."""
    b, s, h, nope, rope, v, lat = 1, 256, 2, 4, 2, 4, 6
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    args = [jnp.ones((b, s, h, nope + rope)), jnp.ones((b, s, lat)), jnp.ones((b, s, rope))]
    args += [jnp.ones((lat, h, nope)), jnp.ones((lat, h, v))]

    def one(q, latent, k_rope, w_k, w_v):
        return latent_attention(q, positions, latent, k_rope, w_k, w_v, scale=0.3, block=8).sum()

    def two_layers(q, latent, k_rope, w_k, w_v):
        body = lambda total, w: (total + one(q, latent, k_rope, w, w_v), None)  # noqa: E731
        return jax.lax.scan(body, 0.0, jnp.stack([w_k, w_k]))[0]

    def temp(fn):
        grad = jax.jit(jax.grad(fn, argnums=range(5)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    # Keeping the probabilities of all 32 x 32 block pairs was 45x one call's temp.
    assert temp(two_layers) <= 4 * temp(one)
