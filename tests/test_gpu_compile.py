"""GPU programs compiled by XLA:GPU on this CPU host (maxmoe.analysis.gpu_compile), and what is read from them.

Unmarked tests run everywhere: the target specs, the compiler choice, `auto`'s refusal on
Blackwell, the readers of an XLA:GPU program on a hand-written one. Tests marked `gpu_compile`
compile for H200 (sm_90) and B200 (sm_100) targets and need jax's CUDA plugin (the gpu-compile
extra, .ci/run's Python 3.12 leg; skipped elsewhere): kernels alone (the Mosaic GPU grouped
GEMM, maxmoe's blockwise FP8 Triton kernels), then train steps at reduced depth: proxy_1gpu on 1
and 8 devices, tiny on 8 (the dry run's path), the GPU suite's step variants and each FP8 recipe
on the GPU it is for (mxfp8 on the B200), the shipped GB300 set on 8 GB300s. Each asserts the kernels it expects, the ragged
all-to-alls async with work inside, arguments equal to the state's and batch's shards, and temp
within 5% of the figure recorded at jax 0.12.0.1. XLA's own GEMMs compile through cuBLAS here
(FAST; the dry run's test excepted): XLA's Triton GEMM emitter takes half of each compile.
"""

from __future__ import annotations

import math
import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from maxmoe.analysis import gpu_compile
from maxmoe.analysis.assumptions import SYSTEMS
from maxmoe.analysis.gpu_program import async_collectives, kernel_calls, schedule_summary
from maxmoe.analysis.hlo import collective_ops
from maxmoe.config import ConfigError, UserError, load_config
from maxmoe.kernels.choice import gpu_generation, resolve_kernels

REPO = Path(__file__).resolve().parents[1]
PROXY = str(REPO / "configs/proxy_1gpu.yaml")
TINY = str(REPO / "configs/tiny.yaml")
DEPTH = ["model.num_layers=2"]  # one dense and one MoE layer, and the MTP block
SHALLOW = [*DEPTH, "model.mtp_num_layers=0"]
FAST = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
# Where jax's CUDA plugin is missing (the 3.11 suite) these tests cannot run; .ci/run's 3.12 leg
# installs it and fails if XLA:GPU is still missing (compiler_problem), so they never skip there.
needs_compiler = pytest.mark.skipif(bool(gpu_compile.compiler_problem()), reason=gpu_compile.compiler_problem())


def one_line(capsys, status: int, *words: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("maxmoe: error: "), (status, err)
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------- everywhere


def test_target_specs_are_the_planners_gpus():
    """Each system's spec names its source and describes the planner's GPU: its model and generation."""
    for system in gpu_compile.SYSTEMS:
        target = gpu_compile.gpu_target(system)
        assert "Source: openxla/xla" in target.spec
        assert SYSTEMS[system].device_kind in target.device_kind, (system, target.device_kind)
        assert gpu_generation(target.device_kind) == SYSTEMS[system].arch
        assert (
            target.sm
            == {"hopper": "sm_90", "blackwell": "sm_100" if system != "gb300" else "sm_103"}[SYSTEMS[system].arch]
        )


def test_the_dry_run_says_which_compiler_and_refuses_gpu_without_the_plugin(capsys):
    from maxmoe.sweep import main as sweep_main

    problem = gpu_compile.compiler_problem()
    if problem:  # Python 3.11 / jax 0.10.2 here: XLA:CPU, saying why; --compiler gpu is one line
        assert gpu_compile.choose_compiler(None, "h200") == ("cpu", f"XLA:CPU on fake CPU devices ({problem})")
        argv = ["--config", TINY, "--devices", "8", "--dry-run", "--system", "h200", "--compiler", "gpu"]
        one_line(capsys, sweep_main(argv), "--compiler gpu: jax's CUDA plugin is not installed", "gpu-compile")
        from maxmoe.info import main as info_main

        one_line(
            capsys, info_main(["--config", TINY, "--compile-for", "h200"]), "--compile-for h200: jax's CUDA plugin"
        )
    else:
        assert gpu_compile.choose_compiler(None, "h200") == (
            "gpu",
            "XLA:GPU for NVIDIA H200 141GB HBM3e (sm_90), without a device",
        )
        assert gpu_compile.choose_compiler("cpu", "h200")[0] == "cpu"
    assert gpu_compile.choose_compiler(None, None) == (
        "cpu",
        "XLA:CPU on fake CPU devices (no --system to compile for)",
    )
    with pytest.raises(UserError, match="--compiler gpu needs --system"):
        gpu_compile.choose_compiler("gpu", None)


def test_auto_refuses_on_blackwell_without_a_grouped_kernel(capsys):
    """No tokamax here: on a B200 `auto` refuses in one line naming the fix, before any program is
    built (its ragged_dot program needs 421 GB at proxy_1gpu's 2 layers); by name ragged_dot builds,
    and a Hopper-only kernel forced onto sm_100 is refused too."""
    from maxmoe.info import main as info_main

    config = load_config([PROXY], DEPTH)
    with pytest.raises(ConfigError, match="no grouped GEMM kernel for Blackwell is installed"):
        resolve_kernels(config, "cuda", "NVIDIA B200")
    argv = ["--config", PROXY, "--platform", "cuda", "--device-kind", "NVIDIA B200"]
    one_line(capsys, info_main(argv), "moe.grouped_matmul=auto on NVIDIA B200", "install tokamax", "ragged_dot")
    named = resolve_kernels(config.replace(moe={"grouped_matmul": "ragged_dot"}), "cuda", "NVIDIA B200")
    assert named.grouped_matmul.name == "ragged_dot"
    with pytest.raises(ConfigError, match="mosaic_gpu: needs an NVIDIA Hopper GPU"):
        resolve_kernels(config.replace(moe={"grouped_matmul": "mosaic_gpu"}), "cuda", "NVIDIA B200")
    assert resolve_kernels(config, "cuda", "NVIDIA H200").grouped_matmul.name == "mosaic_gpu"


# An XLA:GPU program as it prints (scheduled): a ragged all-to-all started, two kernels and a bitcast
# before its done; a synchronous one; an all-reduce run by a collective fusion with nothing inside.
PROGRAM = """HloModule step, is_scheduled=true

%fused_all-reduce (param_0: f32[256]) -> f32[256] {
  %param_0 = f32[256]{0} parameter(0)
  ROOT %all-reduce.1 = f32[256]{0} all-reduce(%param_0), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add
}

ENTRY %main (p0: bf16[64,32], p1: bf16[512,32], p2: s64[4], p3: f32[256]) -> (bf16[512,32], bf16[512,32], f32[256]) {
  %p0 = bf16[64,32]{1,0} parameter(0), metadata={op_name="jit(step)/jvp(model)/moe/shard_map/gather"}
  %p1 = bf16[512,32]{1,0} parameter(1)
  %p2 = s64[4]{0} parameter(2)
  %p3 = f32[256]{0} parameter(3)
  %ragged-all-to-all-start = ((bf16[64,32]{1,0}, bf16[512,32]{1,0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}), bf16[512,32]{1,0}) ragged-all-to-all-start(%p0, %p1, %p2, %p2, %p2, /*index=5*/%p2), channel_id=2, replica_groups={{0,1,2,3}}
  %fusion.1 = bf16[512,32]{1,0} fusion(%p1), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %bitcast.1 = bf16[16384]{0} bitcast(%fusion.1)
  %custom-call.1 = bf16[512,32]{1,0} custom-call(%p1), custom_call_target="mosaic_gpu_v2"
  %ragged-all-to-all-done = bf16[512,32]{1,0} ragged-all-to-all-done(%ragged-all-to-all-start)
  %ragged-all-to-all.2 = bf16[512,32]{1,0} ragged-all-to-all(%p0, %p1, %p2, %p2, %p2, /*index=5*/%p2), channel_id=3, replica_groups={{0,1,2,3}}
  %fusion-start = ((f32[256]{0}), f32[256]{0}) fusion-start(%p3), kind=kCustom, calls=%fused_all-reduce
  %fusion-done = f32[256]{0} fusion-done(%fusion-start)
  ROOT %tuple = (bf16[512,32]{1,0}, bf16[512,32]{1,0}, f32[256]{0}) tuple(%ragged-all-to-all-done, %ragged-all-to-all.2, %fusion-done)
}
"""


def test_an_xla_gpu_programs_collectives_kernels_and_schedule_are_read_as_written():
    rows = {r["name"]: r for r in collective_ops(PROGRAM, [0, 0, 0, 0])}
    # A ragged all-to-all moves (P-1)/P of its send buffer, the smaller one (64 x 32 bf16 rows, not the
    # 512-row receive buffer), sync or async; XLA:GPU drops its metadata, so the pass is its operand's.
    for name in ("ragged-all-to-all-start", "ragged-all-to-all.2"):
        assert (rows[name]["bytes"], rows[name]["pass"]) == (64 * 32 * 2 * 3 / 4, "forward")
    assert rows["all-reduce.1"]["bytes"] == 256 * 4 * 2 * 3 / 4  # ring all-reduce, inside the collective fusion
    assert kernel_calls(PROGRAM) == {"mosaic_gpu_v2": 1, "__triton_gemm": 1}
    pairs = async_collectives(PROGRAM)
    assert [(p["kind"], p["kernels_between"]) for p in pairs] == [("ragged-all-to-all", 2), ("all-reduce", 0)]
    assert schedule_summary(pairs)["ragged-all-to-all"] == {
        "async": 1,
        "with_compute": 1,
        "runs": 1,
        "runs_with_compute": 1,
    }
    layout = types.SimpleNamespace(grouped_matmul=None)
    read, notes, recorded = gpu_compile.program_report(PROGRAM, [0, 0, 0, 0], layout, "h200")
    assert sorted(r["kind"] for r in read) == ["all-reduce", "all-to-all", "all-to-all"]
    assert recorded["async_schedule"]["ragged-all-to-all"]["sync"] == 1
    assert recorded["async_schedule"]["all-reduce"] == {
        "async": 1,
        "with_compute": 0,
        "runs": 1,
        "runs_with_compute": 0,
        "sync": 0,
    }
    assert recorded["a2a_overlapped"] is False  # one ragged all-to-all runs synchronously
    assert recorded["compiler"] == "XLA:GPU NVIDIA H200 141GB HBM3e (sm_90)"


# ---------------------------------------------------------------------------------------- XLA:GPU


def compiled_kernel(system: str, fn, *args):
    """`fn`'s value and its gradients in its first two arguments, compiled by XLA:GPU for one GPU of
    `system`; the kernels it calls."""
    mesh = jax.sharding.Mesh(gpu_compile.target_devices(system, 1), ("x",))
    with jax.set_mesh(mesh):
        lowered = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).trace(*args).lower()
    return kernel_calls(lowered.compile({**gpu_compile.compile_options(system), **FAST}).as_text())


ROWS = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
EXPERTS = jax.ShapeDtypeStruct((8, 2048, 512), jnp.bfloat16)
SIZES = jax.ShapeDtypeStruct((8,), jnp.int32)


@pytest.mark.gpu_compile
@needs_compiler
@pytest.mark.parametrize("system", ["h200", "b200"])
def test_the_hopper_grouped_gemm_builds_for_sm90_and_ptxas_refuses_it_on_sm100(system):
    """jax's Mosaic GPU ragged dot, forward and both gradients: built for the H200; its wgmma is
    refused for the B200, the program a Hopper-only kernel forced onto sm_100 would be."""
    from maxmoe.kernels.grouped_matmul import grouped_matmul

    def loss(x, w, sizes):
        return grouped_matmul(x, w, sizes, backend="mosaic_gpu").astype(jnp.float32).sum()

    if system == "h200":
        assert compiled_kernel(system, loss, ROWS, EXPERTS, SIZES).get("mosaic_gpu_v2", 0) >= 3  # fwd, dx, dw
        return
    # Shapes no other program here compiles: XLA:GPU reuses a Mosaic GPU kernel it built earlier in the
    # process for another GPU (gpu_compile's docstring), which would hide the refusal.
    rows, experts = jax.ShapeDtypeStruct((3072, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((8, 1024, 256), jnp.bfloat16)
    with pytest.raises(Exception) as failure:
        compiled_kernel(system, loss, rows, experts, SIZES)
    assert re.search(r"wgmma.* not supported on \.target 'sm_100a'", gpu_compile.why(failure.value))


@pytest.mark.gpu_compile
@needs_compiler
@pytest.mark.parametrize("system", ["h200", "b200"])
def test_the_blockwise_fp8_triton_kernels_build_for_sm90_and_sm100(system):
    """maxmoe's blockwise FP8 grouped GEMM and weight-gradient kernels (Pallas Triton) pass XLA:GPU's
    Triton compiler for both GPUs (an i1 loop bound once passed every CPU test and failed there)."""
    from maxmoe.kernels.fp8_matmul import fp8_grouped_matmul

    def loss(x, w, sizes):
        return fp8_grouped_matmul(x, w, sizes, "blockwise", "mosaic_gpu").astype(jnp.float32).sum()

    kernels = compiled_kernel(system, loss, ROWS, EXPERTS, SIZES)
    assert kernels.get("__gpu$xla.gpu.triton", 0) >= 3, kernels  # forward, dx, dw


def shard_bytes(tree) -> int:
    """Bytes per device of a tree of ShapeDtypeStructs with shardings (the first device's shards)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def compile_step(system: str, devices: int, config_file, overrides: list[str], temp_gb: float):
    """One train step (of `config_file` with `overrides`, or a Config) compiled for `devices` GPUs of
    `system`; checks its memory (arguments and donation against the state's and batch's shards, temp
    within 5% of `temp_gb`, recorded at jax 0.12.0.1); returns (compiled text, kernels, layout,
    lowered StableHLO)."""
    from maxmoe.training.programs import build_programs

    config = config_file if not isinstance(config_file, str) else load_config([config_file], overrides)
    targets = gpu_compile.target_devices(system, devices)
    compiled, layout, lowered, _, _ = gpu_compile.compile_train_step(config, system, targets, FAST)
    programs = build_programs(config, layout)
    state, batch = shard_bytes(programs.abstract_state), shard_bytes(programs.abstract_batch(config))
    memory = compiled.memory_analysis()
    assert (memory.argument_size_in_bytes, memory.alias_size_in_bytes) == (state + batch, state)
    assert abs(memory.temp_size_in_bytes / 1e9 - temp_gb) <= 0.05 * temp_gb, memory.temp_size_in_bytes / 1e9
    text = compiled.as_text()
    return text, kernel_calls(text), layout, lowered.as_text()


def xla_ragged_dots(stablehlo: str) -> int:
    """XLA ragged_dot ops in a lowered program (XLA:GPU rewrites each as a dense GEMM per group)."""
    return len(re.findall(r"\b(?:chlo|stablehlo)\.ragged_dot\b", stablehlo))


@pytest.mark.gpu_compile
@needs_compiler
def test_proxy_on_8_h200s_runs_mosaic_gpu_and_hides_its_layer_all_to_alls():
    """proxy_1gpu at 2 layers, expert=8 on 8 H200s: the grouped GEMMs are Mosaic GPU's (no XLA
    ragged_dot); the MoE layer stack's ragged all-to-alls run async with work inside: both of the
    forward pass, and in the backward the cotangents' way out (XLA's schedule leaves the rows'
    way home synchronous: nothing it orders after the expert GEMMs is independent of it)."""
    text, kernels, layout, lowered = compile_step("h200", 8, PROXY, [*DEPTH, "mesh.expert=8"], 12.13)
    assert layout.grouped_matmul.name == "mosaic_gpu" and kernels.get("mosaic_gpu_v2", 0) > 0
    assert xla_ragged_dots(lowered) == 0
    hidden = {p["name"] for p in async_collectives(text) if p["kind"] == "ragged-all-to-all" and p["kernels_between"]}
    ragged = [r for r in collective_ops(text, [0] * 8) if r["kind"] == "ragged-all-to-all"]
    layers = [r for r in ragged if "moe_layers" in r["op_name"]]
    assert len(ragged) == 8 and len(layers) == 4  # dispatch and combine per MoE block (layers, MTP) per pass
    forward = {r["name"] for r in layers if "transpose(" not in r["op_name"]}
    backward = {r["name"] for r in layers} - forward
    assert len(forward) == len(backward) == 2 and forward <= hidden, (forward, hidden)
    assert backward & hidden, (backward, hidden)


@pytest.mark.gpu_compile
@needs_compiler
def test_proxy_on_1_h200_runs_mosaic_gpu():
    _, kernels, layout, lowered = compile_step("h200", 1, PROXY, DEPTH, 21.09)
    assert layout.grouped_matmul.name == "mosaic_gpu" and kernels.get("mosaic_gpu_v2", 0) > 0
    assert xla_ragged_dots(lowered) == 0


@pytest.mark.gpu_compile
@needs_compiler
def test_the_dry_run_on_8_h200s_reads_xla_gpus_program():
    """tiny in 2 stages x expert 4 on 8 H200s through the sweep's dry run: the GPU program's memory
    (arguments the state's and batch's shards), its ragged all-to-alls async with work inside, one
    launch per run of XLA's combined collectives, and no measured bubble (XLA:CPU's to measure)."""
    from maxmoe.analysis.dry_run import dry_run_shape
    from maxmoe.config.mesh import mesh_sizes
    from maxmoe.parallel.mesh import build_mesh
    from maxmoe.training.programs import build_programs

    config = load_config([TINY], ["mesh.pipeline=2", "mesh.expert=4", "train.grad_accum=2"])
    devices = gpu_compile.target_devices("h200", 8)
    result = dry_run_shape(config, mesh_sizes(config), build_mesh(config, devices), 141.0, system="h200", gpu="h200")
    assert (result["compiler"], result["a2a_model"]) == ("XLA:GPU NVIDIA H200 141GB HBM3e (sm_90)", "native")
    programs = build_programs(config, gpu_compile.gpu_layout(config, devices, gpu_compile.gpu_target("h200")))
    state, batch = shard_bytes(programs.abstract_state), shard_bytes(programs.abstract_batch(config))
    memory = result["memory"]
    assert (memory["argument"], memory["alias"]) == (state + batch, state)
    assert abs(memory["temp"] / 1e6 - 49.53) <= 0.05 * 49.53, memory["temp"]  # MB, jax 0.12.0.1
    ragged = result["async_schedule"]["ragged-all-to-all"]
    assert ragged["async"] == ragged["with_compute"] > 0  # (in 2 stages XLA leaves some synchronous)
    runs = sum(r["runs"] for r in result["planner_rows"] if r["peers"] > 1 and r["bytes_per_run"])
    assert sum(result["prediction"]["launches"].values()) == runs > 0
    assert result["pipeline"]["bubble_measured"] is None and "--compiler cpu" in result["pipeline"]["baseline_error"]


def suite_variants() -> list[str]:
    """The GPU suite's step variants (read from benchmarks/gpu_suite.sh's GPU run) and each model.fp8 recipe."""
    from maxmoe.config import FP8_RECIPES

    text = (REPO / "benchmarks/gpu_suite.sh").read_text().split("# GPU run", 1)[1].split("# end of GPU run", 1)[0]
    found = [v for v in re.findall(r'--variant "([^"]*)"', text) if v]
    return list(dict.fromkeys(found + [f"model.fp8={r}" for r in FP8_RECIPES]))


# Per variant at reduced depth on one H200: the kernels its program must call, and its temp (GB) at
# jax 0.12.0.1.
VARIANTS = {
    "model.fp8=tensorwise": (("__cublas$lt$matmul$f8", "mosaic_gpu_v2"), 15.31),
    "model.remat=full": (("mosaic_gpu_v2",), 12.01),
    "model.fp8=blockwise": (("__gpu$xla.gpu.triton",), 16.95),
}
NOT_COMPILED = {
    "model.attention=cudnn": "cuDNN is not in the gpu-compile extra (lowered in tests/test_gpu_sim.py)",
    "model.fp8=mxfp8": "Blackwell's format (a Hopper dequantises it): compiled for the B200 below",
}


@pytest.mark.gpu_compile
@needs_compiler
@pytest.mark.parametrize("variant", suite_variants())
def test_the_gpu_suites_step_variants_compile_for_the_h200(variant):
    if variant in NOT_COMPILED:
        pytest.skip(NOT_COMPILED[variant])
    calls, temp_gb = VARIANTS[variant]
    _, kernels, _, _ = compile_step("h200", 1, PROXY, [*SHALLOW, variant], temp_gb)
    for call in calls:
        assert kernels.get(call, 0) > 0, (call, kernels)
    if variant == "model.fp8=blockwise":
        assert "mosaic_gpu_v2" not in kernels  # every blockwise GEMM runs maxmoe's Triton kernels


@pytest.mark.gpu_compile
@needs_compiler
def test_the_b200_program_compiles_for_sm100_with_the_stand_in_and_mxfp8_gemms():
    """On a B200 without a grouped kernel the dry run's program (gpu_compile.gpu_layout) stands a
    batched GEMM in for it, says so, and compiles for sm_100 with MXFP8's block-scaled GEMMs."""
    _, kernels, layout, _ = compile_step("b200", 1, PROXY, [*SHALLOW, "model.fp8=mxfp8"], 16.50)
    assert layout.grouped_matmul.name == "balanced_stand_in" and "`auto` refuses" in layout.grouped_matmul.reason
    assert kernels.get("__cudnn$blockScaledDot", 0) > 0 and "mosaic_gpu_v2" not in kernels


@pytest.mark.gpu_compile
@needs_compiler
def test_the_shipped_gb300_set_compiles_for_8_gb300s_with_mxfp8_on_each_devices_shards():
    """The GB300 option set (mxfp8, the two-tier ZeRO-1 step) at tests/test_shipped_sets.py's sizes
    on 8 GB300s: jax cannot partition scaled_matmul inside the per-replica shard_map, so its dense
    projections run on each device's shards, and every FP8 GEMM is a block-scaled cuDNN call."""
    from test_shipped_sets import shipped

    config = shipped("gb300", "train.seq_len=64", "model.compute_dtype=bfloat16")
    assert (config.model.fp8, config.mesh.across_domains) == ("mxfp8", "zero1")
    _, kernels, layout, _ = compile_step("gb300", 8, config, [], 0.00505)
    assert layout.platform == "cuda" and kernels.get("__cudnn$blockScaledDot", 0) > 0, kernels
