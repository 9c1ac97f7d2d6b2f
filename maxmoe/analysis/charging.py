"""What each compute class of a step executes on a system, on which kernel: the planner's compute rows.

    rows = compute_rows(config, "gb300", devices=256)

Per class (maxmoe.analysis.flops.flops_per_token_by_class, and context parallelism's latent_up),
per device per step: model FLOPs, and executed FLOPs = (model + what model.remat runs again,
maxmoe.analysis.recompute + the chunked loss's head projections again + context parallelism's
moves) x the kernel's overhead. The kernel is what `auto` resolves to for the system's device
kind (maxmoe.kernels.choice, as this installation resolves it) or the one the config names;
precision is bf16 or the model.fp8 recipe for the classes it covers, run at the FP8 peak where
flops.fp8_gemm_classes says FP8 GEMMs run there. Overhead, executed over useful FLOPs: XLA's
ragged_dot G (a dense GEMM per local expert over all rows); Triton attention 2 x 2^ceil(log2 qk)
/ (qk + v) (v padded to qk, both to a power of two: 1.6 for MLA); XLA's attention 2 (every
score, then the causal mask); the chunked core (n + 1) / n over n blocks (diagonal blocks whole);
capacity dispatch its capacity factor; cuDNN (v at its own head dim) and tokamax none.
"""

from __future__ import annotations

from maxmoe.analysis.assumptions import SYSTEMS, Assumptions
from maxmoe.analysis.calibration import efficiency, overhead
from maxmoe.analysis.flops import (
    context_flops_per_token,
    flops_per_token_by_class,
    fp8_gemm_classes,
    head_recompute_flops_per_token,
    recompute_flops_per_token,
)
from maxmoe.analysis.planner import Compute
from maxmoe.kernels import choice
from maxmoe.kernels.fp8_matmul import KERNEL_BACKENDS

FP8_COVERED = ("attention", "dense_mlp", "shared_experts", "routed_experts")  # the GEMMs model.fp8 quantises


def kernels_for(config, system: str) -> dict[str, choice.Choice]:
    """{"grouped_matmul", "attention"}: the kernels the config runs on `system` and why."""
    kind, dtype = SYSTEMS[system].device_kind, config.model.compute_dtype
    grouped, attention = config.moe.grouped_matmul, config.model.attention
    return {
        "grouped_matmul": choice.Choice(grouped, "set in the config")
        if grouped != "auto"
        else choice.resolve_grouped_matmul("auto", "cuda", kind, dtype),
        "attention": choice.Choice(attention, "set in the config")
        if attention != "auto"
        else choice.resolve_attention("auto", "cuda", kind, dtype),
    }


def _backend(name: str, config, arch: str, kernels: dict) -> tuple[str, str, str]:
    """(kernel class, backend, why) of class `name`."""
    recipe = config.model.fp8 if name in FP8_COVERED else "none"
    grouped = kernels["grouped_matmul"].name
    if name == "attention_core":
        if config.mesh.context > 1:
            return "attention_core", "latent", "mesh.context > 1: the latent core (XLA)"
        return "attention_core", kernels["attention"].name, kernels["attention"].reason
    if name == "routed_experts":
        if config.moe.dispatch == "capacity":
            return "dense_gemm", "capacity", "moe.dispatch=capacity: batched GEMMs over capacity slots"
        if recipe == "blockwise":
            kernel = "triton" if grouped in KERNEL_BACKENDS else "ragged_dot"
            return "grouped_gemm", kernel, f"blockwise beside {grouped}: {kernels['grouped_matmul'].reason}"
        return "grouped_gemm", grouped, kernels["grouped_matmul"].reason
    if recipe == "blockwise":
        kernel = "triton" if grouped in KERNEL_BACKENDS else "xla"
        return "dense_gemm", kernel, f"blockwise's dense GEMMs beside {grouped}"
    if recipe == "mxfp8" and arch == "blackwell":
        return "dense_gemm", "scaled_matmul", "mxfp8: jax.nn.scaled_matmul, an MXFP8 GEMM on Blackwell"
    return "dense_gemm", "xla", "XLA's dot"


def _dims(kernel_class: str, config, devices: int) -> dict:
    m, mesh = config.model, config.mesh
    if kernel_class == "attention_core":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        heads = max(1, m.num_heads // mesh.tensor)
        return {"h": heads, "t": config.train.seq_len, "qk": qk, "v": m.v_head_dim, "chunk": m.attention_chunk}
    if kernel_class == "grouped_gemm":
        ranks = mesh.expert * mesh.context if devices > 1 else 1
        return {"d": m.hidden_size, "f": m.moe_mlp_dim, "groups": max(1, m.num_experts // ranks)}
    return {"k": m.hidden_size, "capacity_factor": config.moe.capacity_factor}


def compute_rows(config, system: str, devices: int) -> tuple[Compute, ...]:
    """The planner's compute rows of one step of `config` on `devices` GPUs of `system`."""
    m, t = config.model, config.train
    arch = SYSTEMS[system].arch
    fp8 = fp8_gemm_classes(m.fp8, arch)
    kernels = kernels_for(config, system)
    per_device = t.batch_size * t.seq_len / devices
    model = flops_per_token_by_class(m, t.seq_len)
    again = recompute_flops_per_token(m, t.seq_len, expert_parallel=devices > 1)
    again["head"] = head_recompute_flops_per_token(m, t.loss_chunk)
    moved = context_flops_per_token(m, config.mesh.context)
    rows = []
    for name in (*model, *(k for k in moved if k not in model)):
        kernel_class, backend, why = _backend(name, config, arch, kernels)
        dims = _dims(kernel_class, config, devices)
        precision = m.fp8 if name in FP8_COVERED and m.fp8 != "none" else "bf16"
        useful = model.get(name, 0.0) + again.get(name, 0.0) + moved.get(name, 0.0)
        factor = overhead(kernel_class, backend, dims)
        if not model.get(name) and not useful:
            continue
        rows.append(
            Compute(
                name=name,
                kernel_class=kernel_class,
                backend=backend,
                precision=precision,
                peak="fp8" if name in fp8 else "bf16",
                model_flops=model.get(name, 0.0) * per_device,
                executed_flops=useful * factor * per_device,
                overhead=factor,
                dims=tuple(sorted(dims.items())),
                reason=why,
            )
        )
    return tuple(rows)


def seconds_per_flop(config, system: str, devices: int, assumptions=None) -> dict[str, float]:
    """{class: seconds per FLOP (model and recompute) on `system`}: the kernel's overhead over its peak
    x efficiency (maxmoe.analysis.calibration) -- how long a pipeline stage's work of each class takes."""
    a = assumptions or Assumptions()
    out = {}
    for row in compute_rows(config, system, devices):
        e = efficiency(row, SYSTEMS[system], a)[0]
        out[row.name] = row.overhead / (SYSTEMS[system].peak_tflops(row.peak) * 1e12 * e)
    return out
