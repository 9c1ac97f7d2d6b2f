"""maxmoe: DeepSeek-V3-style mixture-of-experts pre-training in JAX."""

__version__ = "0.1.0"
