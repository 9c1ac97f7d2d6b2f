"""mesh: the device mesh's sizes, the logical-to-mesh sharding rules, and what fits on them.

The sizes are checked here without devices (-1 stays -1); maxmoe.parallel.mesh builds the
mesh once devices are known and checks them again with -1 resolved (`check_mesh_fits`).
"""

from __future__ import annotations

import dataclasses

from maxmoe.config.errors import ConfigError
from maxmoe.config.fields import field, unknown
from maxmoe.parallel.names import CONTEXT_AXIS, REPLICA_AXIS, SIZED_MESH_AXES

ACROSS_DOMAINS = ("fsdp", "zero1")  # mesh.across_domains (docs/SHARDING.md, "Two tiers")
ZERO1_TIMINGS = ("per_layer", "per_step")  # mesh.zero1_gather, mesh.zero1_reduce
# Keys of earlier versions: what replaces each (maxmoe.config.loader refuses them with this line).
REMOVED_KEYS = {
    "mesh.gather_once": ("mesh.zero1_gather", {True: "per_step", False: None}),
    "mesh.reduce_per_layer": ("mesh.zero1_reduce", {True: "per_layer", False: None}),
    "mesh.sum_per_layer": (None, {True: None, False: None}),
}


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

    pipeline: int = field(
        1, gt=0, doc="pipeline stages (outermost; may span domains: only activations cross it); 1: no pipeline"
    )
    pipeline_virtual: int = field(
        1, gt=0, doc="pipeline: model chunks per stage (interleaved schedule); ignored without stages"
    )
    pipeline_pad_front: int = field(
        0,
        ge=0,
        doc="pipeline: empty layer slots before the first layer (balances stage 0, which runs the embedding and MTP)",
    )
    data: int = field(1, doc="data-parallel devices (may span domains); -1 fills the remaining devices")
    context: int = field(
        1,
        gt=0,
        doc="context-parallel devices (inside a scale-up domain): attention shards each sequence over them "
        "(zigzag chunks, MLA latents all-gathered) and MoE layers add them to expert parallelism; 1: none",
    )
    expert: int = field(1, doc="expert-parallel devices (inside a scale-up domain); -1 fills")
    tensor: int = field(1, doc="tensor-parallel devices (inside a scale-up domain); -1 fills")
    fsdp: bool = field(False, doc="shard params, grads and optimizer state over data")
    scale_up_domain: int = field(0, ge=0, doc="devices per NVLink domain; 0: auto")
    allow_cross_domain: bool = field(False, doc="allow expert x tensor blocks that straddle domains")
    across_domains: str = field(
        "fsdp",
        choices=ACROSS_DOMAINS,
        doc="fsdp: data parallelism is one axis, which may span domains; zero1: data splits into replica "
        "(across domains: weights gathered and gradients reduced once per step, optimizer state sharded "
        "over every device) x data (inside one domain)",
    )
    zero1_gather: str = field(
        "per_layer",
        choices=ZERO1_TIMINGS,
        doc="under across_domains=zero1, when the compute copy of the weights that are not experts' is gathered "
        "inside the domain: per_layer (where each layer uses it, in every micro-batch) or per_step (whole, once "
        "per step: no gathers in the micro-batch loop, more memory)",
    )
    zero1_reduce: str = field(
        "per_step",
        choices=ZERO1_TIMINGS,
        doc="under across_domains=zero1, when the layer stacks' gradients reduce-scatter across domains: "
        "per_step (after the micro-batch loop) or per_layer (inside the last micro-batch's backward pass, each "
        "layer as its gradient is complete, under the remaining layers' compute); the bytes are the same",
    )
    rules: dict = field(
        DEFAULT_RULES,
        doc="logical axis -> list of mesh axes ('fsdp' = data when mesh.fsdp); rules not given keep their defaults",
    )


def check_mesh(config) -> None:
    """The configured sizes, the rules, the ZeRO-1 timings, and what must divide them."""
    mesh = config.mesh
    for axis in SIZED_MESH_AXES:
        size = getattr(mesh, axis)
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: must be a positive size or -1 (fill)")
    if sum(getattr(mesh, a) == -1 for a in SIZED_MESH_AXES) > 1:
        raise ConfigError("only one of mesh.data, mesh.expert, mesh.tensor may be -1")
    defaults = MeshConfig()
    for option in ("zero1_gather", "zero1_reduce"):
        if getattr(mesh, option) != getattr(defaults, option) and mesh.across_domains != "zero1":
            raise ConfigError(
                f"mesh.{option}={getattr(mesh, option)} times the two-tier step: set mesh.across_domains=zero1 "
                f"or leave mesh.{option} out (got mesh.across_domains={mesh.across_domains})"
            )
    for logical, axes in mesh.rules.items():
        if logical not in DEFAULT_RULES:
            raise unknown(f"mesh.rules.{logical}", [f"mesh.rules.{k}" for k in DEFAULT_RULES])
        # Nothing is sharded over `pipeline` but the pipeline's layer stack (maxmoe.parallel.pipeline).
        allowed = tuple(a for a in SIZED_MESH_AXES if a != "pipeline") + ("fsdp",)
        if isinstance(axes, (list, tuple)) and REPLICA_AXIS in axes:
            raise ConfigError(
                f"mesh.rules.{logical}={axes!r}: {REPLICA_AXIS!r} is not for rules; "
                f"the train step adds it under mesh.across_domains=zero1"
            )
        if not isinstance(axes, (list, tuple)) or any(a not in allowed for a in axes):
            raise ConfigError(f"mesh.rules.{logical}={axes!r}: expected a list of {', '.join(allowed)}")
    check_mesh_fits(config, mesh_sizes(config))


def mesh_sizes(config) -> dict[str, int]:
    """The configured mesh sizes; -1 stays -1 until devices are known (maxmoe.parallel.mesh resolves it).
    `context` is left out when 1 (no context parallelism)."""
    return {a: getattr(config.mesh, a) for a in SIZED_MESH_AXES if a != CONTEXT_AXIS or config.mesh.context != 1}


def check_mesh_fits(config, sizes: dict[str, int]) -> None:
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


def _validate_pipeline(config, stages: int) -> None:
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


def _validate_context(config, sizes: dict[str, int]) -> None:
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
    # maxmoe.parallel.mesh.resolve_rules adds `context` to the seq and expert rules; nothing else may use it.
    if [a for a in rules["seq"] if a != CONTEXT_AXIS]:
        raise ConfigError(
            f"mesh.context={c}: the sequence is sharded over context alone; got mesh.rules.seq={list(rules['seq'])}"
        )
    others = [k for k, v in rules.items() if k not in ("seq", "expert") and CONTEXT_AXIS in v]
    if others:
        raise ConfigError(f"mesh.rules.{others[0]}: only seq and expert may use the context axis")
    if sizes["pipeline"] > 1:
        raise ConfigError(
            f"mesh.context={c} with mesh.pipeline={sizes['pipeline']}: pipeline stages do not run with context "
            f"parallelism (set mesh.context=1 or mesh.pipeline=1)"
        )
    if config.model.attention not in ("auto", "chunked"):
        raise ConfigError(
            f"model.attention={config.model.attention} with mesh.context={c}: context parallelism runs its own "
            f"latent attention core (set model.attention=auto or chunked)"
        )
