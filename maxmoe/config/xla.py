"""xla: XLA flag profiles (maxmoe.xla_flags), extra flags, and the GPU memory share."""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field

XLA_PROFILES = ("h100", "h200", "b200", "gb200", "gb300")  # GPU systems with a flag profile (maxmoe.xla_flags)


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """XLA flag profiles (maxmoe.xla_flags)."""

    profile: str = field(
        "auto", choices=("auto", "none") + XLA_PROFILES, doc="XLA GPU flag profile; auto: from the device kind"
    )
    extra_flags: list = field([], doc="more XLA flags, e.g. ['--xla_gpu_enable_command_buffer=']")
    memory_fraction: float = field(
        0.95,
        ge=0,
        doc="XLA_PYTHON_CLIENT_MEM_FRACTION: share of GPU memory JAX may use (its own default, 0.75, "
        "refuses plans the dry run fits); 0: JAX's default; the environment variable wins",
    )


def check_xla(config) -> None:
    """A memory share of at most the whole GPU; extra flags written as XLA flags."""
    xla = config.xla
    if xla.memory_fraction > 1:
        raise ConfigError(f"xla.memory_fraction={xla.memory_fraction}: must be <= 1 (a share of the GPU's memory)")
    for flag in xla.extra_flags:
        if not isinstance(flag, str) or not flag.startswith("--") or len(flag.strip()) < 3 or " " in flag.strip():
            raise ConfigError(f"xla.extra_flags: {flag!r} is not an XLA flag (expected --xla_name=value)")
