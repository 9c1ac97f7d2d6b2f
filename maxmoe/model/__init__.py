"""The DeepSeek-V3 network: pure math over a parameter pytree; logical axis names only."""

from maxmoe.model.transformer import Transformer, build_model, logits

__all__ = ["Transformer", "build_model", "logits"]
