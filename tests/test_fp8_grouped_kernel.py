"""The block-scaled FP8 grouped GEMM kernel (maxmoe.kernels.fp8_grouped): its tile
schedule against a plain loop, its values (Pallas interpret mode) against a float64 sum of the
scaled 128-blocks, the dry run's stand-ins against the same sums, and the CUDA program of a
blockwise train step that runs it."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.kernels.attention import triton_lowers_here
from maxmoe.kernels.fp8_grouped import (
    DENSE_GEMM_NAME,
    GEMM_NAME,
    TILE,
    WGRAD_NAME,
    balanced_blockwise_gemm,
    balanced_grouped_wgrad,
    blockwise_grouped_gemm,
    fp8_grouped_wgrad,
    tile_schedule,
)

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
SCHEDULES = [  # (group sizes, rows, block rows)
    ([30, 0, 60, 26], 136, 32),  # an empty group, groups sharing blocks, rows past the groups
    ([64, 64], 128, 64),  # groups on block edges
    ([200], 200, 64),  # one group: the dense GEMM
    ([100, 100], 150, 64),  # the groups claim more rows than there are: cut at the last row
    ([0, 0, 0], 64, 32),  # nothing to do
    ([1, 1, 1, 1, 1], 40, 32),  # more groups than blocks
]


def loop_schedule(sizes, rows, block):
    """(group, row block, first row, end row) of every tile with work, group after group."""
    tiles, start = [], 0
    for g, size in enumerate(sizes):
        end = min(start + size, rows)
        for b in range(start // block, -(-end // block) if end > start else start // block):
            tiles.append((g, b, max(start, b * block), min(end, (b + 1) * block)))
        start = end
    return tiles


@pytest.mark.parametrize("sizes,rows,block", SCHEDULES)
def test_tile_schedule_equals_a_loop_over_groups_and_blocks(sizes, rows, block):
    schedule = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), rows, block))
    assert schedule.shape == (-(-rows // block) + len(sizes) - 1, 4)
    live = [tuple(int(v) for v in t) for t in schedule if t[3] > t[2]]
    assert live == loop_schedule(sizes, rows, block)
    assert all(t[3] == t[2] for t in schedule[len(live) :])  # the rest are empty tiles


def fp8_operands(m, k, n, g, seed):
    rng = np.random.default_rng(seed)
    aq = jnp.asarray(rng.normal(size=(m, k)) * 8, jnp.float8_e4m3fn)
    bq = jnp.asarray(rng.normal(size=(g, n, k)) * 8, jnp.float8_e4m3fn)
    # scales that differ per row, per 128 of the contraction and per column, over decades
    a_scale = jnp.asarray(10.0 ** rng.uniform(-3, 0, size=(m, k // TILE)), jnp.float32)
    b_scale = jnp.asarray(10.0 ** rng.uniform(-3, 0, size=(g, k // TILE, n)), jnp.float32)
    return aq, a_scale, bq, b_scale


def block_scaled_reference(aq, a_scale, bq, b_scale, sizes):
    """float64: out[r, n] = sum_c a_scale[r, c] b_scale[g, c, n] (aq[r, block c] . bq[g, n, block c])."""
    a = np.asarray(aq, np.float64).reshape(aq.shape[0], -1, TILE)
    b = np.asarray(bq, np.float64).reshape(*bq.shape[:2], -1, TILE)
    a_s, b_s = np.asarray(a_scale, np.float64), np.asarray(b_scale, np.float64)
    out = np.zeros((aq.shape[0], bq.shape[1]))
    magnitude = np.zeros_like(out)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        partial = np.einsum("rck,nck->rcn", a[rows], b[g])
        out[rows] = np.einsum("rcn,rc,cn->rn", partial, a_s[rows], b_s[g])
        magnitude[rows] = np.einsum("rck,nck,rc,cn->rn", np.abs(a[rows]), np.abs(b[g]), a_s[rows], b_s[g])
        start += size
    return out, magnitude


@pytest.mark.smoke  # the Pallas Triton API of the newest jax too
@pytest.mark.parametrize(
    "sizes,rows,n",
    [
        ([70, 0, 129, 60], 300, 200),  # ragged groups, an empty one, 41 rows past them, a partial column tile
        ([256], 256, 128),  # one group: a dense blockwise GEMM
    ],
)
def test_kernel_equals_the_float64_sum_of_scaled_blocks(sizes, rows, n):
    aq, a_scale, bq, b_scale = fp8_operands(rows, 2 * TILE, n, len(sizes), seed=len(sizes))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(blockwise_grouped_gemm(aq, a_scale, bq, b_scale, group_sizes, interpret=True), np.float64)
    exact, magnitude = block_scaled_reference(aq, a_scale, bq, b_scale, sizes)
    # fp8 x fp8 products are exact in float32; what float32 adds is the rounding of the sums.
    bound = 2 * TILE * 2.0**-24 * magnitude + 1e-30
    assert np.max(np.abs(got - exact) / bound) <= 1.0
    np.testing.assert_array_equal(got[sum(sizes) :], 0.0)
    assert np.max(np.abs(exact)) > 1.0  # the comparison is not between zeros


def test_wgrad_kernel_equals_float64_products_over_each_groups_rows():
    rng = np.random.default_rng(1)
    sizes = [70, 0, 129, 60]  # an empty group, 41 rows past the groups
    d, m, f = 200, 300, 72  # partial tiles in both output dims
    xq = jnp.asarray(rng.normal(size=(d, m)) * 8, jnp.float8_e4m3fn)
    dyq = jnp.asarray(rng.normal(size=(f, m)) * 8, jnp.float8_e4m3fn)
    got = np.asarray(fp8_grouped_wgrad(xq, dyq, jnp.asarray(sizes, jnp.int32), interpret=True), np.float64)
    x, dy = np.asarray(xq, np.float64), np.asarray(dyq, np.float64)
    ends = np.cumsum(sizes)
    for g, (size, end) in enumerate(zip(sizes, ends)):
        rows = slice(end - size, end)
        exact = x[:, rows] @ dy[:, rows].T
        bound = m * 2.0**-24 * (np.abs(x[:, rows]) @ np.abs(dy[:, rows]).T)
        assert np.all(np.abs(got[g] - exact) <= bound), g
    np.testing.assert_array_equal(got[1], 0.0)
    assert np.abs(got).max() > 100.0


def test_dry_run_stand_ins_equal_the_float64_reference_on_balanced_groups():
    """The dry run's stand-ins (maxmoe compiles them where the kernels cannot compile, for a
    CPU) are the kernels' contracts when every group has M/G rows, as they assume."""
    sizes = [96] * 3
    aq, a_scale, bq, b_scale = fp8_operands(288, 3 * TILE, 136, 3, seed=7)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = balanced_blockwise_gemm(aq, a_scale, bq, b_scale, group_sizes, out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(balanced_blockwise_gemm(aq, a_scale, bq, b_scale, group_sizes), np.float64)
    exact, magnitude = block_scaled_reference(aq, a_scale, bq, b_scale, sizes)
    assert np.max(np.abs(got - exact) / (3 * TILE * 2.0**-24 * magnitude + 1e-30)) <= 1.0
    xq, dyq = aq.T, jnp.asarray(np.random.default_rng(8).normal(size=(72, 288)) * 8, jnp.float8_e4m3fn)
    dw = np.asarray(balanced_grouped_wgrad(xq, dyq, group_sizes), np.float64)
    x, dy = np.asarray(xq, np.float64), np.asarray(dyq, np.float64)
    for g in range(3):
        rows = slice(96 * g, 96 * (g + 1))
        exact = x[:, rows] @ dy[:, rows].T
        assert np.all(np.abs(dw[g] - exact) <= 96 * 2.0**-24 * (np.abs(x[:, rows]) @ np.abs(dy[:, rows]).T)), g


def test_kernel_returns_the_requested_dtype_and_refuses_partial_contraction_blocks():
    aq, a_scale, bq, b_scale = fp8_operands(64, TILE, 64, 2, seed=0)
    sizes = jnp.asarray([32, 32], jnp.int32)
    out = blockwise_grouped_gemm(aq, a_scale, bq, b_scale, sizes, out_dtype=jnp.bfloat16, interpret=True)
    assert out.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="multiple of 128"):
        blockwise_grouped_gemm(aq[:, :96], a_scale, bq[:, :, :96], b_scale, sizes, interpret=True)


# jax 0.10 (the suite's main run) lowers Triton on a CPU host; jax >= 0.11 needs a GPU for it.
@pytest.mark.skipif(bool(triton_lowers_here()), reason="this jax lowers Pallas Triton kernels only with a GPU")
@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"],
        # two scale-up domains of 4 (replica=2 x expert=2 x tensor=2), ZeRO-1 across them
        ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=true", "mesh.scale_up_domain=4"]
        + ["mesh.across_domains=zero1"],
        # FSDP over data with embed's 256 in whole 128-blocks a shard: those weights gather fp8 blocks
        ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=true", "model.hidden_size=256"],
    ],
    ids=["one-domain", "two-tier", "fsdp-fp8-gather"],
)
def test_blockwise_train_step_runs_only_the_kernels_for_hopper(mesh):
    """On a Hopper target (grouped backend mosaic_gpu) every blockwise GEMM is one of maxmoe's
    Triton kernels: the experts' (forward, dx, dw) and the dense projections' on each device's
    shards (data x expert x tensor: column- and row-parallel projections; also with the data
    axis split into replicas across scale-up domains); XLA has no fp8 dot and no ragged_dot left."""
    from maxmoe.analysis.lowering import lower_train_step
    from maxmoe.config import load_config
    from maxmoe.parallel.layout import build_layout

    config = load_config(
        [TINY],
        ["model.num_layers=1", "model.first_k_dense=0", "model.mtp_num_layers=0", "data.source=synthetic"]
        + ["train.batch_size=8", "train.seq_len=32", "model.fp8=blockwise", "model.compute_dtype=bfloat16"]
        + ["model.hidden_size=128", "model.moe_mlp_dim=64"]
        + mesh,
    )
    layout = build_layout(config, platform="cuda", device_kind="NVIDIA H200")
    assert layout.grouped_matmul.name == "mosaic_gpu"
    assert layout.replicas == (2 if "mesh.across_domains=zero1" in mesh else 1)
    lines = lower_train_step(config, "cuda").as_text().splitlines()
    kernels = [line for line in lines if "xla.gpu.triton" in line]
    counts = [sum(f'name = "{name}"' in line for line in kernels) for name in (DENSE_GEMM_NAME, GEMM_NAME, WGRAD_NAME)]
    # MLA's 7 projections and the shared expert's 3: forward, dx, dw (the dense kernel's name);
    # the experts' gate+up and down: forward and dx by the grouped kernel, dw by the other
    assert counts == [3 * (7 + 3), 2 * 2, 2]
    xla_ops = [line for line in lines if "xla.gpu.triton" not in line]
    assert not [line for line in xla_ops if "ragged_dot" in line]
    assert not [line for line in xla_ops if "stablehlo.dot_general" in line and "f8E" in line]
    fp8_gathers = [line for line in xla_ops if "all_gather" in line and "f8E4M3FN" in line]
    assert bool(fp8_gathers) == ("model.hidden_size=256" in mesh)
