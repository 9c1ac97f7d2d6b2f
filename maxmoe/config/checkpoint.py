"""checkpoint: orbax checkpointing's cadence, retention, resume and initialisation."""

from __future__ import annotations

import dataclasses

from maxmoe.config.fields import field


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing."""

    # Saves are asynchronous (the step waits only for the device-to-host copy), so a save
    # every 100 steps costs little even for short runs, and a killed run loses at most 100.
    every: int = field(100, ge=0, doc="steps between checkpoints (and one at the end); 0: only at the end")
    keep: int = field(3, gt=0, doc="newest checkpoints kept")
    keep_every: int = field(0, ge=0, doc="also keep every N-th step; 0: off")
    resume: bool = field(True, doc="continue from the latest checkpoint in run.dir; false: refuse a non-empty run.dir")
    init_from: str = field("", path=True, doc="initialise parameters only from this checkpoint")
    allow_config_change: bool = field(
        False, doc="resume although the model, its numerics, the optimizer or the data order changed"
    )
    async_save: bool = field(True, doc="write checkpoints in the background")
