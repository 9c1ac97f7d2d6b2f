"""jax.distributed initialisation: one JAX process per host (or per GPU), no home-made launcher.

    initialize(config.dist)          # before any jax computation, like xla_flags.apply

`dist.mode`: `none` does nothing; `explicit` calls jax.distributed.initialize with
dist.coordinator_address, dist.num_processes and dist.process_id; `auto` does the same when an
address is given, else initialises only when the environment shows a multi-process launch
(`detect_launch`: SLURM, OpenMPI, a Kubernetes JobSet, JAX_COORDINATOR_ADDRESS with
JAX_NUM_PROCESSES and JAX_PROCESS_ID read by `auto_arguments`), and on a laptop, one GPU host
or in a notebook nothing happens. Failures are one-line UserErrors; because jaxlib aborts the
process on an unreachable coordinator, processes other than 0 first wait up to dist.timeout_s
for a TCP connection to a known coordinator (`wait_for_coordinator`).

docs/ARCHITECTURE.md, "Several processes" has the launchers, the environment convention and why.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import jax

from maxmoe.config import DistConfig, UserError
from maxmoe.xla_flags import detect_gpu_name


def _int_env(environ: Mapping[str, str], key: str) -> int | None:
    try:
        return int(environ[key])
    except (KeyError, ValueError):
        return None


def detect_launch(environ: Mapping[str, str] | None = None) -> str | None:
    """Which multi-process launcher started this process: slurm, openmpi, jobset, env; or None."""
    environ = os.environ if environ is None else environ
    if (_int_env(environ, "SLURM_NTASKS") or 1) > 1:
        return "slurm"
    if (_int_env(environ, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        return "openmpi"
    if environ.get("JOBSET_NAME"):
        return "jobset"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "env"
    return None


def auto_arguments(environ: Mapping[str, str] | None = None) -> dict:
    """Keyword arguments for jax.distributed.initialize in auto mode ({} = let JAX detect).

    Explicit values are passed only when the environment gives all three of
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (or JOB_COMPLETION_INDEX,
    a Kubernetes indexed Job's pod index, for the process id).
    """
    environ = os.environ if environ is None else environ
    address = environ.get("JAX_COORDINATOR_ADDRESS")
    count = _int_env(environ, "JAX_NUM_PROCESSES")
    index = _int_env(environ, "JAX_PROCESS_ID")
    if index is None:
        index = _int_env(environ, "JOB_COMPLETION_INDEX")
    if address and count is not None and index is not None:
        return {"coordinator_address": address, "num_processes": count, "process_id": index}
    return {}


def _cpu_only() -> bool:
    """Whether this process will run on CPU only (decided before the backend starts)."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return all(p == "cpu" for p in platforms)
    return detect_gpu_name() is None


def _split_address(address: str, source: str = "coordinator address") -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{source} {address!r} is not host:port (e.g. 10.0.0.1:1234)")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once a TCP connection to `address` (host:port) succeeds; UserError after `timeout_s`.

    Process 0 starts the coordinator a little after the others may start, so retry.
    """
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, remaining))):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() + 1.0 > deadline:
            raise UserError(
                f"cannot reach the jax.distributed coordinator at {address} within {timeout_s:g}s "
                f"({last}); is process 0 running, and is the port open between hosts?"
            )
        time.sleep(1.0)


def initialize(dist_config: DistConfig) -> None:
    """Start JAX's multi-controller runtime as `dist_config.mode` says (see the module doc)."""
    if dist_config.mode == "none":
        return
    if dist_config.mode == "explicit" or dist_config.coordinator_address:
        kwargs = {
            "coordinator_address": dist_config.coordinator_address,
            "num_processes": dist_config.num_processes,
            "process_id": dist_config.process_id,
        }
        launcher = f"dist.mode={dist_config.mode}, dist.coordinator_address given"
        if dist_config.mode == "explicit":
            launcher = "dist.mode=explicit"
        many = dist_config.num_processes > 1
    elif dist_config.mode == "auto":
        launcher = detect_launch()
        if launcher is None:
            return
        kwargs = auto_arguments()
        if kwargs:  # jax would fail on a malformed address with an IndexError
            _split_address(kwargs["coordinator_address"], "JAX_COORDINATOR_ADDRESS")
        many = kwargs.get("num_processes", 2) > 1
        launcher = f"dist.mode=auto ({launcher})"
    else:
        raise UserError(f"dist.mode={dist_config.mode!r}: allowed values are auto, none, explicit")
    if jax.distributed.is_initialized():
        return  # a notebook or a caller got there first; initialising twice is an error in JAX
    if many and _cpu_only():
        # CPU collectives across processes need an implementation; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if kwargs.get("process_id", 0) != 0:
        wait_for_coordinator(kwargs["coordinator_address"], dist_config.timeout_s)
    try:
        jax.distributed.initialize(**kwargs, initialization_timeout=dist_config.timeout_s)
    except Exception as e:  # noqa: BLE001 - jax raises RuntimeError, ValueError or XlaRuntimeError
        where = kwargs.get("coordinator_address") or "auto-detected coordinator"
        detail = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(
            f"jax.distributed.initialize failed ({launcher}, coordinator {where}, "
            f"timeout {dist_config.timeout_s}s): {detail}"
        ) from None
