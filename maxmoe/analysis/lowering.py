"""Lower one training step for another platform (CUDA on a CPU host) and count its collectives.

Lowering needs no GPU: jax traces the step over the configured mesh of host devices and
emits the StableHLO a CUDA backend would compile. The counts are of collectives written
in the program (the expert dispatch inside shard_map); XLA's SPMD partitioner adds the
data-parallel gradient reductions later, at compile time, for the real devices. The
caller provides the host devices first (`maxmoe.runtime.set_host_device_count`). With
pipeline stages, `stage_spans` tells the collectives inside one stage from those between
stages (the activations' permutes, the end-of-step sums).
"""

from __future__ import annotations

import jax

from maxmoe.analysis.hlo import collective_spans, count_collectives
from maxmoe.config import Config
from maxmoe.kernels.fp8_grouped import GEMM_NAME, WGRAD_NAME
from maxmoe.parallel.layout import build_layout
from maxmoe.training.programs import build_programs


def lower_train_step(config: Config, platform: str = "cuda"):
    """The jax Lowered object of one train step (abstract inputs; nothing allocated)."""
    programs = build_programs(config, build_layout(config, platform=platform))
    step = programs.train_step
    return step.trace(programs.abstract_state, programs.abstract_batch(config)).lower(lowering_platforms=(platform,))


def collective_counts_for_platform(config: Config, platform: str = "cuda") -> dict[str, int]:
    """Collective counts of one train step lowered for `platform`."""
    return count_collectives(lower_train_step(config, platform).as_text())


def stage_spans(config: Config, stablehlo_text: str) -> dict[str, dict[str, int]]:
    """Per collective kind, how many stay inside one pipeline stage and how many cross stages.

    Device ids in the program are positions in the mesh, whose outermost axis is `pipeline`,
    so the stage of device d is d // (devices per stage).
    """
    devices = config.run.cpu_devices or jax.device_count()
    per_stage = devices // config.mesh.pipeline
    return collective_spans(stablehlo_text, [d // per_stage for d in range(devices)])


def moe_layer_lowered_text(config: Config, devices: list) -> str:
    """One MoE layer of `config` (its dims, mesh and dispatch), forward and backward, lowered
    for CUDA: the program in which `a2a_independent_chains` looks for batch_split's chains."""
    import flax.linen as nn

    from maxmoe.model.moe import MoE
    from maxmoe.model.transformer import COMPUTE_DTYPES

    layout = build_layout(config, devices, platform="cuda")
    dtype = COMPUTE_DTYPES[config.model.compute_dtype]
    module = MoE(config.model, dtype, layout)
    t = config.train
    rows = t.batch_size // t.grad_accum
    x = jax.ShapeDtypeStruct((rows, t.seq_len, config.model.hidden_size), dtype)
    variables = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), x))

    def forward_backward(params, router, x, dy):
        def layer(params, x):
            return module.apply({"params": params, "router": router}, x, mutable=["moe_stats"])[0]

        y, vjp = jax.vjp(layer, params, x)
        return y, vjp(dy)

    lowered = jax.jit(forward_backward).trace(variables["params"], variables["router"], x, x)
    return lowered.lower(lowering_platforms=("cuda",)).as_text()


def a2a_independent_chains(config: Config, devices: list) -> bool:
    """Whether the expert all-to-all can run under other GEMMs: `moe.overlap=batch_split` and one
    MoE layer's CUDA program holds two or more independent dispatch chains, no exchange of one
    waiting on another's expert GEMMs (maxmoe.analysis.hlo_deps)."""
    if config.moe.overlap != "batch_split":
        return False
    from maxmoe.analysis.hlo_deps import independent_chains, marker_dependencies

    text = moe_layer_lowered_text(config, devices)
    chains, coupled = independent_chains(marker_dependencies(text, GROUPED_GEMM_MARKERS))
    return len(chains) >= 2 and not coupled


# The dependence markers of a CUDA-lowered MoE layer: its ragged all-to-alls and its grouped GEMMs,
# XLA's ragged_dot, a GPU kernel backend's custom call (maxmoe.kernels.grouped_matmul) or, under
# model.fp8=blockwise, maxmoe's Triton FP8 grouped kernels (a Triton custom call named by the kernel).
_TRITON_GROUPED = rf'custom_call @__gpu\$xla\.gpu\.triton\(.*\bname = "(?:{GEMM_NAME}|{WGRAD_NAME})"'
GROUPED_GEMM_MARKERS = {
    "ragged_all_to_all": r"@ragged_all_to_all\b",
    "ragged_dot": rf"(\bchlo\.ragged_dot\b|custom_call @mosaic_gpu\w*|{_TRITON_GROUPED})",
}
