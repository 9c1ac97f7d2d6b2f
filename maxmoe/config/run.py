"""run: where output goes and how the process runs."""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field

MAX_CPU_DEVICES = 4096  # fake host devices: ~0.2 MB and threads each; 1,024-GPU dry runs need 1,024


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where output goes and how the process runs."""

    dir: str = field(
        "runs/default",
        path=True,
        doc="metrics, resolved config, XLA flags and checkpoints go here; unset: runs/<stem of the --config "
        "file> (files merged: stems joined by '+'; a file named config.yaml: its folder's name)",
    )
    cpu_devices: int = field(0, ge=0, doc="on a CPU host: N host devices; 0: leave as is")
    tensorboard: bool = field(False, doc="also write TensorBoard events (needs tensorboardX)")
    peak_tflops: float = field(0.0, ge=0, doc="per-device peak for MFU; 0: from the device kind")
    profile_steps: list = field([], doc="[first, last] steps to trace with jax.profiler")
    progress: str = field(
        "auto",
        choices=("auto", "bar", "plain", "none"),
        doc="console: a live bar on a terminal (auto) or plain lines; none: quiet (notebooks)",
    )
    compile_cache: str = field(
        "auto",
        doc="jax's persistent compilation cache folder: a second run of the same program loads it instead of "
        "compiling; auto: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/maxmoe/jax (10 GB, least recently used "
        "dropped); none: off",
    )


def check_run(config) -> None:
    """A run folder, a device count a host can fake, and profiled steps inside the run."""
    run, steps = config.run, config.train.steps
    if not run.dir.strip():
        raise ConfigError("run.dir is empty; name the folder for checkpoints and metrics (e.g. run.dir=runs/my-run)")
    if not run.compile_cache.strip():
        raise ConfigError("run.compile_cache is empty; give a folder, auto (the user cache folder) or none (off)")
    if run.cpu_devices > MAX_CPU_DEVICES:
        raise ConfigError(
            f"run.cpu_devices={run.cpu_devices}: must be <= {MAX_CPU_DEVICES} "
            f"(each fake device costs host memory and threads)"
        )
    ps = run.profile_steps
    if ps and (len(ps) != 2 or not all(isinstance(s, int) and s >= 0 for s in ps) or ps[0] > ps[1]):
        raise ConfigError(f"run.profile_steps={ps!r}: expected [first, last] step numbers")
    if ps and ps[1] >= steps:  # steps count from 0: a trace that never ends writes nothing
        raise ConfigError(
            f"run.profile_steps={ps!r}: past the run's last step, {steps - 1} (train.steps={steps}; steps count from 0)"
        )
