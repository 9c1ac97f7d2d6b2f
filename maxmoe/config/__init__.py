"""Typed, frozen configuration: one module per section, the loader (`load_config`) written once.

Every key is declared with its type and allowed values; YAML files hold values only. Bad
input raises `ConfigError` with one line naming the key, the value and what is allowed (and,
for unknown keys, the nearest valid key); entry points turn it into `maxmoe: error: ...` and
exit status 2 (maxmoe.cli). Of the rest of maxmoe this package imports only the shared names
(maxmoe.parallel.names).
"""

from maxmoe.config.checkpoint import CheckpointConfig
from maxmoe.config.data import DataConfig, source_in_effect
from maxmoe.config.dist import DistConfig
from maxmoe.config.errors import ConfigError, UserError, read_named_file
from maxmoe.config.loader import (
    Config,
    all_keys,
    build_config,
    build_model_config,
    default_run_dir,
    describe_keys,
    load_config,
    validate,
)
from maxmoe.config.mesh import ACROSS_DOMAINS, DEFAULT_RULES, ZERO1_TIMINGS, MeshConfig, check_mesh_fits, mesh_sizes
from maxmoe.config.model import ATTENTION_IMPLEMENTATIONS, FP8_RECIPES, MAX_TOKEN_ID, ModelConfig, validate_model
from maxmoe.config.moe import DISPATCH_STRATEGIES, GROUPED_MATMUL_BACKENDS, MOE_OVERLAPS, MoEConfig
from maxmoe.config.run import MAX_CPU_DEVICES, RunConfig
from maxmoe.config.train import MAX_BATCH_TOKENS, MAX_SEED, PIPELINE_RESIDUALS, TrainConfig
from maxmoe.config.xla import XLA_PROFILES, XlaConfig

__all__ = [
    "ACROSS_DOMAINS",
    "ATTENTION_IMPLEMENTATIONS",
    "DEFAULT_RULES",
    "DISPATCH_STRATEGIES",
    "FP8_RECIPES",
    "GROUPED_MATMUL_BACKENDS",
    "MAX_BATCH_TOKENS",
    "MAX_CPU_DEVICES",
    "MAX_SEED",
    "MAX_TOKEN_ID",
    "MOE_OVERLAPS",
    "PIPELINE_RESIDUALS",
    "XLA_PROFILES",
    "ZERO1_TIMINGS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "RunConfig",
    "TrainConfig",
    "UserError",
    "XlaConfig",
    "all_keys",
    "build_config",
    "build_model_config",
    "check_mesh_fits",
    "default_run_dir",
    "describe_keys",
    "load_config",
    "mesh_sizes",
    "read_named_file",
    "source_in_effect",
    "validate",
    "validate_model",
]
