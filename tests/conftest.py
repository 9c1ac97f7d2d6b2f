"""Every test runs on CPU with 8 fake devices; the flags must be set before jax starts.

The tests compare numbers, not speed, so XLA:CPU compiles with its cheap LLVM settings (the
dry run's FAST_CPU_COMPILE): the suite spends most of its time compiling small programs, and
this takes about a third off it. A setting already in XLA_FLAGS is kept.
"""

import os
import socket
from pathlib import Path

import pytest

from maxmoe.xla_flags import FAST_CPU_COMPILE, as_flags, flag_name  # imports no jax

ROOT = Path(__file__).resolve().parents[1]
_DEVICE_COUNT = "xla_force_host_platform_device_count"
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if flag_name(f) != _DEVICE_COUNT]
_flags += [f for f in as_flags(FAST_CPU_COMPILE) if flag_name(f) not in {flag_name(g) for g in _flags}]
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"--{_DEVICE_COUNT}=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def job_env(**extra: str) -> dict:
    """The environment of a maxmoe job a test starts as a subprocess: this checkout on the path,
    the suite's XLA flags without the device count (the job's run.cpu_devices decides it)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": " ".join(_flags), **extra}


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
