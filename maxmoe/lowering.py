"""Lower one training step for another platform (CUDA on a CPU host) and count its collectives.

Lowering needs no GPU: jax traces the step over the configured mesh of host devices and
emits the StableHLO a CUDA backend would compile. The counts are of collectives written
in the program (the expert dispatch inside shard_map); XLA's SPMD partitioner adds the
data-parallel gradient reductions later, at compile time, for the real devices. The
caller provides the host devices first (`maxmoe.runtime.set_host_device_count`).
"""

from __future__ import annotations

from maxmoe.config import Config
from maxmoe.hlo import count_collectives
from maxmoe.mesh import build_layout
from maxmoe.training.programs import build_programs


def lower_train_step(config: Config, platform: str = "cuda"):
    """The jax Lowered object of one train step (abstract inputs; nothing allocated)."""
    programs = build_programs(config, build_layout(config, platform=platform))
    step = programs.train_step
    return step.trace(programs.abstract_state, programs.abstract_batch(config)).lower(lowering_platforms=(platform,))


def collective_counts_for_platform(config: Config, platform: str = "cuda") -> dict[str, int]:
    """Collective counts of one train step lowered for `platform`."""
    return count_collectives(lower_train_step(config, platform).as_text())
