"""Every test runs on CPU with 8 fake devices; the flag must be set before jax starts."""

import os

os.environ["XLA_FLAGS"] = (
    " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    )
    + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
