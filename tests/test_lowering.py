"""Programs lowered for CUDA on this CPU host: the real ragged all-to-all, no collective run
again under a comm-saving remat policy, and two independent dispatch chains under batch_split."""

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxmoe.analysis.hlo import STABLEHLO_COLLECTIVES, count_collectives
from maxmoe.analysis.hlo_deps import independent_chains, marker_dependencies
from maxmoe.analysis.lowering import GROUPED_GEMM_MARKERS, lower_train_step, moe_layer_lowered_text
from maxmoe.config import load_config
from maxmoe.parallel.layout import build_layout

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["mesh.data=2", "mesh.expert=4", "train.batch_size=8", "train.seq_len=16"]
# A policy that keeps what collectives produced (the smallest of COMM_SAVING_POLICIES; the GB300
# plans run save_moe, which keeps the expert GEMMs' gate/up outputs too: docs/PERFORMANCE.md).
SAVING_REMAT = "save_comm"
# What a recomputed forward pass would add again: the dispatch's collectives.
DISPATCH_COLLECTIVES = ("ragged_all_to_all", "all_to_all", "all_gather")


@pytest.fixture(scope="module")
def train_step_text():
    """(platform, remat) -> StableHLO of tiny's train step on a 2 x 4 mesh; each lowered once."""
    cache = {}

    def text(platform, remat):
        if (platform, remat) not in cache:
            config = load_config([TINY], SMALL + [f"model.remat={remat}"])
            cache[platform, remat] = lower_train_step(config, platform).as_text()
        return cache[platform, remat]

    return text


@pytest.mark.smoke
def test_cuda_lowering_uses_native_ragged_all_to_all(train_step_text):
    text = train_step_text("cuda", "none")
    counts = count_collectives(text)
    # 3 MoE layers (2 in the scanned stack, 1 MTP), each dispatch + combine, forward and backward;
    # the scanned stack appears once in the program.
    assert counts["ragged_all_to_all"] >= 4, counts
    # The CPU emulation moves float row blocks with all_to_all; the native program moves
    # only int32 offsets that way (the collective's backward needs the peers' offsets).
    float_all_to_all = [
        line
        for line in text.splitlines()
        if "all_to_all" in line and "ragged" not in line and re.search(r"x(f32|bf16|f16)>", line)
    ]
    assert not float_all_to_all, float_all_to_all[:3]


def test_cpu_lowering_emulates(train_step_text):
    counts = count_collectives(train_step_text("cpu", "none"))
    assert counts["ragged_all_to_all"] == 0 and counts["all_to_all"] > 0, counts


@pytest.mark.parametrize(
    "platform, policy",
    [("cuda", SAVING_REMAT), ("cpu", SAVING_REMAT), ("cuda", "save_moe"), ("cuda", "save_dots_comm")],
)
def test_comm_saving_remat_runs_no_collective_again(train_step_text, platform, policy):
    # remat=full recomputes the forward pass of the scanned MoE layers, collectives included;
    # a comm-saving policy keeps what they produced (on CPU the emulation's offset exchange too).
    plain = count_collectives(train_step_text(platform, "none"))
    full = count_collectives(train_step_text(platform, "full"))
    saving = count_collectives(train_step_text(platform, policy))
    assert {k: saving[k] for k in DISPATCH_COLLECTIVES} == {k: plain[k] for k in DISPATCH_COLLECTIVES}
    key = "ragged_all_to_all" if platform == "cuda" else "all_to_all"
    assert full[key] > plain[key]  # the counts do see recomputation


def test_info_lower_cuda_prints_counts(train_step_text):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    command = [sys.executable, "-m", "maxmoe.info", "--config", TINY, "run.cpu_devices=8", "mesh.data=2"]
    command += ["mesh.expert=4", f"model.remat={SAVING_REMAT}", "--lower", "cuda"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = dict(line.split(": ") for line in result.stdout.strip().splitlines())
    assert set(counts) == set(STABLEHLO_COLLECTIVES)
    # tiny.yaml's batch and sequence here, not SMALL's: the counts do not depend on them.
    assert int(counts["ragged_all_to_all"]) == count_collectives(train_step_text("cuda", "none"))["ragged_all_to_all"]


def kernel_calls(text: str, target: str) -> int:
    """Call sites of custom call `target` reached from @main, through the private functions the
    program calls (a kernel jitted once and called from several places is lowered once)."""
    functions = {}
    for chunk in re.split(r"(?m)^(?=\s*func\.func )", text):
        name = re.match(r"\s*func\.func (?:\w+ )?@([\w.$-]+)", chunk)
        if name:
            functions[name.group(1)] = chunk

    @functools.cache
    def reached(name: str) -> int:
        body = functions[name]
        callees = re.findall(r"(?<!\w)call @([\w.$-]+)\(", body)
        return body.count(f"custom_call @{target}") + sum(reached(c) for c in callees if c in functions)

    return reached("main")


@pytest.mark.parametrize("fp8", ["none", "tensorwise", "mxfp8"])
def test_cuda_lowering_runs_the_kernels_and_no_ragged_dot(fp8):
    """The tiny step for an H200 (bf16, sizes multiples of 64): Mosaic GPU grouped GEMMs, flash
    attention. With model.fp8 tensorwise and mxfp8 the experts' fp8 values go to the same
    kernels, their weight gradients to the transposed one (XLA's ragged_dot over the rows would
    hold a masked [G, M, D] copy of them); blockwise: tests/test_fp8_grouped_kernel.py."""
    config = load_config(
        [TINY],
        ["mesh.data=2", "mesh.expert=4", "train.batch_size=8", "train.seq_len=16", f"model.fp8={fp8}"]
        + ["model.compute_dtype=bfloat16", "model.hidden_size=128", "model.moe_mlp_dim=64"],
    )
    layout = build_layout(config, platform="cuda", device_kind="NVIDIA H200")
    assert layout.grouped_matmul.name == "mosaic_gpu"
    text = lower_train_step(config, "cuda").as_text()
    # Forward (gate+up, down), dx and dw of each, in the scanned MoE layer and the MTP layer.
    assert kernel_calls(text, "mosaic_gpu_v2") >= 12
    assert not re.findall(r"(chlo|stablehlo)\.ragged_dot", text)
    # auto's attention: chunked, the fastest of what can be built here in the rate table (not cuDNN)
    assert layout.attention.name == "chunked" and "measured fastest" in layout.attention.reason


# ---------------------------------------------------------------------------------------
# batch_split: the two halves' exchanges and expert GEMMs form two independent chains.


def moe_layer_text(overlap, *extra):
    """One MoE layer of tiny, forward and backward (the cotangent an input), lowered for CUDA."""
    return moe_layer_lowered_text(load_config([TINY], SMALL + [f"moe.overlap={overlap}", *extra]), jax.devices()[:8])


def two_chains_text(coupled):
    """Two exchange -> ragged_dot -> exchange chains in one shard_map; `coupled` adds 0 x
    the first chain's GEMM output to the second chain's input (a dependence, no effect)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
    sizes = jnp.full((4,), 2, jnp.int32)
    offsets = jnp.arange(4, dtype=jnp.int32) * 2

    def chain(x, w):
        rows = jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, sizes, offsets, sizes, axis_name="expert")
        out = jax.lax.ragged_dot(rows, w, jnp.array([8], jnp.int32))
        back = jax.lax.ragged_all_to_all(out, jnp.zeros_like(out), offsets, sizes, offsets, sizes, axis_name="expert")
        return back, out

    def body(x_a, x_b, w):
        y_a, out_a = chain(x_a, w)
        y_b, _ = chain(x_b + 0 * out_a if coupled else x_b, w)
        return y_a + y_b

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"), P("expert"), P()), out_specs=P("expert"))
    x, w = jax.ShapeDtypeStruct((32, 4), jnp.float32), jax.ShapeDtypeStruct((1, 4, 4), jnp.float32)
    return jax.jit(f).trace(x, x, w).lower(lowering_platforms=("cuda",)).as_text()


def test_chain_checker_sees_a_coupling():
    chains, coupled = independent_chains(marker_dependencies(two_chains_text(coupled=False)))
    assert len(chains) == 2 and not coupled
    chains, coupled = independent_chains(marker_dependencies(two_chains_text(coupled=True)))
    assert len(chains) == 1 or coupled


@pytest.mark.parametrize("overlap, num_chains", [("none", 1), ("batch_split", 2)])
def test_batch_split_lowers_two_independent_dispatch_chains(overlap, num_chains):
    markers = marker_dependencies(moe_layer_text(overlap))
    kinds = [m.kind for m in markers.values()]
    # Per chain: dispatch and combine forward, their transposes backward; the fused gate/up
    # GEMM and the down GEMM forward, two GEMMs each backward.
    assert kinds.count("ragged_all_to_all") == 4 * num_chains
    assert kinds.count("ragged_dot") == 6 * num_chains
    chains, coupled = independent_chains(markers)
    assert sorted(len(c) for c in chains) == [6] * num_chains
    assert not coupled  # no half's all-to-all waits on the other half's expert GEMMs


@pytest.mark.parametrize("overlap, num_chains", [("none", 1), ("batch_split", 2)])
def test_blockwise_fp8_experts_lower_the_same_chains(overlap, num_chains):
    """Under blockwise FP8 with FP8 dispatch the experts' GEMMs are maxmoe's Triton kernels
    (where Triton lowers here; else XLA's per-block ragged dots) and the shared expert's
    projections the same kernel under another name, which is no expert GEMM: the planner's
    markers find one chain per dispatch half, the shared expert none of its own."""
    text = moe_layer_text(overlap, "model.compute_dtype=bfloat16", "model.fp8=blockwise", "moe.fp8_dispatch=true")
    chains, coupled = independent_chains(marker_dependencies(text, GROUPED_GEMM_MARKERS))
    assert len(chains) == num_chains and not coupled
