"""Pipeline stages train like one device: tiny (5 layers, MTP on) in float32 over 3 steps.

The single-device run with the same micro-batches is the oracle. The layout is the
issue's first acceptance layout, pipeline=2 x data=2 x expert=2 with the ragged
all-to-all, interleaved (2 chunks per stage) and with one empty slot in front: the dense
layer and 4 MoE layers in 8 slots (the dense layer in stage 0's first chunk, after the empty
slot), so padding must be an exact no-op; MTP runs as the pipeline's tail on stage 0. (pipeline=4 x expert=2 with the
all-gather dispatch is the other acceptance layout; docs/SHARDING.md has its command.)
Checkpoints are written in model order: the pipeline's step-2 checkpoint resumes on one
device, the one device's on the pipeline, and each then takes step 3 as the other run did.
The weights outside the layer stack keep master weights and Adam moments split over the
stages (tests/test_pipeline_bf16.py: the same in bf16). The CUDA lowering keeps the expert
all-to-alls inside a stage.
"""

import json
import math
import re

import jax
import numpy as np
import pytest

from maxmoe.analysis.hlo import collective_spans
from maxmoe.analysis.lowering import lower_train_step
from maxmoe.config import load_config
from maxmoe.parallel.layout import build_layout
from maxmoe.training import checkpoint, stage_state
from maxmoe.training import step as step_lib
from maxmoe.training.programs import build_programs

TINY = "configs/tiny.yaml"
COMMON = [
    "model.compute_dtype=float32",
    "model.num_layers=5",  # 1 dense + 4 MoE layers
    "data.source=synthetic",
    "train.batch_size=16",
    "train.seq_len=16",
    "train.grad_accum=4",
    "train.warmup_steps=0",
]
PIPELINE = [
    "mesh.pipeline=2",
    "mesh.data=2",
    "mesh.expert=2",
    "mesh.pipeline_virtual=2",
    "mesh.pipeline_pad_front=1",
    "moe.dispatch=ragged_a2a",
]
STEPS = 3
METRICS = ("loss", "lm_loss", "mtp_loss", "seq_aux", "grad_norm", "moe_layer_imbalance", "router_bias_spread")


def config_of(overrides, tmp_path=None):
    run = [f"run.dir={tmp_path}"] if tmp_path is not None else []
    return load_config([TINY], COMMON + list(overrides) + run)


def batches():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 260, (16, 17)).astype(np.int32) for _ in range(STEPS)]


class Run:
    """A layout's programs (train step compiled once), its per-step metrics and its step-2 checkpoint.

    `start`: the initial state in model order (host arrays); default: this layout's own init.
    """

    def __init__(self, overrides, run_dir, start=None):
        self.config = config_of(overrides, run_dir)
        m = self.config.mesh
        self.layout = build_layout(self.config, jax.devices()[: m.pipeline * m.data * m.expert * m.tensor])
        self.programs = build_programs(self.config, self.layout)
        self.step = (
            self.programs.train_step.trace(self.programs.abstract_state, self.programs.abstract_batch(self.config))
            .lower()
            .compile()
        )
        self.run_dir = run_dir
        self.checkpointer = checkpoint.Checkpointer(self.config, run_dir)
        self.metrics = []
        key = jax.random.key(0)
        if start is None:
            state = self.programs.init(key)
        else:
            state = stage_state.to_stage_order(self.config, start, self.programs.abstract_state)
        self.start = jax.device_get(state)
        for i, batch in enumerate(batches()):
            state, metrics = self.step(state, self.put(batch))
            self.metrics.append(jax.device_get(metrics))
            if i == 1:
                self.checkpointer.save(2, state, {}, force=True)
                self.state_2 = jax.device_get(stage_state.to_model_order(self.config, state))
                self.checkpointer.wait()
        self.state = state

    def put(self, batch):
        return jax.device_put(batch, self.programs.batch_sharding)

    def restore(self, run_dir=None):
        """The latest checkpoint of `run_dir` (default: this run's) restored for this run's layout."""
        checkpointer = checkpoint.Checkpointer(self.config, run_dir) if run_dir else self.checkpointer
        return checkpointer.restore_latest(self.programs.abstract_state).state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = Run(["mesh.data=1"], tmp_path_factory.mktemp("one"))
    # The same initial parameters on the stages (init's own program: test_init_lays_out_the_stack).
    return {"one": one, "pipeline": Run(PIPELINE, tmp_path_factory.mktemp("pipeline"), start=one.start)}


@pytest.mark.slow
def test_init_lays_out_the_stack(runs):
    """The pipeline's init program builds the stage layout of the model's init (shapes and shardings;
    its values are the model's init re-laid, the re-layout is checked by the checkpoint test)."""
    programs = runs["pipeline"].programs
    built = jax.eval_shape(programs.init, jax.random.key(0))
    want = programs.abstract_state
    assert jax.tree.structure(built) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(built), jax.tree.leaves(want), strict=True):
        assert (got.shape, got.dtype, got.sharding) == (expected.shape, expected.dtype, expected.sharding)
    assert want.params["moe_layers"]["moe"]["w_gate"].shape[:3] == (2, 2, 2)  # [V, P, S, ...]


@pytest.mark.slow
def test_outer_weights_and_moments_are_split_over_the_stages(runs):
    """Every stage computes with the parameters outside the layer stack (embedding, dense layer,
    head, MTP), but their float32 master weights and Adam moments are not kept whole on each:
    every leaf holds 1/stages of what the stage's own sharding (the rules) gives a device."""
    run = runs["pipeline"]
    boxed = step_lib.abstract_state(run.config, run.programs.optimizer, boxed=True)
    in_stage = run.layout.tree_shardings(boxed)
    outer = 0
    for tree in ("params", "opt_state"):
        got = jax.tree_util.tree_flatten_with_path(getattr(run.state, tree))[0]
        rules = jax.tree.leaves(getattr(in_stage, tree))
        for (path, leaf), sharding in zip(got, rules, strict=True):
            if any(getattr(k, "key", None) == "moe_layers" for k in path) or leaf.ndim == 0:
                continue
            outer += 1
            held = math.prod(leaf.addressable_shards[0].data.shape)
            assert held * run.config.mesh.pipeline == math.prod(sharding.shard_shape(leaf.shape)), path
    assert outer > 30  # embedding, dense layer, head, MTP: master weights and both moments


def assert_metrics_match(got, want, first_step=1):
    # float32: stage layouts sum gradients and expert outputs in other orders (~1e-6 relative).
    # Step 1 compares the gradients the pipeline computes from the same parameters: 1e-5. Later
    # steps start from parameters AdamW moved, where elements with gradients near Adam's eps
    # turn those differences into ~1e-5 relative ones: the parity tolerance, 1e-4, as
    # test_mesh_parity.py uses for every mesh layout.
    for step, (g, w) in enumerate(zip(got, want, strict=True), first_step):
        rtol = 1e-5 if step == 1 else 1e-4
        for key in METRICS:
            np.testing.assert_allclose(g[key], w[key], rtol=rtol, atol=1e-6, err_msg=f"step {step} {key}")


@pytest.mark.slow
def test_losses_match_one_device(runs):
    assert_metrics_match(runs["pipeline"].metrics, runs["one"].metrics)


@pytest.mark.slow
def test_one_chunk_per_stage_with_the_dense_layer_in_a_slot_and_mtp_on_stage_0(runs):
    """The H200 plan's kind of layout (configs/mesh_256_h200.yaml): one chunk per stage, every
    layer in a slot, MTP on stage 0 as the pipeline's tail -- here [- D0 M0 | M1 M2 M3], stage 0
    with the embedding, the dense layer, a MoE layer and MTP, stage 1 with three MoE layers and
    the head -- steps like one device from the same parameters and batches."""
    layout = ["mesh.pipeline=2", "mesh.data=2", "mesh.expert=2", "mesh.pipeline_pad_front=1", "moe.dispatch=ragged_a2a"]
    config = config_of(layout)
    slots = stage_state.slot_layout(config)
    assert slots.dense_at()[0].tolist() == [[-1, 0, -1], [-1, -1, -1]]
    assert slots.layer_at()[0].tolist() == [[-1, -1, 0], [1, 2, 3]]
    programs = build_programs(config, build_layout(config, jax.devices()[:8]))
    state = stage_state.to_stage_order(config, runs["one"].start, programs.abstract_state)
    got = []
    for batch in batches()[:2]:
        state, metrics = programs.train_step(state, jax.device_put(batch, programs.batch_sharding))
        got.append(jax.device_get(metrics))
    assert_metrics_match(got, runs["one"].metrics[:2])


@pytest.mark.slow
def test_padding_slots_stay_zero(runs):
    run = runs["pipeline"]
    pad = ~stage_state.slot_layout(run.config).mask()
    # 4 MoE layers in 2 stages x 2 chunks x 2 slots: 1 empty in front, the dense layer's, 2 at the back
    assert pad.sum() == 4 and stage_state.slot_layout(run.config).dense_at()[0, 0].tolist() == [-1, 0]
    stacked = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(run.state)[0]
        if any(getattr(k, "key", None) == "moe_layers" for k in path)
    ]
    assert len(stacked) > 20  # parameters, router biases, both Adam moments
    for leaf in stacked:
        assert leaf.shape[:3] == pad.shape
        assert not np.any(np.asarray(leaf)[pad]), "a padding slot moved"


@pytest.mark.slow
def test_checkpoint_pipeline_to_one_device_and_back(runs):
    one, pipe = runs["one"], runs["pipeline"]
    # The pipeline's checkpoint (model order) on one device: exactly what was saved; step 3
    # then gives the pipeline's step 3.
    state = one.restore(pipe.run_dir)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), pipe.state_2)
    _, metrics = one.step(state, one.put(batches()[2]))
    assert_metrics_match([jax.device_get(metrics)], [pipe.metrics[2]], first_step=3)
    # The one device's checkpoint on the stages (padding slots zero), step 3: the one device's step 3.
    state = pipe.restore(one.run_dir)
    model_order = jax.device_get(stage_state.to_model_order(pipe.config, state))
    jax.tree.map(np.testing.assert_array_equal, model_order, one.state_2)
    _, metrics = pipe.step(state, pipe.put(batches()[2]))
    assert_metrics_match([jax.device_get(metrics)], [one.metrics[2]], first_step=3)


def test_cuda_lowering_keeps_expert_traffic_in_a_stage():
    text = lower_train_step(config_of(PIPELINE), "cuda").as_text()
    stage_of = [d // 4 for d in range(8)]  # pipeline is the outermost axis: devices 0-3, 4-7
    spans = collective_spans(text, stage_of)
    assert spans["ragged_all_to_all"].get("inside", 0) > 0 and set(spans["ragged_all_to_all"]) == {"inside"}
    for kind in ("all_to_all", "all_gather", "reduce_scatter"):
        assert set(spans[kind]) <= {"inside"}, (kind, spans[kind])
    # Between stages only the activations' permutes (each device with its peer in the other stage)
    # and the end-of-step sums of the replicated parameters' gradients, loss and statistics.
    assert set(spans["collective_permute"]) == {"across"}
    for pairs in re.findall(r"source_target_pairs = dense<(\[\[.*?\]\])>", text):
        assert sorted(map(tuple, json.loads(pairs))) == sorted((d, (d + 4) % 8) for d in range(8))
    assert set(spans["all_reduce"]) == {"inside", "across"}
