"""mesh.across_domains=zero1 on 8 CPU devices in two simulated scale-up domains of 4.

Mesh replica=2 x data=2 x expert=2 (scale_up_domain=4, mesh.data=4 in all). The oracle is
the same config on one device; one compiled two-tier program serves every test:
- losses of 3 steps and the eval loss equal one device's within 1e-5;
- the step-1 gradients (read from Adam's first moment, mu = (1 - b1) g, with clipping off);
- params and Adam state on ZeRO-1 shardings (over replica too), batch rows over replica;
- in the compiled program every collective crossing a domain runs once per step, while the
  in-domain ones run per micro-batch;
- a checkpoint written under mode fsdp restores into zero1 and back with identical values;
- mesh.zero1_gather=per_step: the same losses, eval and gradients, and no weight but the
  experts' gathered per layer and micro-batch (which the per_layer default does);
- mesh.zero1_reduce=per_layer: the same losses, eval and gradients; every layer-stack weight's
  cross-domain reduce-scatter inside the backward layer loop (once per layer), the same bytes
  across domains as the default, and ZeRO-1 shards that keep `layers` whole;
- summing inside the backward layer loop: the gradients of whole-gradient accumulation (the
  same accumulator with no weight routed per layer), and no per-micro-batch gradient stack of
  the experts (the compiled step's temporaries fall by at least its bytes).
"""

import collections
import math
import re
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util

from maxmoe.analysis.hlo import collective_ops
from maxmoe.config import load_config
from maxmoe.model.transformer import abstract_variables, uses_float32
from maxmoe.parallel.layout import build_layout
from maxmoe.parallel.mesh import device_domains
from maxmoe.training import accumulate
from maxmoe.training.checkpoint import Checkpointer
from maxmoe.training.programs import build_programs

ROOT = Path(__file__).resolve().parents[1]
STEPS, ACCUM, B1 = 3, 2, 0.9
COMMON = [
    "model.compute_dtype=float32",
    "model.num_layers=3",  # one dense layer, two MoE layers (a layer loop), one MTP depth: every kind of block
    "data.source=synthetic",
    "train.batch_size=16",
    "train.seq_len=16",
    f"train.grad_accum={ACCUM}",
    "train.warmup_steps=0",
    "train.clip_norm=0",
    f"train.b1={B1}",
]
DOMAINS = ["mesh.data=4", "mesh.expert=2", "mesh.fsdp=true", "mesh.scale_up_domain=4"]


def config_for(*overrides):
    return load_config([str(ROOT / "configs" / "tiny.yaml")], COMMON + list(overrides))


def batches(config):
    rng = np.random.default_rng(7)
    t = config.train
    return [rng.integers(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1), dtype=np.int32) for _ in range(4)]


def run(config, devices):
    """Three steps and an eval with one compiled step; losses, step-1 gradients, eval loss, the program."""
    layout = build_layout(config, devices)
    programs = build_programs(config, layout)
    compiled = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config)).lower().compile()
    state = programs.init(jax.random.key(0))
    data = batches(config)
    losses, grads = [], None
    for i in range(STEPS):
        state, metrics = compiled(state, jax.device_put(data[i], programs.batch_sharding))
        losses.append(float(metrics["loss"]))
        if i == 0:  # Adam's first moment after one step is (1 - b1) x the gradient
            grads = jax.tree.map(lambda m: np.asarray(m) / (1 - B1), state.opt_state[0].mu)
    eval_loss = float(programs.eval_step(state.params, state.router, jax.device_put(data[3], programs.batch_sharding)))
    return {
        "losses": losses,
        "grads": grads,
        "eval": eval_loss,
        "layout": layout,
        "programs": programs,
        "compiled": compiled,
        "state": state,
    }


@pytest.fixture(scope="module")
def one_device():
    return run(config_for(), jax.devices()[:1])


@pytest.fixture(scope="module")
def two_tier():
    return run(config_for(*DOMAINS, "mesh.across_domains=zero1"), jax.devices())


@pytest.fixture(scope="module")
def gathered_once():
    return run(config_for(*DOMAINS, "mesh.across_domains=zero1", "mesh.zero1_gather=per_step"), jax.devices())


@pytest.fixture(scope="module")
def per_layer():
    # The first micro-batch's sums, made inside its layer loops, are what the last one's
    # per-layer reduction adds its gradients to.
    return run(config_for(*DOMAINS, "mesh.across_domains=zero1", "mesh.zero1_reduce=per_layer"), jax.devices())


@pytest.mark.slow
def test_the_mesh_splits_data_into_replicas_across_domains(two_tier):
    layout = two_tier["layout"]
    assert dict(layout.mesh.shape) == {"replica": 2, "data": 2, "expert": 2, "tensor": 1}
    domains = device_domains(list(layout.mesh.devices.flat), 4)
    grid = np.array(domains).reshape(2, 4)
    assert (grid == grid[:, :1]).all() and grid[0, 0] != grid[1, 0]  # one replica per domain


@pytest.mark.slow
def test_losses_and_eval_match_one_device(one_device, two_tier):
    np.testing.assert_allclose(two_tier["losses"], one_device["losses"], rtol=1e-5)
    np.testing.assert_allclose(two_tier["eval"], one_device["eval"], rtol=1e-5)


def assert_gradients_match(got, reference):
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(reference))
    # Sums over replicas and micro-batches in another order: absolute error relative to the
    # largest gradient (entries near zero have no meaningful relative error).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale), got, reference)


@pytest.mark.slow
def test_gradients_match_one_device(one_device, two_tier):
    assert_gradients_match(two_tier["grads"], one_device["grads"])


@pytest.mark.slow
def test_gather_once_trains_like_one_device(one_device, gathered_once):
    # The bounds of the plain two-tier step's tests above: the whole copy only moves where the
    # gathers happen, so the sums differ from one device's in order alone (float32, ~1e-6).
    np.testing.assert_allclose(gathered_once["losses"], one_device["losses"], rtol=1e-5)
    np.testing.assert_allclose(gathered_once["eval"], one_device["eval"], rtol=1e-5)
    assert_gradients_match(gathered_once["grads"], one_device["grads"])


def per_layer_gathers(result) -> list[tuple[str, str, float]]:
    """(jax op name, dtype, bytes per run) of the all-gathers in a run's step that run once per
    MoE layer and micro-batch."""
    mesh = result["layout"].mesh
    rows = collective_ops(result["compiled"].as_text(), device_domains(list(mesh.devices.flat), 4))
    return sorted(
        (r["op_name"], r["dtype"], r["bytes_per_run"])
        for r in rows
        if r["kind"] == "all-gather" and r["runs"] == 2 * ACCUM
    )


@pytest.mark.slow
def test_gather_once_gathers_only_experts_per_layer_and_micro_batch(two_tier, gathered_once):
    weights = re.compile(r"moe_layers/(attention|attn_norm|mlp_norm|moe/shared)/")
    plain = per_layer_gathers(two_tier)
    named = [g for g in plain if weights.search(g[0])]
    assert named  # FSDP: each use of a weight gathers it (jax 0.12 keeps the scope of fewer of them)
    once = per_layer_gathers(gathered_once)
    assert once, "the layer loop's own gathers (the experts' dispatch) are there"
    assert [g for g in once if weights.search(g[0])] == []
    # The setting only takes gathers away: what is left ran in the default step too, and at most
    # what is left once the named weights' gathers are gone (exactly that under jax 0.10).
    assert not collections.Counter(once) - collections.Counter(plain), once
    assert len(once) <= len(plain) - len(named), (len(once), len(plain), len(named))


@pytest.mark.slow
def test_state_is_sharded_over_every_device(two_tier):
    programs = two_tier["programs"]
    for sharding in jax.tree.leaves(programs.state_shardings.params):
        assert "replica" in jax.tree.leaves(tuple(sharding.spec)), sharding.spec
    for array in jax.tree.leaves(two_tier["state"].opt_state[0].mu):
        shard = array.addressable_shards[0].data
        assert shard.size * 8 == array.size, (array.shape, array.sharding.spec)
    assert programs.batch_sharding.spec[0] == ("replica", "data", "expert")


@pytest.mark.slow
def test_cross_domain_collectives_run_once_per_step(two_tier):
    mesh = two_tier["layout"].mesh
    rows = collective_ops(two_tier["compiled"].as_text(), device_domains(list(mesh.devices.flat), 4))
    cross = [r for r in rows if r["cross_domain"]]
    assert any(r["kind"] == "all-gather" and "compute_copy" in r["op_name"] for r in cross)
    assert any("reduce_to_zero1" in r["op_name"] for r in cross)
    assert [r for r in cross if r["runs"] != 1] == []
    # The in-domain collectives of the model do run once per micro-batch: the loop is there.
    assert max(r["runs"] for r in rows if not r["cross_domain"]) >= ACCUM


@pytest.mark.slow
def test_checkpoints_move_between_fsdp_and_zero1(one_device, two_tier, tmp_path):
    fsdp_config = config_for(*DOMAINS, "mesh.across_domains=fsdp")
    fsdp = build_programs(fsdp_config, build_layout(fsdp_config))
    zero1 = two_tier["programs"]
    # The fresh state laid out as mode fsdp lays it out (zero1's init is compiled already).
    state = jax.device_put(zero1.init(jax.random.key(0)), fsdp.state_shardings)
    saved = jax.tree.map(np.asarray, state)

    def save_and_restore(config, state, step, folder, abstract):
        ckpt = Checkpointer(config, tmp_path / folder)
        ckpt.save(step, state, {"split": "train", "step": step}, force=True)
        ckpt.wait()
        restored = ckpt.restore_latest(abstract)
        ckpt.close()
        return restored.state

    restored = save_and_restore(fsdp_config, state, 1, "fsdp", zero1.abstract_state)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored), saved)
    for array, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(zero1.state_shardings)):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)
    # The restored state trains in the new mode: its first step is the one-device first step.
    config = config_for(*DOMAINS, "mesh.across_domains=zero1")
    stepped, metrics = two_tier["compiled"](restored, jax.device_put(batches(config)[0], zero1.batch_sharding))
    np.testing.assert_allclose(float(metrics["loss"]), one_device["losses"][0], rtol=1e-5)
    expected = jax.tree.map(np.asarray, stepped)
    back = save_and_restore(config, stepped, 2, "zero1", fsdp.abstract_state)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, back), expected)
    for array, sharding in zip(jax.tree.leaves(back), jax.tree.leaves(fsdp.state_shardings)):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)


@pytest.mark.slow
def test_reduce_per_layer_trains_like_one_device(one_device, per_layer):
    # The plain step's bounds: the same float32 sums in another order (per layer instead of per
    # leaf across domains; ~1e-7 relative seen), so 1e-5 leaves margin for rounding, not for a bug.
    np.testing.assert_allclose(per_layer["losses"], one_device["losses"], rtol=1e-5)
    np.testing.assert_allclose(per_layer["eval"], one_device["eval"], rtol=1e-5)
    assert_gradients_match(per_layer["grads"], one_device["grads"])


def cross_domain_rows(result) -> list[dict]:
    mesh = result["layout"].mesh
    rows = collective_ops(result["compiled"].as_text(), device_domains(list(mesh.devices.flat), 4))
    return [r for r in rows if r["cross_domain"]]


def reduction_bytes(rows) -> float:
    """Bytes of the ZeRO-1 reduction as reduce-scatters move them (XLA:CPU's all-reduce: half)."""
    zero1 = [r for r in rows if "reduce_to_zero1" in r["op_name"]]
    return sum(r["bytes"] / (2 if r["kind"] == "all-reduce" else 1) for r in zero1)


@pytest.mark.slow
def test_reduce_per_layer_reduces_each_layer_inside_the_backward_loop(two_tier, per_layer):
    params = nn.unbox(abstract_variables(config_for().model, boxed=True)["params"])
    stacks = collections.Counter(
        path[0] for path in traverse_util.flatten_dict(params) if path[0].endswith("_layers") and not uses_float32(path)
    )
    cross = cross_domain_rows(per_layer)
    in_loop = [r for r in cross if r["kind"] == "reduce-scatter" and "reduce_to_zero1" in r["op_name"]]
    # One reduce-scatter per weight of each stack (the float32 norm scales and router gate are
    # reduced after the loop with the weights outside the stacks), run once per layer.
    for stack, layers in (("dense_layers", 1), ("moe_layers", 2)):
        rows = [r for r in in_loop if f"/{stack}/" in r["op_name"]]
        assert len(rows) == stacks[stack] and {r["runs"] for r in rows} == {layers}, (stack, rows)
        assert all("transpose(" in r["op_name"] and "/while/" in r["op_name"] for r in rows)
    # The same bytes cross domains: the reduction (moved, not added) and the once-per-step gathers.
    plain = cross_domain_rows(two_tier)
    assert reduction_bytes(cross) == pytest.approx(reduction_bytes(plain), rel=1e-3)
    gathers = [(r["op_name"], r["bytes"]) for r in plain if r["kind"] == "all-gather"]
    assert sorted((r["op_name"], r["bytes"]) for r in cross if r["kind"] == "all-gather") == sorted(gathers)
    # ZeRO-1 keeps every stack's `layers` whole, and still shards each weight over `replica`.
    for path, sharding in traverse_util.flatten_dict(per_layer["programs"].state_shardings.params).items():
        if path[0].endswith("_layers"):
            assert sharding.spec[0] is None and "replica" in jax.tree.leaves(tuple(sharding.spec)), (path, sharding)


@pytest.mark.slow
def test_reduce_per_layer_lowers_for_cuda():
    """The GPU program (lowered for CUDA, the kernels auto picks): one reduce-scatter per
    layer-stack weight, in the stacks' backward loops (the default two-tier step has none: its
    cross-domain reduction is XLA's, after the loop)."""
    from maxmoe.analysis.lowering import lower_train_step

    shapes = ["model.compute_dtype=bfloat16", "model.hidden_size=128", "model.moe_mlp_dim=64"]
    options = ["mesh.across_domains=zero1", "mesh.zero1_reduce=per_layer"]
    config = config_for(*DOMAINS, *options, *shapes)
    params = nn.unbox(abstract_variables(config.model, boxed=True)["params"])
    hooked = [p for p in traverse_util.flatten_dict(params) if p[0].endswith("_layers") and not uses_float32(p)]
    text = lower_train_step(config, "cuda").as_text()
    assert len(re.findall(r"stablehlo\.reduce_scatter", text)) == len(hooked)


@pytest.mark.slow
def test_layer_stacks_sum_inside_the_layer_loop(monkeypatch):
    # Two MoE layers alone (no dense layer or MTP: less to compile), experts 32 x 1024 (the
    # stack's gradients dominate what a step holds) and remat full (no saved activations beside
    # them): one step of the accumulator with no weight routed per layer (whole-gradient
    # accumulation: each micro-batch differentiated w.r.t. every weight, then added) and one as
    # it runs, from the same state and batch.
    model = ["model.num_layers=2", "model.first_k_dense=0", "model.mtp_num_layers=0", "model.moe_mlp_dim=1024"]
    config = config_for(*DOMAINS, *model, "model.remat=full", "mesh.across_domains=zero1")
    results, host = {}, None
    for summing in (False, True):
        with monkeypatch.context() as patch:
            if not summing:
                patch.setattr(accumulate, "stacked_paths", lambda *_: [])
            programs = build_programs(config, build_layout(config))
            compiled = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config))
            compiled = compiled.lower().compile()
        host = jax.tree.map(np.asarray, programs.init(jax.random.key(0))) if host is None else host
        state = jax.device_put(host, programs.state_shardings)  # the step donates it
        stepped, metrics = compiled(state, jax.device_put(batches(config)[0], programs.batch_sharding))
        grads = jax.tree.map(lambda m: np.asarray(m) / (1 - B1), stepped.opt_state[0].mu)
        results[summing] = (float(metrics["loss"]), grads, compiled.memory_analysis().temp_size_in_bytes)
    (loss, grads, plain_temp), (summed_loss, summed_grads, summed_temp) = results[False], results[True]
    # The same float32 sums of the same per-layer gradients, added inside the loop instead of after it.
    assert summed_loss == pytest.approx(loss, rel=1e-6)
    assert_gradients_match(summed_grads, grads)
    # What whole-gradient accumulation holds and this does not: each micro-batch's gradient stack of the
    # routed experts ([layers, experts per device, ...] of w_gate, w_up, w_down; float32 here).
    layout = build_layout(config)
    boxed = abstract_variables(config.model, boxed=True)["params"]
    shardings = traverse_util.flatten_dict(layout.tree_shardings(boxed))
    weights = traverse_util.flatten_dict(nn.unbox(boxed))
    experts = [p for p in weights if p[:2] == ("moe_layers", "moe") and p[2].startswith("w_")]
    stack = sum(math.prod(shardings[p].shard_shape(weights[p].shape)) * 4 for p in experts)
    assert len(experts) == 3 and plain_temp - summed_temp >= stack, (plain_temp, summed_temp, stack)
