"""Lower one training step for another platform (CUDA on a CPU host) and count its collectives.

Lowering needs no GPU: jax traces the step over the configured mesh of host devices and
emits the StableHLO a CUDA backend would compile. The counts are of collectives written
in the program (the expert dispatch inside shard_map); XLA's SPMD partitioner adds the
data-parallel gradient reductions later, at compile time, for the real devices.
"""

from __future__ import annotations

import re

from maxmoe.config import Config

COLLECTIVES = ("ragged_all_to_all", "all_to_all", "all_gather", "reduce_scatter", "all_reduce", "collective_permute")


def lower_train_step(config: Config, platform: str = "cuda"):
    """The jax Lowered object of one train step (abstract inputs; nothing allocated)."""
    from maxmoe.train import set_host_device_count

    set_host_device_count(config.run.cpu_devices)
    from maxmoe.mesh import build_layout
    from maxmoe.training.programs import build_programs

    programs = build_programs(config, build_layout(config, platform=platform))
    step = programs.train_step
    return step.trace(programs.abstract_state, programs.abstract_batch(config)).lower(lowering_platforms=(platform,))


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Occurrences of each collective op in StableHLO text (custom calls included)."""
    counts = {}
    for name in COLLECTIVES:
        pattern = rf"(stablehlo\.{name}\b|@{name}\b|\"{name}\")"
        counts[name] = len(re.findall(pattern, hlo_text))
    return counts


def collective_counts_for_platform(config: Config, platform: str = "cuda") -> dict[str, int]:
    """Collective counts of one train step lowered for `platform`."""
    return count_collectives(lower_train_step(config, platform).as_text())
