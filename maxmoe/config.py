"""Typed, frozen configuration: YAML files merged in order, then `section.key=value` overrides.

Every key is declared here with its type and allowed values; YAML files hold values only.
Bad input raises `ConfigError` with one line naming the key, the value and what is
allowed (and, for unknown keys, the nearest valid key). Entry points turn it into
`maxmoe: error: ...` and exit status 2 (see `maxmoe.cli`).

This module imports nothing else from maxmoe.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from pathlib import Path
from typing import Any

import yaml

# Names other modules import rather than spell out again.
# Mesh axes, outermost (may span scale-up domains) to innermost. `pipeline` (stages),
# `replica` and `context` are in a mesh only when larger than 1. `replica` is derived, not
# configured: under mesh.across_domains=zero1 it is the part of data parallelism that crosses
# scale-up domains. `context` shards the sequence in attention and folds into expert
# parallelism in MoE layers (maxmoe.parallel.context).
MESH_AXES = ("pipeline", "replica", "data", "context", "expert", "tensor")
REPLICA_AXIS = "replica"
CONTEXT_AXIS = "context"
# jax scope of context parallelism's latent all-gathers (maxmoe.parallel.context); the planner
# counts what runs under it as exposed (it waits on the layer's own activations).
LATENT_GATHER = "context_latent_gather"
# jax scope of the two-tier step's ZeRO-1 gradient reduction (maxmoe.parallel.replicas): the dry
# run counts it as the GPU runs it, the planner times it by where it runs (after the loop, or in
# the last micro-batch's layer loop under mesh.reduce_per_layer).
ZERO1_REDUCTION = "reduce_to_zero1"
SIZED_MESH_AXES = tuple(a for a in MESH_AXES if a != REPLICA_AXIS)  # the axes mesh.<axis> sizes
OPTIONAL_MESH_AXES = ("pipeline", REPLICA_AXIS, CONTEXT_AXIS)  # left out of a mesh where their size is 1
ACROSS_DOMAINS = ("fsdp", "zero1")  # mesh.across_domains (docs/SHARDING.md, "Two tiers")
TWO_TIER_OPTIONS = ("gather_once", "reduce_per_layer", "sum_per_layer")  # mesh.* of the zero1 step only
PIPELINE_RESIDUALS = ("vjp", "recompute")  # maxmoe.parallel.pipeline
DISPATCH_STRATEGIES = ("ragged_a2a", "allgather", "capacity")  # maxmoe.parallel.dispatch
GROUPED_MATMUL_BACKENDS = ("ragged_dot", "mosaic_gpu", "tokamax", "dense_loop")  # maxmoe.kernels.grouped_matmul
ATTENTION_IMPLEMENTATIONS = (
    "xla",
    "chunked",
    "triton",
    "cudnn",
    "tokamax",
)  # model/attention_ops, kernels/attention
FP8_RECIPES = ("tensorwise", "blockwise", "mxfp8")  # maxmoe.kernels.fp8_matmul
XLA_PROFILES = ("h100", "h200", "b200", "gb200", "gb300")  # GPU systems with a flag profile (maxmoe.xla_flags)
# What the backward pass keeps instead of recomputing (maxmoe.model.transformer.REMAT_POLICIES).
REMAT_CHOICES = ("none", "full", "save_matmuls", "save_comm", "save_moe", "save_dots_comm")
MOE_OVERLAPS = ("none", "batch_split")  # maxmoe.parallel.dispatch


class UserError(Exception):
    """An error caused by the user's input; reported as one line, exit status 2."""


class ConfigError(UserError):
    """A bad configuration key or value."""


def read_named_file(path: str | Path, what: str, *, missing: str = "", error: type[UserError] = UserError) -> bytes:
    """The bytes of a file the user named, else one `error` line saying why not: a folder, not a
    regular file (a device, a FIFO), missing (`missing` says what that suggests), unreadable."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{what} {path} is a folder; name a file")
    if p.exists() and not p.is_file():
        raise error(f"{what} {path} is not a regular file")
    if not p.is_file():
        raise error(f"{what} {path} not found{missing}")
    try:
        return p.read_bytes()
    except OSError as e:
        raise error(f"{what} {path}: cannot read it ({e.strerror or type(e).__name__})") from None


def _field(default, *, choices=None, ge=None, gt=None, auto=False, doc=""):
    """A config field with its allowed values and one line of doc; mutable defaults are copied per instance.

    `auto=True` also allows the string "auto" (a value resolved later, e.g. from the data).
    """
    meta = {"choices": choices, "ge": ge, "gt": gt, "auto": auto, "doc": doc}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The network: DeepSeek-V3 architecture hyper-parameters (defaults: a tiny model)."""

    vocab_size: int = _field(
        260, gt=0, auto=True, doc="token ids 0..N-1 (byte corpus: 256 bytes + 4 specials); auto: from the data"
    )
    hidden_size: int = _field(64, gt=0, doc="model width D (DeepSeek-V3: 7168)")
    num_layers: int = _field(3, gt=0, doc="main-model layers (dense + MoE)")
    first_k_dense: int = _field(1, ge=0, doc="leading layers with a dense SwiGLU MLP")
    mlp_dim: int = _field(128, gt=0, doc="dense SwiGLU hidden size (intermediate_size)")
    moe_mlp_dim: int = _field(32, gt=0, doc="per-expert hidden size (moe_intermediate_size)")
    num_heads: int = _field(4, gt=0, doc="attention heads")
    q_lora_rank: int = _field(32, ge=0, doc="0: plain query projection")
    kv_lora_rank: int = _field(32, gt=0, doc="compressed key/value latent width (MLA)")
    qk_nope_head_dim: int = _field(16, gt=0, doc="query/key head dims without rotary embedding")
    qk_rope_head_dim: int = _field(8, gt=0, doc="query/key head dims with rotary embedding (decoupled RoPE)")
    v_head_dim: int = _field(16, gt=0, doc="value head dims")
    num_experts: int = _field(8, gt=0, doc="routed experts (n_routed_experts)")
    num_shared_experts: int = _field(1, ge=0, doc="experts every token passes through")
    experts_per_token: int = _field(2, gt=0, doc="routed experts per token (top-k)")
    num_expert_groups: int = _field(4, gt=0, doc="n_group for group-limited routing")
    topk_groups: int = _field(2, gt=0, doc="groups kept per token (topk_group)")
    norm_topk_prob: bool = _field(True, doc="normalise the chosen experts' scores to sum to 1")
    routed_scaling_factor: float = _field(2.5, gt=0, doc="multiplies the routed experts' combine weights")
    score_func: str = _field("sigmoid", choices=("sigmoid", "softmax"), doc="router affinity (DeepSeek-V3: sigmoid)")
    rms_norm_eps: float = _field(1e-6, gt=0, doc="RMSNorm epsilon")
    rope_theta: float = _field(10000.0, gt=0, doc="RoPE base")
    rope_scaling: str = _field("yarn", choices=("none", "yarn"), doc="none: plain RoPE; yarn: context extension")
    rope_factor: float = _field(4.0, gt=0, doc="yarn: context extension factor")
    rope_original_max_position: int = _field(64, gt=0, doc="yarn: context length before extension")
    rope_beta_fast: float = _field(32.0, gt=0, doc="yarn: rotations above which frequencies are kept")
    rope_beta_slow: float = _field(1.0, gt=0, doc="yarn: rotations below which frequencies are interpolated")
    rope_mscale: float = _field(1.0, ge=0, doc="yarn: attention temperature coefficient")
    rope_mscale_all_dim: float = _field(1.0, ge=0, doc="yarn: temperature coefficient shared by all dims")
    max_position_embeddings: int = _field(256, gt=0, doc="longest context the model is built for")
    mtp_num_layers: int = _field(1, ge=0, doc="multi-token prediction depth")
    mtp_loss_weight: float = _field(0.3, ge=0, doc="weight of the mean MTP loss in the total")
    compute_dtype: str = _field("bfloat16", choices=("bfloat16", "float32"), doc="matmul dtype (params stay float32)")
    remat: str = _field(
        "none",
        choices=REMAT_CHOICES,
        doc="what the backward pass keeps rather than recomputes; the table in maxmoe.model.transformer",
    )
    attention: str = _field(
        "auto",
        choices=("auto",) + ATTENTION_IMPLEMENTATIONS,
        doc="auto: triton on NVIDIA GPUs, chunked elsewhere (maxmoe.kernels.choice)",
    )
    attention_chunk: int = _field(512, gt=0, doc="chunked attention: block length (largest divisor of T up to this)")
    init_std: float = _field(0.02, gt=0, doc="normal init std of weight matrices")
    fp8: str = _field(
        "none",
        choices=("none",) + FP8_RECIPES,
        doc="FP8 GEMMs (forward and both gradients) in the dense projections and experts: tensorwise "
        "(per-tensor scales), blockwise (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks), "
        "mxfp8 (e8m0 scale per 32); attention core, norms, router, embedding and head stay bf16/f32",
    )


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Expert dispatch and load balancing."""

    dispatch: str = _field(
        "auto",
        choices=("auto",) + DISPATCH_STRATEGIES,
        doc="how tokens reach experts: ragged all-to-all (dropless), all-gather, or fixed capacity; auto: ragged_a2a",
    )
    capacity_factor: float = _field(1.25, gt=0, doc="capacity dispatch: slots per expert / even share")
    buffer_factor: float = _field(0.0, ge=0, doc="0: dropless receive buffers; >0 bounds them")
    grouped_matmul: str = _field(
        "auto",
        choices=("auto",) + GROUPED_MATMUL_BACKENDS,
        doc="grouped GEMM backend for the experts; auto: mosaic_gpu on Hopper GPUs, ragged_dot elsewhere "
        "(maxmoe.kernels.choice)",
    )
    overlap: str = _field(
        "none", choices=MOE_OVERLAPS, doc="batch_split: each shard's tokens as two independent dispatch halves"
    )
    a2a_chunks: int = _field(1, gt=0, doc="ragged_a2a: slices per (source, destination) block of each all-to-all")
    emulate_ragged_a2a: str = _field(
        "auto", choices=("auto", "true", "false"), doc="auto: emulate where the backend lacks ragged all-to-all"
    )
    fp8_dispatch: bool = _field(
        False,
        doc="with model.fp8: the dispatch all-to-all moves rows in e4m3 plus scales (about half the bytes); "
        "the combine stays in the compute dtype",
    )
    bias_update_rate: float = _field(
        0.001, ge=0, doc="aux-loss-free balancing: router bias step per training step (DeepSeek-V3: 0.001)"
    )
    seq_aux_alpha: float = _field(0.0001, ge=0, doc="sequence-wise balance loss weight (DeepSeek-V3: 0.0001)")


DEFAULT_RULES = {
    "batch": ["data", "expert"],
    "seq": [],
    "embed": ["fsdp"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "q_lora": [],
    "kv_lora": [],
    "head_dim": [],
    "mlp": ["tensor"],
    "expert": ["expert"],
    "expert_mlp": ["tensor"],
    "vocab": ["tensor"],
    "layers": [],
}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh and logical-to-mesh sharding rules (see docs/SHARDING.md)."""

    pipeline: int = _field(
        1, gt=0, doc="pipeline stages (outermost; may span domains: only activations cross it); 1: no pipeline"
    )
    pipeline_virtual: int = _field(
        1, gt=0, doc="pipeline: model chunks per stage (interleaved schedule); ignored without stages"
    )
    pipeline_pad_front: int = _field(
        0,
        ge=0,
        doc="pipeline: empty layer slots before the first layer (balances stage 0, which runs the embedding and MTP)",
    )
    data: int = _field(1, doc="data-parallel devices (may span domains); -1 fills the remaining devices")
    context: int = _field(
        1,
        gt=0,
        doc="context-parallel devices (inside a scale-up domain): attention shards each sequence over them "
        "(zigzag chunks, MLA latents all-gathered) and MoE layers add them to expert parallelism; 1: none",
    )
    expert: int = _field(1, doc="expert-parallel devices (inside a scale-up domain); -1 fills")
    tensor: int = _field(1, doc="tensor-parallel devices (inside a scale-up domain); -1 fills")
    fsdp: bool = _field(False, doc="shard params, grads and optimizer state over data")
    scale_up_domain: int = _field(0, ge=0, doc="devices per NVLink domain; 0: auto")
    allow_cross_domain: bool = _field(False, doc="allow expert x tensor blocks that straddle domains")
    across_domains: str = _field(
        "fsdp",
        choices=ACROSS_DOMAINS,
        doc="fsdp: data parallelism is one axis, which may span domains; zero1: data splits into replica "
        "(across domains: weights gathered and gradients reduced once per step, optimizer state sharded "
        "over every device) x data (inside one domain)",
    )
    gather_once: bool = _field(
        False,
        doc="under across_domains=zero1: the compute copy of every weight that is not an expert's is "
        "gathered whole inside the domain once per step (no per-layer gathers in the micro-batch loop; "
        "more memory); gradients still reduce-scatter to the in-domain shards",
    )
    reduce_per_layer: bool = _field(
        False,
        doc="under across_domains=zero1: the cross-domain gradient reduce-scatter of each layer-stack weight "
        "runs inside the last micro-batch's backward pass, layer by layer as its gradient is complete (under "
        "the remaining layers' compute), not after the micro-batch loop; the bytes are the same",
    )
    sum_per_layer: bool = _field(
        False,
        doc="under across_domains=zero1: each micro-batch's gradient of a layer-stack weight is added to its "
        "float32 sum inside the backward layer loop, layer by layer, not written to a per-micro-batch "
        "gradient stack first (one compute-dtype copy of the layer stacks less; the same sums)",
    )
    rules: dict = _field(
        DEFAULT_RULES,
        doc="logical axis -> list of mesh axes ('fsdp' = data when mesh.fsdp); rules not given keep their defaults",
    )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the loop."""

    steps: int = _field(300, gt=0, doc="training steps in all (a resumed run continues to this)")
    batch_size: int = _field(16, gt=0, doc="global sequences per step")
    seq_len: int = _field(128, gt=0, doc="tokens per sequence")
    seed: int = _field(0, ge=0, doc="parameter init and data order")
    grad_accum: int = _field(1, gt=0, doc="micro-batches per step")
    lr: float = _field(3e-3, gt=0, doc="peak learning rate (AdamW)")
    schedule: str = _field(
        "cosine", choices=("cosine", "wsd", "constant"), doc="after warmup; wsd: warmup-stable-decay"
    )
    warmup_steps: int = _field(30, ge=0, doc="linear warmup to train.lr")
    min_lr_ratio: float = _field(0.1, ge=0, doc="final learning rate / train.lr")
    decay_fraction: float = _field(0.2, ge=0, doc="wsd: final fraction of steps that decays")
    b1: float = _field(0.9, ge=0, doc="Adam beta1, in [0, 1)")
    b2: float = _field(0.95, ge=0, doc="Adam beta2, in [0, 1)")
    eps: float = _field(1e-8, gt=0, doc="Adam epsilon")
    weight_decay: float = _field(0.1, ge=0, doc="decoupled weight decay (AdamW)")
    clip_norm: float = _field(1.0, ge=0, doc="0: no clipping")
    loss_chunk: int = _field(
        16384,
        ge=0,
        doc="cross-entropy over blocks of this many vocabulary columns, logits never whole; 0: whole [B, T, V]",
    )
    log_every: int = _field(10, gt=0, doc="steps between metric lines")
    eval_every: int = _field(100, gt=0, doc="steps between evaluations (and one at the end)")
    eval_batches: int = _field(4, gt=0, doc="global batches of held-out data per evaluation")
    max_bad_steps: int = _field(5, gt=0, doc="consecutive non-finite steps before stopping")
    pipeline_residuals: str = _field(
        "vjp",
        choices=PIPELINE_RESIDUALS,
        doc="pipeline: keep each chunk's backward residuals (vjp) or its input only and re-run it (recompute)",
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: str = _field(
        "auto",
        choices=("auto", "stdlib", "synthetic", "shards"),
        doc="auto: shards when data.path or data.mixture is given, else stdlib; stdlib: the Python standard "
        "library as bytes; synthetic: random tokens; shards: data.path or data.mixture",
    )
    path: str = _field(
        "",
        doc="a token folder (`python -m maxmoe.data prepare`), or text to tokenise once into data.cache_dir: "
        "a .txt/.jsonl/.jsonl.gz/.parquet file, a glob, or a folder of them",
    )
    mixture: dict = _field(
        {}, doc="shards: several folders and their weights, {folder: weight, ...}, instead of data.path"
    )
    tokenizer: str = _field("byte", doc="data.path text: 'byte' or a Hugging Face tokenizer.json")
    text_key: str = _field("text", doc="data.path text: the field of .jsonl records and .parquet rows")
    cache_dir: str = _field("", doc="token cache of the stdlib corpus and of data.path text; empty: ~/.cache/maxmoe")
    eval_fraction: float = _field(0.05, gt=0, doc="stdlib and data.path text: share of tokens held out for eval")

    @property
    def kind(self) -> str:
        """The source in effect: data.source, with auto resolved (shards when a path or mixture is given)."""
        return source_in_effect(self.source, self.path, self.mixture)


def source_in_effect(source: str, path: Any, mixture: Any) -> str:
    """data.source with `auto` resolved: shards when a path or mixture is given, else stdlib (also
    for a stored config's values, which resume compares as the data they read)."""
    if source != "auto":
        return source
    return "shards" if path or mixture else "stdlib"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing."""

    # Saves are asynchronous (the step waits only for the device-to-host copy), so a save
    # every 100 steps costs little even for short runs, and a killed run loses at most 100.
    every: int = _field(100, ge=0, doc="steps between checkpoints (and one at the end); 0: only at the end")
    keep: int = _field(3, gt=0, doc="newest checkpoints kept")
    keep_every: int = _field(0, ge=0, doc="also keep every N-th step; 0: off")
    resume: bool = _field(True, doc="continue from the latest checkpoint in run.dir; false: refuse a non-empty run.dir")
    init_from: str = _field("", doc="initialise parameters only from this checkpoint")
    allow_config_change: bool = _field(
        False, doc="resume although the model, its numerics, the optimizer or the data order changed"
    )
    async_save: bool = _field(True, doc="write checkpoints in the background")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where output goes and how the process runs."""

    dir: str = _field(
        "runs/default",
        doc="metrics, resolved config, XLA flags and checkpoints go here; unset: runs/<stem of the --config "
        "file> (files merged: stems joined by '+'; a file named config.yaml: its folder's name)",
    )
    cpu_devices: int = _field(0, ge=0, doc="on a CPU host: N host devices; 0: leave as is")
    tensorboard: bool = _field(False, doc="also write TensorBoard events (needs tensorboardX)")
    peak_tflops: float = _field(0.0, ge=0, doc="per-device peak for MFU; 0: from the device kind")
    profile_steps: list = _field([], doc="[first, last] steps to trace with jax.profiler")
    progress: str = _field(
        "auto",
        choices=("auto", "bar", "plain", "none"),
        doc="console: a live bar on a terminal (auto) or plain lines; none: quiet (notebooks)",
    )


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """XLA flag profiles (maxmoe.xla_flags)."""

    profile: str = _field(
        "auto", choices=("auto", "none") + XLA_PROFILES, doc="XLA GPU flag profile; auto: from the device kind"
    )
    extra_flags: list = _field([], doc="more XLA flags, e.g. ['--xla_gpu_enable_command_buffer=']")
    memory_fraction: float = _field(
        0.95,
        ge=0,
        doc="XLA_PYTHON_CLIENT_MEM_FRACTION: share of GPU memory JAX may use (its own default, 0.75, "
        "refuses plans the dry run fits); 0: JAX's default; the environment variable wins",
    )


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """Multi-process runtime (jax.distributed)."""

    mode: str = _field(
        "auto",
        choices=("auto", "none", "explicit"),
        doc="auto: detect SLURM/OpenMPI/Kubernetes, or explicit when dist.coordinator_address is given",
    )
    coordinator_address: str = _field("", doc="host:port of process 0; needs num_processes and process_id")
    num_processes: int = _field(0, ge=0, doc="explicit: number of processes")
    process_id: int = _field(-1, ge=-1, doc="explicit: this process' index")
    timeout_s: int = _field(300, gt=0, doc="seconds to wait for every process to connect")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole resolved configuration."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    xla: XlaConfig = dataclasses.field(default_factory=XlaConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)

    def replace(self, **sections) -> Config:
        """A validated copy with sections replaced: by section objects or by dicts of changed keys.

            config.replace(train={"steps": 50}, mesh=dataclasses.replace(config.mesh, data=2))

        Values are type-checked and cross-checked as `load_config` checks them (ConfigError).
        """
        raw = self.to_dict()
        for section, value in sections.items():
            if section not in _SECTION_CLASSES:
                raise _unknown(section, list(_SECTION_CLASSES))
            if isinstance(value, _SECTION_CLASSES[section]):
                raw[section] = dataclasses.asdict(value)
            elif isinstance(value, dict):
                _merge_section(section, raw[section], value, "replace")
            else:
                raise ConfigError(
                    f"replace({section}=...): expected a {_SECTION_CLASSES[section].__name__} or a dict of its keys"
                )
        return build_config(raw)

    def override(self, *overrides: str) -> Config:
        """A validated copy with `section.key=value` overrides applied, as on the command line."""
        raw = self.to_dict()
        _apply_overrides(raw, overrides)
        return build_config(raw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


_SECTION_CLASSES = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)]


def _type_name(kind: type, meta: dict) -> str:
    """How a key's values are written: its choices, or its type (with its limits)."""
    if meta.get("choices"):
        return "|".join(map(str, meta["choices"]))
    name = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping"}[kind]
    limits = [
        f">= {meta['ge']}" if meta.get("ge") is not None else "",
        f"> {meta['gt']}" if meta.get("gt") is not None else "",
    ]
    name += "".join(f" {limit}" for limit in limits if limit)
    return f"{name} or auto" if meta.get("auto") else name


def describe_keys() -> str:
    """Every config key with its type, default and doc, section by section (the text of --help)."""
    lines = []
    for section, cls in _SECTION_CLASSES.items():
        lines.append(f"{section}: {(cls.__doc__ or '').strip()}")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = typing.get_origin(hints[f.name]) or hints[f.name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
            lines.append(f"  {section}.{f.name}: {_type_name(kind, f.metadata)} = {shown}")
            if f.metadata.get("doc"):
                lines.append(f"      {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines)


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.4)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value: Any, kind: type, meta: dict) -> Any:
    """Check one value against its declared type and limits; return it in that type."""
    if meta.get("auto") and value == "auto":
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r}: expected an integer{' or auto' if meta.get('auto') else ''}")
        if not -(2**63) <= value < 2**63:  # past int64 nothing downstream (numpy, jax, C) can hold it
            raise ConfigError(f"{key}={value}: out of range (a 64-bit integer)")
    elif kind is float:
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-9 (no dot) as a string
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r}: expected a finite number")
    elif kind is str:
        if value is None:
            value = ""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
    elif kind is list:
        if value is None:
            value = []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list like [a, b]")
        value = list(value)
    elif kind is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping like {{a: [b]}}")
    choices, ge, gt = meta.get("choices"), meta.get("ge"), meta.get("gt")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(map(str, choices))}")
    if ge is not None and value < ge:
        raise ConfigError(f"{key}={value!r}: must be >= {ge}")
    if gt is not None and value <= gt:
        raise ConfigError(f"{key}={value!r}: must be > {gt}")
    return value


def _merge_section(section: str, current: dict, updates: Any, source: str) -> None:
    if not isinstance(updates, dict):
        raise ConfigError(f"{source}: section '{section}' must be a mapping of keys to values")
    cls = _SECTION_CLASSES[section]
    names = {f.name for f in dataclasses.fields(cls)}
    for name, value in updates.items():
        if name not in names:
            raise _unknown(f"{section}.{name}", _all_keys())
        current[name] = value


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def load_config(
    files: str | Path | list | tuple = (), overrides: list[str] | tuple[str, ...] | dict[str, Any] = ()
) -> Config:
    """Merge YAML `files` in order over the defaults, apply overrides, validate.

    `files` is one path or a list of them (None: none); `overrides` a list of `section.key=value`
    strings (values read as YAML, as on the command line; one string is one override) or a
    dict {"section.key": value}.
    """
    raw: dict[str, dict] = {s: {} for s in _SECTION_CLASSES}
    files = _config_paths(files)
    for path in files:
        text = read_named_file(path, "config file", error=ConfigError)
        try:
            doc = yaml.safe_load(text.decode("utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" (line {line + 1})" if line is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML") from None
        except RecursionError:  # the YAML composer recurses once per level of nesting
            raise ConfigError(f"{path}: not valid YAML (nested too deeply)") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping of sections")
        for section, updates in doc.items():
            if section not in raw:
                raise _unknown(str(section), list(_SECTION_CLASSES))
            _merge_section(section, raw[section], updates, path)
    _apply_overrides(raw, overrides)
    if files and "dir" not in raw["run"]:
        raw["run"]["dir"] = default_run_dir(files)
    return build_config(raw)


def default_run_dir(files: list) -> str:
    """run.dir when no file or override sets it: runs/<config file stem>, one folder per config.

    Several files give their stems joined by '+'; a file named config.yaml (what `convert
    from-hf` writes) is named by its folder.
    """
    names = [Path(f).parent.name or "config" if Path(f).stem == "config" else Path(f).stem for f in files]
    return "runs/" + "+".join(names)


def _config_paths(files: Any) -> list:
    """`load_config`'s files as a list of paths: None is none, one path is a list of one."""
    if files is None:
        return []
    if isinstance(files, (str, os.PathLike)):
        return [files]
    if isinstance(files, (list, tuple)) and all(isinstance(f, (str, os.PathLike)) for f in files):
        return list(files)
    raise ConfigError(f"config files {files!r}: expected a path or a list of paths")


def _apply_overrides(raw: dict[str, dict], overrides: Any) -> None:
    """Merge `section.key=value` strings (or a {"section.key": value} dict) into `raw`.

    None is no overrides; one string is one override.
    """
    if overrides is None:
        overrides = ()
    elif isinstance(overrides, str):
        overrides = (overrides,)
    elif not isinstance(overrides, (list, tuple, dict)):
        raise ConfigError(f"overrides {overrides!r}: expected a list of 'section.key=value' strings or a dict")
    if isinstance(overrides, dict):
        pairs = [(str(key), value) for key, value in overrides.items()]
    else:
        pairs = []
        for item in overrides:
            if not isinstance(item, str) or "=" not in item:
                raise ConfigError(f"override {item!r} is not of the form section.key=value")
            key, text = item.split("=", 1)
            pairs.append((key, _parse_scalar(text)))
    for key, value in pairs:
        key = key.strip()
        if "." not in key:
            raise _unknown(key, _all_keys())
        section, name = key.split(".", 1)
        if section not in raw:
            raise _unknown(key, _all_keys())
        if section == "mesh" and name.startswith("rules."):
            # mesh.rules.<logical>=[axes] changes one rule and keeps the others.
            name, value = "rules", {**raw["mesh"].get("rules", {}), name[len("rules.") :]: value}
        _merge_section(section, raw[section], {name: value}, "override")


def _build_section(section: str, values: dict) -> Any:
    """One section's dataclass from a dict of its keys, each type-checked."""
    cls = _SECTION_CLASSES[section]
    hints = typing.get_type_hints(cls)
    values = dict(values)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise _unknown(f"{section}.{name}", _all_keys())
    for name, value in list(values.items()):
        kind = typing.get_origin(hints[name]) or hints[name]
        values[name] = _coerce(f"{section}.{name}", value, kind, known[name].metadata)
    return cls(**values)


def build_config(raw: dict[str, dict]) -> Config:
    """Type-check a nested dict of sections and build a validated Config."""
    for section in raw:
        if section not in _SECTION_CLASSES:
            raise _unknown(str(section), list(_SECTION_CLASSES))
    config = Config(**{section: _build_section(section, raw.get(section, {})) for section in _SECTION_CLASSES})
    validate(config)
    return config


def build_model_config(values: dict) -> ModelConfig:
    """A validated ModelConfig from the model keys alone (a converted or saved model)."""
    model = _build_section("model", values)
    validate_model(model)
    return model


def validate_model(m: ModelConfig) -> None:
    """Checks among the model's own keys."""
    if m.first_k_dense > m.num_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} exceeds model.num_layers={m.num_layers}")
    if m.experts_per_token > m.num_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} exceeds model.num_experts={m.num_experts}")
    if m.num_experts % m.num_expert_groups:
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by model.num_expert_groups={m.num_expert_groups}"
        )
    if m.topk_groups > m.num_expert_groups:
        raise ConfigError(f"model.topk_groups={m.topk_groups} exceeds model.num_expert_groups={m.num_expert_groups}")
    per_group = m.num_experts // m.num_expert_groups
    if m.num_expert_groups > 1 and per_group < 2 and m.score_func == "sigmoid":
        raise ConfigError(
            f"group-limited routing needs >= 2 experts per group (group score = top-2 sum); "
            f"got {per_group} with model.num_expert_groups={m.num_expert_groups}"
        )
    if m.topk_groups * per_group < m.experts_per_token:
        raise ConfigError(
            f"model.topk_groups={m.topk_groups} groups of {per_group} experts cannot supply "
            f"model.experts_per_token={m.experts_per_token}"
        )
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs)")


def validate(config: Config) -> None:
    """Cross-field checks that need no devices (mesh sizes are checked again in maxmoe.mesh)."""
    m, t, mesh = config.model, config.train, config.mesh
    validate_model(m)
    for axis in SIZED_MESH_AXES:
        size = getattr(mesh, axis)
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: must be a positive size or -1 (fill)")
    if sum(getattr(mesh, a) == -1 for a in SIZED_MESH_AXES) > 1:
        raise ConfigError("only one of mesh.data, mesh.expert, mesh.tensor may be -1")
    for option in TWO_TIER_OPTIONS:
        if getattr(mesh, option) and mesh.across_domains != "zero1":
            raise ConfigError(
                f"mesh.{option}=true applies to the two-tier step: set mesh.across_domains=zero1 "
                f"(got {mesh.across_domains})"
            )
    for logical, axes in mesh.rules.items():
        if logical not in DEFAULT_RULES:
            raise _unknown(f"mesh.rules.{logical}", [f"mesh.rules.{k}" for k in DEFAULT_RULES])
        # Nothing is sharded over `pipeline` but the pipeline's layer stack (maxmoe.parallel.pipeline).
        allowed = tuple(a for a in SIZED_MESH_AXES if a != "pipeline") + ("fsdp",)
        if isinstance(axes, (list, tuple)) and REPLICA_AXIS in axes:
            raise ConfigError(
                f"mesh.rules.{logical}={axes!r}: {REPLICA_AXIS!r} is not for rules; "
                f"the train step adds it under mesh.across_domains=zero1"
            )
        if not isinstance(axes, (list, tuple)) or any(a not in allowed for a in axes):
            raise ConfigError(f"mesh.rules.{logical}={axes!r}: expected a list of {', '.join(allowed)}")
    if m.fp8 != "none" and config.moe.dispatch == "capacity":
        raise ConfigError(
            f"model.fp8={m.fp8} runs the experts' grouped GEMM in FP8; moe.dispatch=capacity has no grouped "
            f"GEMM (use ragged_a2a or allgather)"
        )
    if config.moe.fp8_dispatch and (m.fp8 == "none" or config.moe.dispatch not in ("auto", "ragged_a2a")):
        raise ConfigError(
            f"moe.fp8_dispatch=true needs model.fp8 set and moe.dispatch=ragged_a2a (or auto); "
            f"got model.fp8={m.fp8}, moe.dispatch={config.moe.dispatch}"
        )
    for name in ("b1", "b2"):  # 1.0 divides by 1 - beta**t = 0: every parameter NaN after the first update
        if not getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)}: must be below 1 (Adam's moment decay, in [0, 1))")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    _validate_shards(config.data)
    _check_limits(config)
    if config.xla.memory_fraction > 1:
        raise ConfigError(
            f"xla.memory_fraction={config.xla.memory_fraction}: must be <= 1 (a share of the GPU's memory)"
        )
    ps = config.run.profile_steps
    if ps and (len(ps) != 2 or not all(isinstance(s, int) and s >= 0 for s in ps) or ps[0] > ps[1]):
        raise ConfigError(f"run.profile_steps={ps!r}: expected [first, last] step numbers")
    if ps and ps[1] >= t.steps:  # steps count from 0: a trace that never ends writes nothing
        raise ConfigError(
            f"run.profile_steps={ps!r}: past the run's last step, {t.steps - 1} (train.steps={t.steps}; "
            f"steps count from 0)"
        )
    if m.max_position_embeddings < t.seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}"
        )
    if not config.run.dir.strip():
        raise ConfigError("run.dir is empty; name the folder for checkpoints and metrics (e.g. run.dir=runs/my-run)")
    _check_dist(config.dist)
    check_mesh_fits(config, mesh_sizes(config))


def _validate_pipeline(config: Config, stages: int) -> None:
    """`stages` > 1 needs MoE layers to cut into stages and micro-batches that fill them."""
    m, t = config.model, config.train
    if stages <= 1:
        return
    if config.mesh.across_domains == "zero1":
        # The pipeline keeps its own per-stage gradient sums; the two-tier step does not run through stages.
        raise ConfigError(
            f"mesh.across_domains=zero1 with mesh.pipeline={stages}: the two-tier mode runs without "
            f"pipeline stages (use mesh.across_domains=fsdp or mesh.pipeline=1)"
        )
    if m.num_layers - m.first_k_dense < 1:
        raise ConfigError(
            f"mesh.pipeline={stages} needs MoE layers to place on stages; model.num_layers={m.num_layers} "
            f"are all dense (model.first_k_dense={m.first_k_dense})"
        )
    if t.grad_accum % stages:
        # Fewer micro-batches than stages, or a partial group of them, leaves stages idle.
        raise ConfigError(
            f"train.grad_accum={t.grad_accum} must be a multiple of mesh.pipeline={stages} "
            f"(micro-batches in flight keep every stage busy)"
        )


def _validate_context(config: Config, sizes: dict[str, int]) -> None:
    """mesh.context > 1: zigzag chunks that divide the sequence, the rules that use the axis, and
    what runs without it (maxmoe.parallel.context)."""
    c = sizes.get(CONTEXT_AXIS, 1)
    if c <= 1:
        return
    rules = {**DEFAULT_RULES, **config.mesh.rules}
    if config.train.seq_len % (2 * c):
        raise ConfigError(
            f"train.seq_len={config.train.seq_len} is not divisible by 2 x mesh.context = {2 * c} "
            f"(each device holds two zigzag chunks of every sequence)"
        )
    # maxmoe.mesh.resolve_rules adds `context` to the seq and expert rules; nothing else may use it.
    if [a for a in rules["seq"] if a != CONTEXT_AXIS]:
        raise ConfigError(
            f"mesh.context={c}: the sequence is sharded over context alone; got mesh.rules.seq={list(rules['seq'])}"
        )
    others = [k for k, v in rules.items() if k not in ("seq", "expert") and CONTEXT_AXIS in v]
    if others:
        raise ConfigError(f"mesh.rules.{others[0]}: only seq and expert may use the context axis")
    if sizes["pipeline"] > 1:
        raise ConfigError(
            f"mesh.context={c} with mesh.pipeline={sizes['pipeline']}: pipeline stages do not run with context parallelism"
        )
    if config.model.attention not in ("auto", "chunked"):
        raise ConfigError(
            f"model.attention={config.model.attention} with mesh.context={c}: context parallelism runs its own "
            f"latent attention core (set model.attention=auto or chunked)"
        )


def _validate_shards(data: DataConfig) -> None:
    """data.path or data.mixture (one, not both) for data.source=shards; mixture weights are positive numbers.

    A path or mixture under a source that reads neither is refused, not ignored.
    """
    if data.kind != "shards":
        if data.path or data.mixture:
            given = f"data.path={data.path}" if data.path else "data.mixture"
            raise ConfigError(
                f"{given} is not read with data.source={data.source}; leave data.source out (auto) "
                f"or set data.source=shards to train on it"
            )
        return
    if data.path and data.mixture:
        raise ConfigError("data.path and data.mixture both given; use data.mixture alone for several folders")
    if not data.path and not data.mixture:
        raise ConfigError(
            "data.source=shards needs data.path (a folder made by `python -m maxmoe.data prepare`) "
            "or data.mixture ({folder: weight, ...})"
        )
    for folder, weight in data.mixture.items():
        if not isinstance(folder, str) or not folder:
            raise ConfigError(f"data.mixture: {folder!r} is not a folder path")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.mixture: weight {weight!r} of {folder}: expected a positive number")


# Upper limits of keys whose lower limits are declared with the field; each says why.
MAX_CPU_DEVICES = 4096  # fake host devices: ~0.2 MB and threads each; 1,024-GPU dry runs need 1,024
MAX_TOKEN_ID = 2**31 - 1  # tokens are int32 on the device
MAX_BATCH_TOKENS = 2**31 - 1  # DeepSeek-V3 trained on 15,360 x 4,096 = 63M tokens per step
MAX_SEED = 2**32 - 1  # jax.random.key keeps the low 32 bits: seed 2**32 would repeat seed 0


def _check_limits(config: Config) -> None:
    """Upper limits and cross-key limits that `_field`'s ge/gt cannot say; one ConfigError each."""
    m, t, d = config.model, config.train, config.data
    if m.mtp_num_layers >= t.seq_len:
        # Depth k predicts the token k + 1 ahead: at depth seq_len - 1 or more no position has a target.
        raise ConfigError(
            f"model.mtp_num_layers={m.mtp_num_layers} must be below train.seq_len={t.seq_len} "
            f"(multi-token prediction depth k needs a target k + 1 tokens ahead inside the sequence)"
        )
    if isinstance(m.vocab_size, int) and m.vocab_size > MAX_TOKEN_ID + 1:
        raise ConfigError(f"model.vocab_size={m.vocab_size}: must be <= {MAX_TOKEN_ID + 1} (token ids are int32)")
    if t.batch_size * t.seq_len > MAX_BATCH_TOKENS:
        raise ConfigError(
            f"train.batch_size={t.batch_size} x train.seq_len={t.seq_len} tokens per step: must be <= "
            f"{MAX_BATCH_TOKENS:,} (the step's token batch is indexed in int32)"
        )
    if t.seed > MAX_SEED:
        raise ConfigError(f"train.seed={t.seed}: must be <= {MAX_SEED} (jax keeps 32 bits of a seed)")
    for key, value, what in (
        ("train.decay_fraction", t.decay_fraction, "the share of the steps after warmup that decays"),
        ("train.min_lr_ratio", t.min_lr_ratio, "the final learning rate as a share of train.lr"),
    ):
        if value > 1:
            raise ConfigError(f"{key}={value}: must be <= 1 ({what})")
    if d.eval_fraction >= 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction}: must be below 1 (training needs tokens too)")
    if config.run.cpu_devices > MAX_CPU_DEVICES:
        raise ConfigError(
            f"run.cpu_devices={config.run.cpu_devices}: must be <= {MAX_CPU_DEVICES} "
            f"(each fake device costs host memory and threads)"
        )
    for flag in config.xla.extra_flags:
        if not isinstance(flag, str) or not flag.startswith("--") or len(flag.strip()) < 3 or " " in flag.strip():
            raise ConfigError(f"xla.extra_flags: {flag!r} is not an XLA flag (expected --xla_name=value)")


def _check_coordinator_address(address: str) -> None:
    """host:port, the port a number in 1..65535 ([v6::addr]:port for IPv6)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"dist.coordinator_address={address!r}: expected host:port (e.g. 10.0.0.1:1234)")


def _check_dist(dist: DistConfig) -> None:
    """dist.coordinator_address / num_processes / process_id: all three, under explicit or auto mode.

    Under dist.mode=auto, a coordinator address makes the launch explicit (maxmoe.distributed);
    keys that would be ignored are refused rather than dropped.
    """
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


def mesh_sizes(config: Config) -> dict[str, int]:
    """The configured mesh sizes; -1 stays -1 until devices are known (maxmoe.mesh resolves it).
    `context` is left out when 1 (no context parallelism)."""
    return {a: getattr(config.mesh, a) for a in SIZED_MESH_AXES if a != CONTEXT_AXIS or config.mesh.context != 1}


def check_mesh_fits(config: Config, sizes: dict[str, int]) -> None:
    """Divisibility of the model and batch by the mesh axes; axes of size -1 are skipped."""
    m, t = config.model, config.train
    _validate_pipeline(config, sizes["pipeline"])
    _validate_context(config, sizes)
    tensor, expert, data = sizes["tensor"], sizes["expert"], sizes["data"]
    if tensor > 0:
        if m.num_heads % tensor:
            raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by mesh.tensor={tensor}")
        for name in ("mlp_dim", "moe_mlp_dim", "vocab_size"):
            if (
                isinstance(getattr(m, name), int) and getattr(m, name) % tensor
            ):  # vocab_size=auto: checked once resolved
                raise ConfigError(f"model.{name}={getattr(m, name)} is not divisible by mesh.tensor={tensor}")
    if expert > 0 and m.num_experts % expert:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by mesh.expert={expert}")
    context = sizes.get(CONTEXT_AXIS, 1)
    if expert > 0 and context > 1 and m.num_experts % (context * expert):
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by mesh.context x mesh.expert = {context * expert} "
            f"(experts are sharded over both)"
        )
    if data > 0 and expert > 0:
        shards = data * expert
        micro = t.batch_size // t.grad_accum
        if micro % shards:
            raise ConfigError(
                f"train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum} = {micro} sequences "
                f"per micro-batch is not divisible by mesh.data x mesh.expert = {shards}"
            )
