"""Every test runs on CPU with 8 fake devices; the flags must be set before jax starts.

The tests compare numbers, not speed, so XLA:CPU compiles with its cheap LLVM settings (the
dry run's): the suite spends most of its time compiling small programs, and this takes about
a fifth off it. A setting already in XLA_FLAGS is kept.
"""

import os
import socket

import pytest

_DEVICE_COUNT = "--xla_force_host_platform_device_count"
_CHEAP_COMPILE = {"--xla_backend_optimization_level": "0", "--xla_llvm_disable_expensive_passes": "true"}
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
_flags += [f"{name}={value}" for name, value in _CHEAP_COMPILE.items() if not any(f.startswith(name) for f in _flags)]
os.environ["XLA_FLAGS"] = " ".join([*_flags, f"{_DEVICE_COUNT}=8"])
# For maxmoe jobs the tests start as subprocesses: the same flags, but the job's run.cpu_devices
# decides its device count.
JOB_XLA_FLAGS = " ".join(_flags)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (for a jax.distributed coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
