"""dist: the multi-process runtime (jax.distributed) and its launch keys."""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """Multi-process runtime (jax.distributed)."""

    mode: str = field(
        "auto",
        choices=("auto", "none", "explicit"),
        doc="auto: detect SLURM/OpenMPI/Kubernetes, or explicit when dist.coordinator_address is given",
    )
    coordinator_address: str = field("", doc="host:port of process 0; needs num_processes and process_id")
    num_processes: int = field(0, ge=0, doc="explicit: number of processes")
    process_id: int = field(-1, ge=-1, doc="explicit: this process' index")
    timeout_s: int = field(300, gt=0, doc="seconds to wait for every process to connect")


def _check_coordinator_address(address: str) -> None:
    """host:port, the port a number in 1..65535 ([v6::addr]:port for IPv6)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"dist.coordinator_address={address!r}: expected host:port (e.g. 10.0.0.1:1234)")


def check_dist(config) -> None:
    """dist.coordinator_address / num_processes / process_id: all three, under explicit or auto mode.

    Under dist.mode=auto, a coordinator address makes the launch explicit (maxmoe.distributed);
    keys that would be ignored are refused rather than dropped.
    """
    dist = config.dist
    given = [
        f"dist.{name}"
        for name, unset in (("coordinator_address", ""), ("num_processes", 0), ("process_id", -1))
        if getattr(dist, name) != unset
    ]
    if dist.mode == "none" and given:
        raise ConfigError(f"dist.mode=none ignores {', '.join(given)}; remove it or set dist.mode=explicit")
    if dist.mode == "explicit" or given:
        missing = [
            key
            for key, bad in (
                ("dist.coordinator_address", not dist.coordinator_address),
                ("dist.num_processes", dist.num_processes < 1),
                ("dist.process_id", dist.process_id < 0),
            )
            if bad
        ]
        if missing:
            why = "dist.mode=explicit" if dist.mode == "explicit" else f"{', '.join(given)} (explicit launch)"
            raise ConfigError(f"{why} also needs {', '.join(missing)}")
        _check_coordinator_address(dist.coordinator_address)
        if dist.process_id >= dist.num_processes:
            raise ConfigError(
                f"dist.process_id={dist.process_id} is outside 0..{dist.num_processes - 1} (dist.num_processes)"
            )
