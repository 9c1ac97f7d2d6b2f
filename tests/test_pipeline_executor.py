"""The pipeline executor on a small model: gradients against plain autodiff, memory against GPipe.

The toy model has the pieces that make maxmoe's pipeline non-uniform: a `pre` (input
projection), a stack of residual layers with an aux loss and per-layer statistics cut into
chunks (padding slots included), and a `post` that re-reads a `pre` parameter (as MTP
re-reads the embedding); then, as maxmoe runs the 671B model, leading layers of another kind
whose weights are outer parameters taking slots of the stage plan (the dense layers), and a
second loss on the last chunk's output run by stage 0 as the pipeline's tail (MTP). The
oracle is jax.value_and_grad of the same functions composed in model order, averaged over
micro-batches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from maxmoe.parallel.pipeline import PipelineFns, pipeline_forward, pipeline_value_and_grad
from maxmoe.parallel.pipeline_schedule import SlotLayout, build_schedule

D_IN, D, C = 8, 16, 4
AUX = 0.01


def pre(outer, outer_state, inp):
    del outer_state
    return jnp.tanh(inp["x"] @ outer["w_in"])


def layer(h, w):
    y = h + jnp.tanh(h @ w)
    return y, jnp.mean(y**2)


def make_stage(layer_fn):
    """A stage of scanned slots of layer_fn; masked-off (padding) slots pass h through, aux 0."""

    def stage(params, state, h):
        chunk, _ = params  # (the chunk's parameters, the shared outer ones: none here)

        def slot(h, inputs):
            w, on = inputs
            y, aux = layer_fn(h, w)
            return jnp.where(on, y, h), jnp.where(on, aux, 0.0)

        h, aux = jax.lax.scan(slot, h, (chunk["w"], state["mask"]))
        return (h, aux.sum()), {"aux": aux}

    return stage


stage = make_stage(layer)


def post(outer, outer_state, h, inp):
    del outer_state
    loss = jnp.mean((h @ outer["w_out"] - inp["y"]) ** 2) + 0.1 * jnp.mean(outer["w_in"] ** 2)
    return loss, {"loss": loss}


FNS = PipelineFns(pre, stage, post, aux_weight=AUX)


def problem(layers, micro, mb=4, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    stack = jax.random.normal(k[0], (layers, D, D)) / np.sqrt(D)
    outer = {"w_in": jax.random.normal(k[1], (D_IN, D)) / np.sqrt(D_IN), "w_out": jax.random.normal(k[2], (D, C))}
    inputs = {"x": jax.random.normal(k[3], (micro, mb, D_IN)), "y": jax.random.normal(k[4], (micro, mb, C))}
    return stack, outer, inputs


def oracle(stack, outer, inputs):
    """Mean over micro-batches of post(stack(pre(x))) + AUX x the layers' aux, by plain autodiff."""

    def loss(stack, outer):
        def one(inp):
            h = pre(outer, None, inp)
            h, aux = jax.lax.scan(layer, h, stack)
            return post(outer, None, h, inp)[0] + AUX * aux.sum()

        return jnp.mean(jax.vmap(one)(inputs))

    return jax.value_and_grad(loss, argnums=(0, 1))(stack, outer)


def assert_close(got, want):
    # float32; the pipeline sums micro-batches and layers in another order than the oracle, so
    # differences scale with the largest terms of the sum: 1e-5 relative to the array's largest entry.
    # The scalar checks in this file (losses, per-layer statistics) use the same float32 1e-5
    # relative bound for the same reason: reordered sums, no other source of error.
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def pipeline_mesh(stages):
    return Mesh(np.array(jax.devices()[:stages]), ("pipeline",))


def run_pipeline(slots, micro, residuals="vjp"):
    stack, outer, inputs = problem(slots.layers, micro)
    stage_params = {"w": slots.to_stages(stack)}
    stage_state = {"mask": jnp.asarray(slots.mask())}
    schedule = build_schedule(slots.stages, slots.virtual, micro)
    fn = pipeline_value_and_grad(FNS, schedule, pipeline_mesh(slots.stages), residuals=residuals)
    loss, (g_stage, g_outer_P), (stats, _) = jax.jit(fn)(stage_params, stage_state, outer, {}, inputs)
    # The outer gradients come per stage (pre's on the first, post's on the last), for the caller to sum.
    assert all(g.shape[0] == slots.stages for g in jax.tree.leaves(g_outer_P))
    return (stack, outer, inputs), loss, g_stage, jax.tree.map(lambda g: g.sum(0), g_outer_P), stats


def test_gradients_match_autodiff():
    """residuals="recompute" (the default "vjp" is checked on maxmoe itself in test_pipeline.py),
    interleaved with padding at both ends."""
    slots = SlotLayout(7, 2, 2, 2)  # 7 layers in 2 x 2 chunks of 3 slots: 2 empty in front, 3 at the back
    (stack, outer, inputs), loss, g_stage, g_outer, stats = run_pipeline(slots, 4, "recompute")
    want_loss, (want_stack, want_outer) = oracle(stack, outer, inputs)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_close(slots.to_model(g_stage["w"]), want_stack)
    jax.tree.map(assert_close, g_outer, want_outer)
    pad = ~slots.mask()
    assert pad.sum() == 5
    assert not np.any(np.asarray(g_stage["w"])[pad]), "padding slots must get exactly zero gradient"
    # Per-slot statistics summed over micro-batches: the model's aux per layer, in model order.
    h = jax.vmap(lambda inp: pre(outer, None, inp))(inputs)
    per_layer = []
    for w in stack:
        h, aux = jax.vmap(layer, in_axes=(0, None))(h, w)
        per_layer.append(aux.sum())
    np.testing.assert_allclose(slots.to_model(stats["aux"]), np.array(per_layer), rtol=1e-5)


def test_forward_loop_gives_the_mean_loss():
    slots = SlotLayout(5, 2, 2, 0)
    stack, outer, inputs = problem(slots.layers, 4)
    fn = pipeline_forward(FNS, build_schedule(2, 2, 4), pipeline_mesh(2))
    loss, stats = jax.jit(fn)({"w": slots.to_stages(stack)}, {"mask": jnp.asarray(slots.mask())}, outer, {}, inputs)

    def one(inp):
        h, _ = jax.lax.scan(layer, pre(outer, None, inp), stack)
        return post(outer, None, h, inp)[0]

    want = jax.vmap(one)(inputs)
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["loss"], want.sum(), rtol=1e-5)


def temp_bytes(fn, *args):
    return jax.jit(fn).trace(*args).lower().compile().memory_analysis().temp_size_in_bytes


def test_activation_memory_is_bounded_by_stages_not_micro_batches():
    """Compiled temp memory per device with the micro-batch size fixed: the 1F1B ring holds
    P*V + P - 1 items whatever M; differentiating the forward loop (GPipe) holds all M."""
    slots = SlotLayout(8, 2, 2, 0)
    mb = 64  # activations dominate the small weights
    temps, gpipe = {}, {}
    for micro in (4, 8):
        stack, outer, inputs = problem(slots.layers, micro, mb)
        args = ({"w": slots.to_stages(stack)}, {"mask": jnp.asarray(slots.mask())}, outer, {}, inputs)
        schedule = build_schedule(2, 2, micro)
        temps[micro] = temp_bytes(pipeline_value_and_grad(FNS, schedule, pipeline_mesh(2)), *args)
        forward = pipeline_forward(FNS, schedule, pipeline_mesh(2))
        gpipe[micro] = temp_bytes(jax.grad(lambda p, *rest, f=forward: f(p, *rest)[0]), *args)
    assert temps[8] <= 1.15 * temps[4], temps
    assert gpipe[8] >= 1.5 * gpipe[4], gpipe  # the control: the measurement tells the two apart


def bf16_layer(h, w):
    """A layer whose matmul runs in bfloat16, so its jax.vjp keeps bfloat16 residuals."""
    product = jnp.dot(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    y = h + jnp.tanh(product)
    return y, jnp.mean(y**2)


def test_bfloat16_residuals_pass_through_the_ring_exactly():
    """The ring keeps sub-32-bit residuals as raw bits. Oracle: the same pipeline with
    residuals="recompute", whose ring holds only the float32 chunk input and which re-runs
    the chunk (so the same bf16 products per micro-batch; autodiff of the whole batch at
    once would round the bf16 weight gradients differently)."""

    slots = SlotLayout(4, 2, 1, 0)
    stack, outer, inputs = problem(slots.layers, 4)
    args = ({"w": slots.to_stages(stack)}, {"mask": jnp.asarray(slots.mask())}, outer, {}, inputs)
    fns, schedule = PipelineFns(pre, make_stage(bf16_layer), post, AUX), build_schedule(2, 1, 4)
    results = {}
    for residuals in ("vjp", "recompute"):
        fn = pipeline_value_and_grad(fns, schedule, pipeline_mesh(2), residuals=residuals)
        results[residuals] = jax.jit(fn)(*args)
        assert residuals == "recompute" or "bfloat16" in [d for _, d in fn.info["residual_shapes"]], fn.info
    (loss, grads, stats), (want_loss, want_grads, want_stats) = results["vjp"], results["recompute"]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    jax.tree.map(assert_close, (grads, stats), (want_grads, want_stats))


KD = 2  # leading layers of the other kind


def dense_layer(h, w):
    return h + 0.5 * jnp.tanh(h @ w)


def mixed_stage(params, state, h):
    """Slots of either kind: a stack layer where `mask`, else the shared layer `dense` (-1: empty)."""
    chunk, shared = params

    def slot(h, inputs):
        w, on, j = inputs
        y, aux = layer(h, w)
        y_dense = dense_layer(h, shared["w_dense"][jnp.maximum(j, 0)])
        return jnp.where(on, y, jnp.where(j >= 0, y_dense, h)), jnp.where(on, aux, 0.0)

    h, aux = jax.lax.scan(slot, h, (chunk["w"], state["mask"], state["dense"]))
    return (h, aux.sum()), {"aux": aux}


def tail(outer, outer_state, h, inp):
    """A second loss on the last output; it re-reads post's head as MTP does. post's stats structure."""
    del outer_state
    loss = jnp.mean((jnp.tanh(h @ outer["w_tail"]) + h @ outer["w_out"] - inp["y"]) ** 2)
    return loss, {"loss": loss}


MIXED = PipelineFns(pre, mixed_stage, post, aux_weight=AUX, shared=("w_dense",), tail=tail)


@pytest.mark.parametrize("virtual", [1, 2])
def test_shared_layers_in_slots_and_a_tail_match_autodiff(virtual):
    """2 dense + 5 stack layers on 2 stages, 1 empty slot in front; the tail on stage 0 (turnaround 2)."""
    slots = SlotLayout(5, 2, virtual, 1, dense=KD)
    stack, outer, inputs = problem(slots.layers, 4)
    k = jax.random.split(jax.random.key(1), 2)
    outer = {
        **outer,
        "w_dense": jax.random.normal(k[0], (KD, D, D)) / np.sqrt(D),
        "w_tail": jax.random.normal(k[1], (D, C)),
    }
    state = {"mask": jnp.asarray(slots.mask()), "dense": jnp.asarray(slots.dense_at())}
    schedule = build_schedule(2, virtual, 4, turnaround=2)
    fn = pipeline_value_and_grad(MIXED, schedule, pipeline_mesh(2))
    loss, (g_stage, g_outer_P), (stats, post_stats) = jax.jit(fn)(
        {"w": slots.to_stages(stack)}, state, outer, {}, inputs
    )

    def model_loss(stack, outer):
        def one(inp):
            h = pre(outer, None, inp)
            h, _ = jax.lax.scan(lambda h, w: (dense_layer(h, w), None), h, outer["w_dense"])
            h, aux = jax.lax.scan(layer, h, stack)
            return post(outer, None, h, inp)[0] + tail(outer, None, h, inp)[0] + AUX * aux.sum()

        return jnp.mean(jax.vmap(one)(inputs))

    want_loss, (want_stack, want_outer) = jax.value_and_grad(model_loss, argnums=(0, 1))(stack, outer)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_close(slots.to_model(g_stage["w"]), want_stack)
    jax.tree.map(assert_close, jax.tree.map(lambda g: g.sum(0), g_outer_P), want_outer)
    # The dense layers' gradients come from the stages whose slots ran them, the tail's from stage 0.
    dense_stage = np.asarray(g_outer_P["w_dense"])
    on_stage = [set(slots.dense_at()[:, p].ravel()) - {-1} for p in range(2)]
    for p in range(2):
        for j in range(KD):
            assert np.any(dense_stage[p, j]) == (j in on_stage[p]), (p, j, on_stage)
    assert np.any(np.asarray(g_outer_P["w_tail"])[0]) and not np.any(np.asarray(g_outer_P["w_tail"])[1])
    assert not np.any(np.asarray(g_stage["w"])[~slots.mask()]), "slots without a stack layer get zero gradient"
    # post's and the tail's statistics summed over micro-batches.
    h = jax.vmap(lambda inp: pre(outer, None, inp))(inputs)
    for w in outer["w_dense"]:
        h = dense_layer(h, w)
    for w in stack:
        h, _ = jax.vmap(layer, in_axes=(0, None))(h, w)
    want = sum(jax.vmap(f, in_axes=(None, None, 0, 0))(outer, None, h, inputs)[0].sum() for f in (post, tail))
    np.testing.assert_allclose(post_stats["loss"], want, rtol=1e-5)
