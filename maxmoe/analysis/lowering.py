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
