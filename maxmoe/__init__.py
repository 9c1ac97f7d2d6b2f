"""maxmoe: DeepSeek-V3-style mixture-of-experts pre-training in JAX.

The notebook API, imported on first use (so `import maxmoe` starts nothing):

    import maxmoe
    maxmoe.set_host_device_count(8)       # first, before any jax computation (CPU hosts)
    config = maxmoe.load_config("configs/tiny.yaml", ["train.steps=100"])
    trainer = maxmoe.Trainer(config)      # see maxmoe.training.trainer
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Config": "maxmoe.config",
    "ConfigError": "maxmoe.config",
    "UserError": "maxmoe.config",
    "load_config": "maxmoe.config",
    "set_host_device_count": "maxmoe.runtime",
    "Trainer": "maxmoe.training.trainer",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'maxmoe' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
