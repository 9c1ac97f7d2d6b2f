"""Blockwise FP8 dense projections on each device's shards (maxmoe.kernels.fp8_dense): the
shard_map layout from the rules' specs, and a train step on a data x expert x tensor mesh
whose every FP8 GEMM goes where maxmoe's kernels go (here programs of their contracts) against
XLA's program."""

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import DEFAULT_EMITTERS
from jax.sharding import PartitionSpec as P

from maxmoe.config import load_config
from maxmoe.kernels import fp8_dense
from maxmoe.kernels.choice import Choice
from maxmoe.kernels.fp8_dense import fp8_gather_axes, projection_specs
from maxmoe.parallel.layout import build_layout
from maxmoe.training.objective import make_loss_fn
from maxmoe.training.programs import build_programs

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


@pytest.mark.parametrize(
    "x_spec,w_spec,expected",
    [
        # FSDP weight, column-parallel output: gathered over data, N stays over tensor
        (P(("data", "expert"), None, None), P("data", "tensor"), (P(("data", "expert"), None, None), P(None, "tensor"), P(("data", "expert"), None, "tensor"), ())),
        # row-parallel (K over tensor): the shards' products are summed over tensor
        (P(("data", "expert"), None, "tensor"), P("tensor", "data"), (P(("data", "expert"), None, "tensor"), P("tensor", None), P(("data", "expert"), None, None), ("tensor",))),
        # a spec shorter than the array: the missing dims are whole
        (P("data"), P(), (P("data", None, None), P(None, None), P("data", None, None), ())),
    ],
)  # fmt: skip
def test_projection_specs(x_spec, w_spec, expected):
    assert projection_specs(x_spec, w_spec, 3) == expected


class _Mesh:
    shape = {"data": 2, "expert": 2, "tensor": 2}


@pytest.mark.parametrize(
    "x_in,w_spec,w_in,shape,expected",
    [
        # FSDP weight: K over the batch's data axis, shards of 256 rows: fp8 blocks gathered over data
        (P(("data", "expert"), None), P("data", "tensor"), P(None, "tensor"), (512, 256), (("data",), ())),
        # both dims, two axes on one: (data, expert) major first
        (P(("data", "expert"), None), P(("data", "expert"), None), P(None, None), (512, 256), (("data", "expert"), ())),
        # row-parallel output projection: K keeps tensor (major) and gathers data; N gathers expert
        (P(("data", "expert"), "tensor"), P(("tensor", "data"), "expert"), P("tensor", None), (512, 512), (("data",), ("expert",))),
        # shards of 64 rows are not whole 128-blocks: bf16 gather
        (P(("data", "expert"), None), P("data", None), P(None, None), (128, 256), None),
        # the kept axis is not the major one: the gather would interleave
        (P(("data", "expert"), "tensor"), P(("data", "tensor"), None), P("tensor", None), (1024, 256), None),
        # gathered over an axis that does not split the batch (no FSDP)
        (P("data", None), P("tensor", None), P(None, None), (512, 256), None),
        # nothing to gather
        (P(("data", "expert"), None), P(None, "tensor"), P(None, "tensor"), (512, 256), None),
    ],
)  # fmt: skip
def test_fp8_gather_axes(x_in, w_spec, w_in, shape, expected):
    assert fp8_gather_axes(_Mesh(), x_in, w_spec, w_in, shape) == expected


def test_fp8_blocks_gathered_over_two_axes_give_the_one_device_product(fp8_kernel_contracts):
    """A row-parallel projection whose weight keeps tensor (major) on K and gathers its fp8
    blocks over (data, expert): value and both gradients equal the one-device blockwise GEMM's
    through the same kernel programs (sums in another order: the psum over tensor's halves of
    K, the reduce-scatter over the batch's shards)."""
    from maxmoe.kernels.fp8_matmul import blockwise_kernels, fp8_matmul

    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "tensor"), devices=jax.devices()[:8])
    kernels = blockwise_kernels("mosaic_gpu")
    x_spec, w_spec = P(("data", "expert"), None, "tensor"), P(("tensor", "data", "expert"), None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 64, 1024)).astype(np.float32)  # 128 rows a shard: whole wgrad tiles
    w = (rng.normal(size=(1024, 256)) * np.exp(rng.normal(size=(1024, 1)))).astype(np.float32)  # blocks' scales differ
    dy = rng.normal(size=(8, 64, 256)).astype(np.float32)
    project = fp8_dense.sharded_fp8_projection(mesh, x_spec, w_spec, "blockwise", kernels)
    x_in, w_in, _, _ = projection_specs(x_spec, w_spec, 3)
    assert fp8_gather_axes(mesh, x_in, w_spec, w_in, w.shape) == (("data", "expert"), ())
    put = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
    xs, ws = put(x, x_spec), put(w, w_spec)
    jaxpr = str(jax.make_jaxpr(project)(xs, ws))
    assert any("all_gather" in line and "f8_e4m3fn" in line for line in jaxpr.splitlines())
    y, vjp = jax.vjp(jax.jit(project), xs, ws)
    dx, dw = vjp(put(dy, P(("data", "expert"), None, None)))
    y_ref, vjp_ref = jax.vjp(lambda x, w: fp8_matmul(x, w, "blockwise", kernels), x, w)
    dx_ref, dw_ref = vjp_ref(dy)
    # Measured: y 1.4e-7 and dx 7e-8 of their largest elements (float32 sums of the two K
    # halves in another order), dw equal. A block gathered into the wrong place or a
    # reduce-scatter that drops or repeats a shard is off by the values themselves.
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


CONFIG = [
    "model.compute_dtype=float32",
    "model.num_layers=1",
    "model.first_k_dense=0",
    "model.mtp_num_layers=0",
    "model.attention=xla",
    "model.fp8=blockwise",
    "data.source=synthetic",
    "train.batch_size=8",
    "train.seq_len=64",
    "train.warmup_steps=0",
    "train.loss_chunk=0",
    "mesh.data=2",
    "mesh.expert=2",
    "mesh.tensor=2",
    # Every shard of a contraction and of a weight's output columns is whole 128-tiles (the
    # heads' 4 x 64 over tensor=2, the experts' 256 over tensor=2, 512 tokens over 4 devices),
    # as at 671B: each shard's tiles are the whole array's, so the numerics are XLA's exactly.
    "model.qk_nope_head_dim=64",
    "model.qk_rope_head_dim=64",
    "model.v_head_dim=64",
    "model.moe_mlp_dim=256",
]


def loss_and_grads(config, layout):
    """The loss and every parameter's gradient at initialisation, on the layout's mesh; compiled
    with the XLA:CPU emitters users compile with (the bounds below were measured on them: another
    emitter can sum an activation gradient in another order, and a last-bit difference there
    moves an fp8 rounding of the gradient's quantisation)."""
    programs = build_programs(config, layout)
    state = programs.init(jax.random.key(0))
    batch = np.random.default_rng(3).integers(0, config.model.vocab_size, (8, 65)).astype(np.int32)
    grad_fn = jax.jit(jax.value_and_grad(make_loss_fn(config, layout), has_aux=True), compiler_options=DEFAULT_EMITTERS)
    (loss, _), grads = grad_fn(state.params, state.router, jax.device_put(batch, programs.batch_sharding))
    return float(loss), jax.tree.map(np.asarray, grads)


def kernel_layout(layout):
    """The layout as on a Hopper target: blockwise FP8 goes to maxmoe's kernels."""
    plan = layout.dispatch_plan
    return dataclasses.replace(
        layout,
        grouped_matmul=Choice("mosaic_gpu", "as on a Hopper target"),
        dispatch_plan=None if plan is None else dataclasses.replace(plan, grouped_matmul="mosaic_gpu"),
    )


@pytest.mark.slow
def test_blockwise_kernels_on_shards_give_xlas_loss_and_gradients(fp8_kernel_contracts):
    """On data x expert x tensor, the dense projections (column- and row-parallel over tensor,
    FSDP weights gathered) and the shared and routed experts where the kernels go give XLA's
    blockwise loss and gradients: the same fp8 products, their sums reduced in another order."""
    config = load_config([TINY], CONFIG)
    xla_layout = build_layout(config, jax.devices()[:8])
    gpu_layout = kernel_layout(xla_layout)
    assert xla_layout.fp8_projection("blockwise", ("batch", "seq", "embed"), ("embed", "q_lora"), 1) is None
    kernel_loss, kernel_grads = loss_and_grads(config, gpu_layout)
    calls = list(fp8_kernel_contracts)
    fp8_kernel_contracts.clear()
    xla_loss, xla_grads = loss_and_grads(config, xla_layout)
    assert not fp8_kernel_contracts  # the XLA layout called no kernel
    # MLA's 7 projections and the shared expert's 3, three GEMMs each; the routed experts' 2
    # grouped GEMMs: forward and dx by the one kernel, dw by the other (the initialisation and
    # the layer scan trace some of them more than once).
    assert calls.count("blockwise_grouped_gemm") >= 3 * (7 + 3) + 2 * 2, calls
    assert calls.count("fp8_grouped_wgrad") >= 2, calls
    # The forward pass: the same fp8 products summed in another order (measured: equal losses).
    np.testing.assert_allclose(kernel_loss, xla_loss, rtol=1e-6)
    # The sums reduce in another order: the contract program multiplies a block's partial
    # product by its two scales in another association than XLA's einsum, which shows where a
    # shard holds two contraction blocks (w_q_up's 512 columns over tensor=2: its dx). The
    # last-bit difference in that dx moves an fp8 scale of the next quantisation (the q path's
    # gradients): measured at most 2.0e-3 of a leaf's largest gradient (w_q_down; q_norm 3e-4;
    # every other leaf below 1.2e-5). A sum over an axis too many or too few, or a weight's
    # gradient left on one replica, is off by the size of the gradient itself.
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(kernel_grads), jax.tree.leaves(xla_grads)):
        scale = np.abs(b).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_fsdp_weights_gather_fp8_blocks_and_give_the_bf16_gathers_values(fp8_kernel_contracts, monkeypatch):
    """mesh.fsdp with embed's 256 in two shards of 128 over data: the weights that shard embed
    (MLA's latent down-projections and output projection, the shared expert's) quantise their
    shards and gather e4m3 blocks and scales; loss and gradients equal those of gathering the
    weights unquantised and quantising after (blocks and values are the whole weight's either
    way; the weight gradients' reduce-scatter sums in another order)."""
    config = load_config([TINY], CONFIG + ["mesh.fsdp=true", "model.hidden_size=256"])
    layout = kernel_layout(build_layout(config, jax.devices()[:8]))
    fp8_loss, fp8_grads = loss_and_grads(config, layout)
    assert fp8_gathers(config, layout) >= 6  # w_q_down, w_kv_down, w_k_rope, w_out, shared w_gate/w_up/w_down
    monkeypatch.setattr(fp8_dense, "fp8_gather_axes", lambda *args: None)
    assert fp8_gathers(config, layout) == 0
    loss, grads = loss_and_grads(config, layout)
    assert fp8_loss == loss  # forward: the same fp8 values and products
    # Measured: at most 1.8e-7 of a leaf's largest gradient (the gathered weights' own); a block
    # gathered into the wrong place or a reduce-scatter that drops or repeats a shard's sum is
    # off by the gradient itself.
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fp8_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))


def fp8_gathers(config, layout) -> int:
    """All-gathers of e4m3 values in the train step's loss gradient (its jaxpr)."""
    programs = build_programs(config, layout)
    state = jax.eval_shape(programs.init, jax.random.key(0))
    batch = jax.ShapeDtypeStruct((8, 65), np.int32, sharding=programs.batch_sharding)
    grad_fn = jax.value_and_grad(make_loss_fn(config, layout), has_aux=True)
    text = str(jax.make_jaxpr(grad_fn)(state.params, state.router, batch))
    return sum("all_gather" in line and "f8_e4m3fn" in line for line in text.splitlines())
