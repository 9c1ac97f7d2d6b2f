"""model.fp8 in the model: a few training steps per recipe against model.fp8=none (blockwise on
an expert-parallel mesh), and the FP8 dots of the train step lowered for CUDA."""

from pathlib import Path

import jax
import numpy as np
import pytest

from maxmoe.config import ConfigError, load_config
from maxmoe.lowering import lower_train_step
from maxmoe.mesh import build_layout
from maxmoe.training.programs import build_programs

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = [
    "model.compute_dtype=float32",
    "model.num_layers=1",  # one MoE layer: MLA, shared-expert SwiGLU and routed experts
    "model.first_k_dense=0",
    "model.mtp_num_layers=0",
    "data.source=synthetic",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.warmup_steps=0",
]
STEPS = 4


def losses_on(fp8, shape=(1, 1, 1), extra=()):
    data, expert, tensor = shape
    config = load_config([TINY], SMALL + [f"model.fp8={fp8}", f"mesh.data={data}", f"mesh.expert={expert}", *extra])
    programs = build_programs(config, build_layout(config, jax.devices()[: data * expert * tensor]))
    state = programs.init(jax.random.key(0))
    batch = np.random.default_rng(7).integers(0, config.model.vocab_size, (8, 33)).astype(np.int32)
    losses = []
    for _ in range(STEPS):  # one batch again and again: the loss falls as it is memorised
        state, metrics = programs.train_step(state, jax.device_put(batch, programs.batch_sharding))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.fixture(scope="module")
def reference():
    return losses_on("none")


# FP8 rounds each GEMM operand by at most 1/16 (e4m3) or 1/8 (e5m2) of itself; the errors of
# the ~100 products per output mostly cancel, so logits move by ~1% of their size and the loss
# by a fraction of that (measured: under 2e-3 relative over these steps). 1e-2 allows the
# formats' worst case without letting a wrong scale (a factor 2 at least) pass.
FP8_RTOL = 1e-2


def check_trains_like_none(losses, reference):
    np.testing.assert_allclose(losses, reference, rtol=FP8_RTOL)
    assert not np.array_equal(losses, reference)  # the GEMMs did run in FP8
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_recipe_trains_like_none(reference, recipe):
    check_trains_like_none(losses_on(recipe), reference)


def test_blockwise_trains_like_none_on_expert_mesh(reference):
    # data=2 x expert=4: the FP8 grouped GEMM runs inside the dispatch's shard_map.
    check_trains_like_none(losses_on("blockwise", (2, 4, 1)), reference)


def test_tensorwise_train_step_lowers_to_fp8_dots_for_cuda():
    config = load_config(
        [TINY], SMALL + ["model.fp8=tensorwise", "model.compute_dtype=bfloat16", "mesh.data=2", "mesh.expert=4"]
    )
    text = lower_train_step(config, "cuda").as_text()
    lines = text.splitlines()
    fp8_dots = [line for line in lines if "stablehlo.dot_general" in line and "xf8E4M3FN>" in line]
    e5m2_dots = [line for line in fp8_dots if "xf8E5M2>" in line]
    fp8_grouped = [line for line in lines if "ragged_dot" in line and "xf8E4M3FN>" in line]
    # MLA's 7 projections and the shared expert's 3: forward, dx and dw of each, the gradient
    # operand of dx and dw in e5m2. The routed experts' 2 grouped GEMMs: forward, dx, dw.
    assert len(fp8_dots) == 3 * (7 + 3), len(fp8_dots)
    assert len(e5m2_dots) == 2 * (7 + 3), len(e5m2_dots)
    assert len(fp8_grouped) == 3 * 2, fp8_grouped


def test_fp8_rejects_capacity_dispatch():
    with pytest.raises(ConfigError, match="model.fp8=blockwise.*capacity"):
        load_config([TINY], ["model.fp8=blockwise", "moe.dispatch=capacity"])
