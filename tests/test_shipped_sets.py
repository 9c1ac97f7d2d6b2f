"""Each shipped config's option set trains like one device, at tiny scale on 8 CPU devices.

Every config is loaded as shipped (an overlay on the 671B model, or a model config of its own);
only sizes change: tiny's model dimensions (two layers), a few short sequences in two
micro-batches, the mesh cut to 8 devices in scale-up domains of 4 (8 for the single-node
config). Everything else (remat policy, FP8 recipe and dispatch, ZeRO-1 timings, expert overlap,
receive buffers, rules, pipeline stages, context parallelism) is the shipped one. Compute is float32, so the bounds are the
layout parity tests' (tests/test_mesh_parity.py, tests/test_two_tier.py): what differs is the
order of float32 sums. The oracle is the same config on one device, from the same host state
and batch: one step's loss and gradients (Adam's first moment / (1 - b1), clipping off).
"""

import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from maxmoe.config import load_config
from maxmoe.kernels import fp8_dense
from maxmoe.parallel.layout import build_layout
from maxmoe.training import stage_state
from maxmoe.training.programs import build_programs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
B1 = 0.9
# tiny.yaml's model dimensions (not its numerics: dtype, rope and remat stay the shipped ones).
SIZES = ("vocab_size", "hidden_size", "num_layers", "first_k_dense", "mlp_dim", "moe_mlp_dim", "num_heads")
SIZES += ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_experts")
SIZES += ("experts_per_token", "num_expert_groups", "topk_groups", "max_position_embeddings")
TINY = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())["model"]
SMALL = [f"model.{k}={TINY[k]}" for k in SIZES] + [
    "model.compute_dtype=float32",
    "data.source=synthetic",
    "train.batch_size=16",
    "train.seq_len=16",
    "train.warmup_steps=0",
    "train.clip_norm=0",
    f"train.b1={B1}",
    "xla.profile=none",
    "run.dir=runs/shipped",
]
# One model and dense layer, one MoE layer (no MTP): the least that still has every kind of
# scanned block; MTP and deeper stacks run in the layout parity tests. Compile time is most of
# each test's time.
SMALL += ["model.num_layers=2", "model.mtp_num_layers=0"]
# Option set -> (shipped files, the mesh and accumulation at 8 devices). Configs whose option
# sets are the same but for sizes share one (test_configs_of_one_option_set_differ_in_sizes_only).
SETS = {
    "gb300": (["deepseek_v3_671b", "mesh_256_gb300"], ["mesh.data=4", "mesh.expert=2", "mesh.scale_up_domain=4"]),
    "h200": (["deepseek_v3_671b", "mesh_256_h200"], ["mesh.pipeline=2", "mesh.expert=4", "mesh.pipeline_pad_front=1"]),
    "context": (
        ["deepseek_v3_671b", "mesh_256_gb300_ctx128k"],
        ["mesh.data=2", "mesh.context=2", "mesh.expert=2", "mesh.scale_up_domain=4"],
    ),
    "proxy_1gpu": (["proxy_1gpu"], ["mesh.data=8"]),
    "hgx_8gpu": (["hgx_8gpu"], []),
}
SAME_SET = {"mesh_1024_gb300": "gb300", "mesh_256_gb300_ctx32k": "context"}
# The GB300 set emulates MXFP8 on the CPU, whose every GEMM compiles to a few dozen ops: its
# programs get the one MoE layer alone (the dense block's FP8 GEMMs are the same ops).
MODEL = {"gb300": ["model.num_layers=1", "model.first_k_dense=0"]}
ACCUM = {"proxy_1gpu": 1}  # the shipped grad_accum where it is a size; others: 2 micro-batches
ONE_DEVICE = ["mesh.pipeline=1", "mesh.data=1", "mesh.context=1", "mesh.expert=1", "mesh.tensor=1"]


def shipped(name: str, *more: str, files=None):
    names, mesh = SETS[name]
    accum = [f"train.grad_accum={ACCUM.get(name, 2)}"]
    sizes = SMALL + MODEL.get(name, []) + mesh + accum
    return load_config([str(CONFIGS / f"{f}.yaml") for f in files or names], sizes + list(more))


def step(config, host_state=None, platform="cpu"):
    """One step on the devices the config's mesh needs: (metrics, gradients, host start state).
    `platform`: the one the layout builds for (its kernels and devices stay this host's)."""
    m = config.mesh
    devices = jax.devices()[: m.pipeline * m.data * m.context * m.expert * m.tensor]
    layout = dataclasses.replace(build_layout(config, devices), platform=platform)
    programs = build_programs(config, layout)
    if host_state is None:
        host_state = jax.device_get(programs.init(jax.random.key(0)))
    state = stage_state.to_stage_order(config, host_state, programs.abstract_state)
    state = jax.device_put(state, programs.state_shardings)
    shape = (config.train.batch_size, config.train.seq_len + 1)
    batch = np.random.default_rng(7).integers(0, config.model.vocab_size, shape).astype(np.int32)
    state, metrics = programs.train_step(state, jax.device_put(batch, programs.batch_sharding))
    mu = stage_state.to_model(config, jax.device_get(state.opt_state[0].mu))
    return jax.device_get(metrics), jax.tree.map(lambda m: np.asarray(m) / (1 - B1), mu), host_state


def assert_same_step(got, grads, want, want_grads, keys):
    """The metrics `keys` and every gradient as the oracle's. Float32 throughout, so only the order of
    sums differs (over batch shards, layers, micro-batches): 1e-5 relative, and for gradients 1e-5
    of the largest one absolute (an element near zero is a difference of large partial sums)."""
    for key in keys:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale), grads, want_grads)


@functools.cache
def one_device(name: str):
    return step(shipped(name, *ONE_DEVICE))


@pytest.mark.parametrize("name", list(SETS))
def test_shipped_option_set_trains_like_one_device(name):
    want, want_grads, start = one_device(name)
    config = shipped(name)
    assert config.mesh.pipeline * config.mesh.data * config.mesh.context * config.mesh.expert == 8
    got, grads, _ = step(config, start)
    assert_same_step(got, grads, want, want_grads, ("loss", "lm_loss", "mtp_loss", "grad_norm"))


@pytest.mark.parametrize("other, name", list(SAME_SET.items()))
def test_configs_of_one_option_set_differ_in_sizes_only(other, name):
    """At the test's sizes the two configs are the same config: what the test above holds for one
    it holds for the other (their own sizes: tests/test_configs.py and their dry runs)."""
    files = [*SETS[name][0][:-1], other]
    assert shipped(name, files=files).to_dict() == shipped(name).to_dict()


def test_gb300_set_with_mxfp8_on_each_devices_shards_trains_like_xlas_program(monkeypatch):
    """On a GPU the per-replica region runs mxfp8's dense projections on each device's shards
    (maxmoe.kernels.fp8_dense; jax cannot partition scaled_matmul there). The layout built for
    CUDA takes that path here too, its GEMMs emulated as XLA:CPU runs them, and gives the loss
    and gradients of XLA's program on the same mesh to the parity bounds: the same fp8 products,
    the weight gradients' sums over the batch shards in another order. 64-token sequences give
    each shard whole 32-row MX blocks of the weight gradients' contraction, the whole batch's."""
    config = shipped("gb300", "train.seq_len=64")
    assert (config.model.fp8, config.mesh.across_domains) == ("mxfp8", "zero1")
    want, want_grads, start = step(config)
    projections = []
    original = fp8_dense.sharded_fp8_projection
    monkeypatch.setattr(fp8_dense, "sharded_fp8_projection", lambda *a: projections.append(a[3]) or original(*a))
    monkeypatch.setattr("maxmoe.parallel.layout.sharded_fp8_projection", fp8_dense.sharded_fp8_projection)
    got, grads, _ = step(config, start, platform="cuda")
    assert projections and set(projections) == {"mxfp8"}, projections
    assert_same_step(got, grads, want, want_grads, ("loss", "lm_loss", "grad_norm"))
