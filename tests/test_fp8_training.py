"""model.fp8 in the model: a few training steps per recipe against model.fp8=none (blockwise on
an expert-parallel mesh), and the FP8 dots of the train step lowered for CUDA."""

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.analysis import dry_run
from maxmoe.analysis.lowering import lower_train_step
from maxmoe.config import ConfigError, load_config
from maxmoe.kernels.fp8_quant import E4M3, round_trip
from maxmoe.parallel.collectives import ragged_all_to_all_impl
from maxmoe.parallel.fp8_dispatch import TILE, fp8_ragged_exchange
from maxmoe.parallel.layout import build_layout
from maxmoe.parallel.names import COMM_NAMES
from maxmoe.sweep import with_mesh
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
# The training programs: the smallest that still has MLA's projections and the routed experts
# (plain attention and loss, no shared expert: fewer ops to compile; the lowering test keeps them).
TRAIN = SMALL + ["model.attention=xla", "train.loss_chunk=0", "model.num_shared_experts=0"]


def losses_on(fp8, shape=(1, 1, 1), extra=()):
    data, expert, tensor = shape
    config = load_config([TINY], TRAIN + [f"model.fp8={fp8}", f"mesh.data={data}", f"mesh.expert={expert}", *extra])
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


def test_blockwise_with_fp8_dispatch_trains_like_none_on_expert_mesh(reference):
    # data=2 x expert=4: the FP8 grouped GEMM runs inside the dispatch's shard_map and the rows
    # cross the expert axis in e4m3 with their scales.
    check_trains_like_none(losses_on("blockwise", (2, 4, 1), ["moe.fp8_dispatch=true"]), reference)


def test_tensorwise_train_step_lowers_to_fp8_dots_for_cuda():
    config = load_config(
        [TINY],
        SMALL
        + ["model.fp8=tensorwise", "model.compute_dtype=bfloat16", "mesh.data=2", "mesh.expert=4"]
        # XLA's ragged_dot takes fp8 operands (mosaic_gpu, auto on Hopper, takes the fp8 values as bf16)
        + ["moe.fp8_dispatch=true", "moe.grouped_matmul=ragged_dot"],
    )
    text = lower_train_step(config, "cuda").as_text()
    lines = text.splitlines()
    # moe.fp8_dispatch: the forward dispatch moves e4m3 rows and float32 scales (one per 128
    # features); the combine and both backward exchanges move bf16.
    exchanges = [line for line in lines if "ragged_all_to_all" in line and "tensor<" in line]
    operand_types = [re.search(r":\s*\((tensor<[^>]*>)", line).group(1) for line in exchanges]
    assert sorted(t.split("x")[-1] for t in operand_types) == ["bf16>", "bf16>", "bf16>", "f32>", "f8E4M3FN>"], (
        operand_types
    )
    sizes = {t.split("x")[-1]: math.prod(int(n) for n in t[len("tensor<") :].split("x")[:-1]) for t in operand_types}
    # model.fp8=none sends the same [n K, D] rows in bf16: 2 bytes each. D = 64: one scale per row.
    fp8_bytes, bf16_bytes = sizes["f8E4M3FN>"] + 4 * sizes["f32>"], 2 * sizes["f8E4M3FN>"]
    assert fp8_bytes / bf16_bytes == (64 + 4) / (2 * 64), (fp8_bytes, bf16_bytes)
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


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_fp8_exchange_moves_the_rounded_rows_and_passes_gradients_through(recipe):
    # 4 expert ranks, 8 rows each, 2 rows to every rank; rank s's rows land at 2 s in each buffer.
    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    offsets = (np.arange(4) * 2, np.full(4, 2), None, np.full(4, 2))
    rows = np.random.default_rng(0).normal(size=(32, 160)).astype(np.float32) * np.logspace(-3, 3, 32)[:, None]
    cotangent = np.random.default_rng(1).normal(size=(32, 160)).astype(np.float32)

    def shard(exchange):
        def body(rows, cotangent):
            me = jax.lax.axis_index("expert")
            args = (offsets[0], offsets[1], jnp.full(4, 2 * me), offsets[3])
            out = exchange(rows, *args)
            grad = jax.grad(lambda r: jnp.sum(exchange(r, *args) * cotangent))(rows)
            return out, grad

        spec = jax.sharding.PartitionSpec("expert")
        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return lambda *arrays: run(*(jax.device_put(a, sharding) for a in arrays))

    def plain(r, *args):
        return ragged_all_to_all_impl("emulate")(r, jnp.zeros((8, 160), r.dtype), *args, axis_name="expert")

    def fp8(r, *args):
        return fp8_ragged_exchange(r, *args, buffer_rows=8, axis_name="expert", a2a_impl="emulate", recipe=recipe)

    tile = (1, TILE[recipe])
    rounded = np.asarray(round_trip(jnp.asarray(rows), E4M3, tile, power_of_two=recipe == "mxfp8"))
    plain_run = shard(plain)
    want_out, want_grad = plain_run(rounded, cotangent)
    got_out, got_grad = shard(fp8)(rows, cotangent)
    np.testing.assert_array_equal(got_out, want_out)  # per-row tiles: rounding commutes with moving rows
    np.testing.assert_array_equal(got_grad, want_grad)  # straight through: the plain exchange's transpose


def test_a_comm_saving_policy_keeps_the_exchanges_fp8_payload():
    """Under a policy keeping collectives' outputs (COMM_NAMES) the backward pass needs the received
    e4m3 rows (as their bytes) and their mxfp8 exponents (one int8 per 32 features), not the
    dequantised rows: about half the bytes, and no all-to-all again."""
    from jax._src.ad_checkpoint import saved_residuals

    mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4])
    spec = jax.sharding.PartitionSpec("expert")

    def body(rows):
        me = jax.lax.axis_index("expert")
        args = (jnp.arange(4) * 2, jnp.full(4, 2), jnp.full(4, 2 * me), jnp.full(4, 2))
        out = fp8_ragged_exchange(rows, *args, buffer_rows=8, axis_name="expert", a2a_impl="emulate", recipe="mxfp8")
        return jnp.sin(out)

    exchange = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    policy = jax.checkpoint_policies.save_only_these_names(*COMM_NAMES)
    loss = jax.checkpoint(lambda r: jnp.sum(exchange(r)), policy=policy)
    rows = jax.device_put(jnp.zeros((32, 160), jnp.bfloat16), jax.sharding.NamedSharding(mesh, spec))
    saved = sorted((aval.str_short(), "argument" in why) for aval, why in saved_residuals(loss, rows))
    want = [("bfloat16[32@expert,160]", True), ("int8[32@expert,5]", False), ("uint8[32@expert,160]", False)]
    assert saved == want, saved


def test_dry_run_counts_fp8_dispatch_bytes():
    sizes = {"data": 2, "expert": 4, "tensor": 1}
    plain = load_config([TINY], SMALL + ["model.compute_dtype=bfloat16", "model.fp8=blockwise"])
    fp8 = load_config([TINY], SMALL + ["model.compute_dtype=bfloat16", "model.fp8=blockwise", "moe.fp8_dispatch=true"])
    # one MoE layer, no remat: dispatch + combine forward (2 D bytes a row each), their transposes
    # backward; the forward dispatch alone becomes D + 4 bytes a row (D = 64: one scale).
    fp8_bytes, plain_bytes = dry_run.native_a2a_bytes(fp8, sizes), dry_run.native_a2a_bytes(plain, sizes)
    assert fp8_bytes["backward"] == plain_bytes["backward"]
    assert fp8_bytes["forward"] / plain_bytes["forward"] == pytest.approx((1 + (64 + 4) / 128) / 2)
    # The compiled step moves that: e4m3 rows, their float32 scales (XLA:CPU's f32 rows of bf16
    # values counted at bf16, the scales at f32), bf16 elsewhere. Until the dry run counted
    # collectives by their values' width it halved the scales too: 1% low on the forward.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("data", "expert", "tensor"))
    measured = dry_run.dry_run_shape(with_mesh(fp8, sizes), sizes, mesh, hbm_gb=1.0)["collectives_by_pass"]
    assert {p: measured[p]["all-to-all"] for p in ("forward", "backward")} == pytest.approx(fp8_bytes, rel=1e-6)


def dry_run_step_text(recipe, a2a):
    """The tiny step (one MoE layer, bf16) on data=2 x expert=4 with the dry run's layout, lowered
    for CUDA (where ragged_dot stays one op; a CPU lowering expands it in place)."""
    config = load_config(
        [TINY], SMALL + ["model.compute_dtype=bfloat16", f"model.fp8={recipe}", "mesh.data=2", "mesh.expert=4"]
    )
    layout, _, ragged = dry_run.dry_run_layout(config, jax.devices(), a2a)
    assert ragged
    programs = build_programs(config, layout)
    traced = programs.train_step.trace(programs.abstract_state, programs.abstract_batch(config))
    return traced.lower(lowering_platforms=("cuda",)).as_text()


RAGGED_DOT = re.compile(r"(chlo|stablehlo)\.ragged_dot")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_dry_run_runs_fp8_gemms_as_on_a_kernel_backend(recipe):
    """The dry run compiles for a CPU what a GPU with grouped kernels runs: no XLA ragged_dot,
    whose rewrite holds a masked [G, M, D] copy of the rows for each weight gradient (60 GB at
    671B on 256 H200s); blockwise's GEMMs on its kernels' stand-ins, the others' through the
    bf16 stand-in. The CPU program the dry run does not stand in (a2a=emulate) keeps them."""
    text = dry_run_step_text(recipe, "proxy")
    assert not RAGGED_DOT.findall(text)
    assert "xla.gpu.triton" not in text  # nothing a CPU cannot compile: the kernels' stand-ins
    if recipe == "tensorwise":
        assert RAGGED_DOT.findall(dry_run_step_text(recipe, "emulate"))


def test_fp8_dispatch_needs_fp8_and_ragged_a2a():
    with pytest.raises(ConfigError, match="moe.fp8_dispatch"):
        load_config([TINY], ["moe.fp8_dispatch=true"])
    with pytest.raises(ConfigError, match="moe.fp8_dispatch"):
        load_config([TINY], ["moe.fp8_dispatch=true", "model.fp8=blockwise", "moe.dispatch=allgather"])
