"""Devices -> a named ([pipeline,] [replica,] data, expert, tensor) mesh over scale-up domains; logical->mesh rules.

A scale-up domain is a set of devices on one fast fabric (an NVLink rack such as a GB300
NVL72: 72 GPUs; an HGX H100/H200 node: 8). The MoE all-to-all (`expert`) and the
tensor-parallel reductions (`tensor`) are the chatty collectives, so the builder keeps both
inside one domain: devices are ordered by (domain, process, local id), `tensor` is the
innermost (fastest varying) axis, `expert` next, and `data` spanning domains. Pipeline
stages (`pipeline`, outermost, present when mesh.pipeline > 1) are blocks of whole
(data, expert, tensor) meshes: only activations between neighbouring stages and the
end-of-step reductions cross them. Only gradient reductions (and FSDP gathers) cross domains.

Under `mesh.across_domains=zero1` data parallelism has two tiers: `replica` (outermost,
across domains) x `data` (inside one domain), `data` being the largest part of mesh.data
that fits a domain beside expert x tensor. Rules never name `replica`: the train step
adds it (maxmoe.parallel.replicas), and master weights and optimizer state take it on as
the minor factor of their ZeRO-1 sharding (`zero1_spec`). With one replica (everything in
one domain) the mesh and the programs are those of `fsdp`.

Logical axis rules are data (`mesh.rules`, docs/SHARDING.md): each logical axis maps to a
list of mesh axes; the virtual axis `fsdp` means `data` when `mesh.fsdp` is on and nothing
otherwise. When a tensor names two logical axes that map to the same mesh axis, the first
dimension (left to right) takes it and later ones drop it, so activations
[batch, seq, embed] shard batch over (data, expert) while weights [embed, ...] shard embed
over data under FSDP.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxmoe.config import (
    DEFAULT_RULES,
    MESH_AXES,
    OPTIONAL_MESH_AXES,
    REPLICA_AXIS,
    Config,
    ConfigError,
    check_mesh_fits,
    mesh_sizes,
)
from maxmoe.parallel.attention_kernels import kernel, sharded_attention
from maxmoe.parallel.dispatch import EXPERT_WEIGHT_AXES, make_dispatch_plan
from maxmoe.parallel.fp8_dense import sharded_fp8_projection
from maxmoe.parallel.fp8_matmul import blockwise_kernels, fp8_matmul
from maxmoe.parallel.kernel_choice import resolve_kernels
from maxmoe.parallel.replicas import axes_of, context_sharding


def resolve_shape(config: Config, num_devices: int) -> dict[str, int]:
    """Mesh sizes for `num_devices`, filling the one -1 axis; checks the product and divisibility."""
    sizes = mesh_sizes(config)
    fixed = math.prod(s for s in sizes.values() if s != -1)
    fill = [a for a, s in sizes.items() if s == -1]
    if fill:
        if num_devices % fixed:
            raise ConfigError(
                f"cannot fill mesh.{fill[0]}: {num_devices} devices are not divisible by "
                f"the other axes' product {fixed}"
            )
        sizes[fill[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if a != "pipeline" or s > 1)
        raise ConfigError(
            f"mesh {shape} = {math.prod(sizes.values())} devices, but {num_devices} are available "
            f"(set one axis to -1 to fill)"
        )
    check_mesh_fits(config, sizes)
    return sizes


def device_domains(devices: Sequence[Any], scale_up_domain: int) -> list[int]:
    """The scale-up domain index of each device.

    With `scale_up_domain` = 0: the platform's slice index where it reports one, else one
    domain per process (a node). With N > 0: consecutive blocks of N devices in
    (process, id) order.
    """
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    rank = {d.id: i for i, d in enumerate(ordered)}
    if scale_up_domain > 0:
        return [rank[d.id] // scale_up_domain for d in devices]
    slices = [getattr(d, "slice_index", None) for d in devices]
    if all(s is not None for s in slices) and len(set(slices)) > 1:
        return [int(s) for s in slices]
    return [d.process_index for d in devices]


def mesh_axes(sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh's axis names: `pipeline` and `replica` only when larger than 1, so a run without
    stages or cross-domain replicas compiles the program it always did."""
    return tuple(a for a in MESH_AXES if a not in OPTIONAL_MESH_AXES or sizes.get(a, 1) > 1)


def split_replicas(config: Config, sizes: dict[str, int], domain_size: int) -> dict[str, int]:
    """Sizes of every mesh axis (MESH_AXES order) for configured `sizes` and domains of `domain_size` devices.

    `fsdp`: replica = 1. `zero1`: data = the largest divisor of mesh.data that fits a domain
    beside expert x tensor (gcd(data, domain / (expert x tensor))), replica = the rest.
    """
    shape = {REPLICA_AXIS: 1, **sizes}
    block = sizes["expert"] * sizes["tensor"]
    if config.mesh.across_domains == "zero1" and domain_size % block == 0:
        inside = math.gcd(sizes["data"], domain_size // block)
        shape[REPLICA_AXIS], shape["data"] = sizes["data"] // inside, inside
    return {a: shape[a] for a in MESH_AXES}


def build_mesh(config: Config, devices: Sequence[Any] | None = None) -> Mesh:
    """The ([pipeline,] [replica,] data, expert, tensor) mesh with expert x tensor groups (and replicas)
    inside scale-up domains."""
    devices = list(devices if devices is not None else jax.devices())
    domains = device_domains(devices, config.mesh.scale_up_domain)
    counts = sorted({domains.count(x) for x in set(domains)})
    sizes = split_replicas(config, resolve_shape(config, len(devices)), counts[0])
    order = sorted(range(len(devices)), key=lambda i: (domains[i], devices[i].process_index, devices[i].id))
    ordered = [devices[i] for i in order]
    axes = mesh_axes(sizes)
    grid = np.array(ordered, dtype=object).reshape([sizes[a] for a in axes])
    domain_of = {d.id: domains[i] for i, d in enumerate(devices)}

    def straddles(block_size: int) -> bool:
        """Whether any block of `block_size` consecutive devices (one per leading index) spans domains."""
        return any(len({domain_of[d.id] for d in block}) > 1 for block in grid.reshape(-1, block_size))

    block = sizes["expert"] * sizes["tensor"]
    message = None
    if straddles(block):  # each row: one expert x tensor block (of one stage, replica and data index)
        message = (
            f"mesh.expert x mesh.tensor = {block} devices do not fit inside one "
            f"scale-up domain (domains of {counts} devices); expert and tensor traffic would cross the slow network"
        )
    elif sizes[REPLICA_AXIS] > 1 and straddles(sizes["data"] * block):
        message = (
            f"mesh.across_domains=zero1: replicas of data x expert x tensor = "
            f"{sizes['data'] * block} devices straddle scale-up domains of {counts} "
            f"devices; in-domain FSDP traffic would cross the slow network"
        )
    if message:
        if not config.mesh.allow_cross_domain:
            raise ConfigError(message + " (set mesh.allow_cross_domain=true to build it anyway)")
        warnings.warn(message, stacklevel=2)
    return Mesh(grid, axes)


def zero1_spec(
    spec: PartitionSpec, shape: Sequence[int], mesh_shape: dict[str, int], over: Sequence[str] | None = None
) -> PartitionSpec:
    """Where master weights and optimizer state live under ZeRO-1: the compute `spec` sharded further.

    `over`: the axes to add, in order; default (mesh.across_domains=zero1): the in-domain axes
    `spec` leaves unused (e.g. `expert` for dense weights), then `replica`. Each goes to the
    first dimension whose size it still divides, as the minor factor of that dimension. So
    every device's ZeRO-1 block lies inside its compute block: ZeRO-1 -> compute is an
    all-gather over the added axis (then in-domain ones), and the gradient reduction a
    reduce-scatter over it alone (a major factor would need an all-to-all). With pipeline
    stages the parameters outside the layer stack, which every stage computes with, add
    `pipeline` (maxmoe.training.programs). An axis no dimension fits leaves the leaf
    replicated over it.
    """
    entries = [axes_of(e) for e in tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))]
    if over is None:
        used = {a for e in entries for a in e}
        over = [a for a in MESH_AXES if a != REPLICA_AXIS and a not in used] + [REPLICA_AXIS]
    for axis in (a for a in over if mesh_shape.get(a, 1) > 1):
        for dim, axes in enumerate(entries):
            if shape[dim] % (math.prod(mesh_shape[a] for a in axes) * mesh_shape[axis]) == 0:
                entries[dim] = (*axes, axis)
                break
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in entries])


def resolve_rules(config: Config) -> dict[str, tuple[str, ...]]:
    """Logical axis -> mesh axes, with `fsdp` replaced by data (on) or dropped (off)."""
    rules = {}
    for logical, axes in {**DEFAULT_RULES, **config.mesh.rules}.items():
        resolved = []
        for axis in axes:
            if axis == "fsdp":
                axis = "data" if config.mesh.fsdp else None
            if axis and axis not in resolved:
                resolved.append(axis)
        rules[logical] = tuple(resolved)
    return rules


def logical_to_spec(
    logical_axes: Sequence[str | None], rules: dict[str, tuple[str, ...]], mesh_shape: dict[str, int] | None = None
) -> PartitionSpec:
    """PartitionSpec for logical axes; a mesh axis goes to the first dimension that asks for it.

    Axes of size 1 are left out, so specs stay readable.
    """
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        axes = [
            a
            for a in rules.get(name, ())
            if name is not None and a not in used and (mesh_shape is None or mesh_shape.get(a, 1) > 1)
        ]
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def indivisible(
    name: str, logical_axes: Sequence[str | None], shape: Sequence[int], rules: dict, mesh_shape: dict[str, int]
) -> str | None:
    """Why the mesh cannot split array `name` of `shape` as its logical axes' rules ask, or None.

    One line naming the array, the dimension, its size, the rule and the split, e.g.
    `params/embed/embedding [260, 64]: dimension 0 (vocab) of size 260 cannot be split 8 ways
    by mesh.rules.vocab -> data=8`. The spec is the one `logical_to_spec` builds, so whatever
    rules, FSDP or mesh axes are in play, this is the split jax would be asked for.
    """
    spec = logical_to_spec(logical_axes, rules, mesh_shape)
    for dim, (logical, axes) in enumerate(zip(logical_axes, spec)):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        ways = math.prod(mesh_shape[a] for a in axes)
        if shape[dim] % ways:
            split = " x ".join(f"{a}={mesh_shape[a]}" for a in axes)
            return (
                f"{name} {list(shape)}: dimension {dim} ({logical}) of size {shape[dim]} cannot be split "
                f"{ways} ways by mesh.rules.{logical} -> {split}; change that rule or the mesh"
            )
    return None


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def check_divisible(boxed_tree: Any, rules: dict, mesh_shape: dict[str, int]) -> None:
    """ConfigError naming the first array of a logically-boxed tree that the mesh cannot split as ruled."""
    specs = nn.get_partition_spec(boxed_tree)
    is_spec = lambda x: isinstance(x, PartitionSpec) or x is None  # noqa: E731
    named_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    for (path, spec), leaf in zip(named_specs, jax.tree.leaves(nn.unbox(boxed_tree)), strict=True):
        if spec:
            why = indivisible(_path_name(path), tuple(spec), leaf.shape, rules, mesh_shape)
            if why:
                raise ConfigError(why)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A mesh with its rules: what the model and the train step use to place arrays.

    The model calls `constrain(x, logical_axes)`, reads `dispatch_plan` and the kernel
    choices, and runs attention kernels through `attention`; it never names a mesh axis.

    Attributes:
        mesh, rules: the device mesh and the logical -> mesh axis rules.
        dispatch_plan: expert parallelism on a mesh of more than one device, else None.
        platform: the platform programs are built for ("cpu", "cuda", ...).
        grouped_matmul, attention: the implementations `auto` resolved to
            (maxmoe.parallel.kernel_choice.Choice: name and reason).
    """

    mesh: Mesh
    rules: dict
    dispatch_plan: Any = None
    platform: str = "cpu"
    grouped_matmul: Any = None
    attention: Any = None

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def replicas(self) -> int:
        """Size of the cross-domain `replica` axis (1 unless mesh.across_domains=zero1 splits data)."""
        return self.shape.get(REPLICA_AXIS, 1)

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        return logical_to_spec(logical_axes, self.rules, self.shape)

    def sharding(self, logical_axes: Sequence[str | None]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes))

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        if self.mesh.size == 1:
            return x
        # Inside the two-tier step's per-replica shard_map the constraint goes on the context mesh.
        return jax.lax.with_sharding_constraint(x, context_sharding(self.mesh, self.spec(logical_axes)))

    def lookup_table(self, table: jax.Array) -> jax.Array:
        """A table about to be indexed by token ids (the embedding): whole on every device of a replica.

        Inside the per-replica shard_map XLA's SPMD partitioner aborts on a gather from a
        table sharded over the in-domain axes (jax 0.10-0.12); gathering the table first
        avoids it. Outside the two-tier mode the table stays as the rules shard it.
        """
        return self.constrain(table, (None,) * table.ndim) if self.replicas > 1 else table

    def attention_fn(self, name: str):
        """fn(q, k, v, scale) for attention kernel `name` [batch, seq, heads, head_dim], placed on the mesh."""
        interpret = self.platform != "cuda"  # Pallas kernels run in interpret mode off the GPU
        if self.mesh.size == 1:
            return lambda q, k, v, scale: kernel(name)(q, k, v, scale, interpret=interpret)
        return sharded_attention(name, self.mesh, self.spec(("batch", "seq", "heads", "head_dim")), interpret=interpret)

    def fp8_projection(self, recipe: str, x_axes: Sequence[str | None], w_axes: Sequence[str | None], contract: int):
        """fn(x [..., K], w [K, N]) running an FP8 projection's GEMMs through maxmoe's kernels on
        each device's shards (maxmoe.parallel.fp8_dense), or None where XLA's program runs them:
        a recipe other than blockwise, no kernel grouped backend (a GPU's, or the dry run's
        stand-in: the same switch as the experts'),
        or a contraction / output merged from dims whose minor ones the rules shard.

        x_axes, w_axes: the logical axes of x [..., K...] and w [K..., N...] before the caller
        merges their `contract` contraction dims (and w's output dims) into one.
        """
        if recipe != "blockwise":
            return None
        kernels = blockwise_kernels(self.grouped_matmul.name if self.grouped_matmul is not None else "")
        if not kernels:
            return None
        if self.mesh.size == 1:
            return lambda x, w: fp8_matmul(x, w, recipe, kernels)
        x_spec = tuple(self.spec(x_axes)) + (None,) * len(x_axes)
        w_spec = tuple(self.spec(w_axes)) + (None,) * len(w_axes)
        lead = len(x_axes) - contract
        if any(x_spec[lead + 1 : len(x_axes)]) or any(w_spec[1:contract]) or any(w_spec[contract + 1 : len(w_axes)]):
            return None
        n_entry = w_spec[contract] if len(w_axes) > contract else None
        x_2d, w_2d = PartitionSpec(*x_spec[: lead + 1]), PartitionSpec(w_spec[0], n_entry)
        return sharded_fp8_projection(self.mesh, x_2d, w_2d, recipe, kernels)

    @property
    def stages(self) -> int:
        """Pipeline stages (the `pipeline` axis; 1 without one)."""
        return self.shape.get("pipeline", 1)

    def on_context_mesh(self) -> Layout:
        """This layout rebound to the mesh jax traces under (inside the pipeline's shard_map,
        where `pipeline` is manual: a concrete Mesh is refused there, in shardings and in the
        dispatch's shard_map alike)."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return self
        plan = self.dispatch_plan
        plan = None if plan is None else dataclasses.replace(plan, mesh=mesh)
        return dataclasses.replace(self, mesh=mesh, dispatch_plan=plan)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def check_array(self, name: str, logical_axes: Sequence[str | None], shape: Sequence[int]) -> None:
        """ConfigError (one line) when the mesh cannot split an array of `shape` as the rules ask."""
        why = indivisible(name, logical_axes, shape, self.rules, self.shape)
        if why:
            raise ConfigError(why)

    def batch_sharding(self) -> NamedSharding:
        """Token batches [B, T + 1]: rows over `batch`'s mesh axes, replica-major before them."""
        rows = axes_of(self.spec(("batch",))[0])
        if self.replicas > 1:
            rows = (REPLICA_AXIS, *rows)
        return NamedSharding(self.mesh, PartitionSpec(rows or None, None))

    def zero1_shardings(self, boxed_tree, over: Sequence[str] | None = None) -> Any:
        """ZeRO-1 NamedShardings (`zero1_spec`, adding the axes `over`) for a tree of flax-boxed variables."""
        logical = nn.get_partition_spec(boxed_tree)
        shapes = nn.unbox(boxed_tree)
        return jax.tree.map(
            lambda spec, leaf: NamedSharding(
                self.mesh,
                zero1_spec(self.spec(tuple(spec) if spec is not None else ()), leaf.shape, self.shape, over),
            ),
            logical,
            shapes,
            is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
        )

    def tree_shardings(self, boxed_tree) -> Any:
        """NamedShardings for a tree of flax-boxed variables (unboxed leaves are replicated).

        Every array is checked first (`check_divisible`): a rule that splits a dimension the
        mesh does not divide is a one-line ConfigError here, before anything compiles.
        """
        check_divisible(boxed_tree, self.rules, self.shape)
        logical = nn.get_partition_spec(boxed_tree)
        return jax.tree.map(
            lambda spec: self.sharding(tuple(spec) if spec is not None else ()),
            logical,
            is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
        )


def build_layout(
    config: Config,
    devices: Sequence[Any] | None = None,
    platform: str | None = None,
    device_kind: str | None = None,
) -> Layout:
    """The mesh, its rules, the kernel choices and (on more than one device) the expert dispatch plan.

    `platform` names the backend the program is for when it is not the one running
    (lowering for CUDA on a CPU host); it decides whether ragged all-to-all is native and
    which kernels `auto` means. `device_kind` (e.g. "NVIDIA H200") tells GPU generations
    apart; default: the running device's when `platform` is this process's, else unknown.
    """
    mesh = build_mesh(config, devices)
    rules = resolve_rules(config)
    kernels = resolve_kernels(config, platform, device_kind)
    plan = None
    if mesh.size > 1:
        plan = make_dispatch_plan(
            mesh,
            config.moe,
            grouped_matmul=kernels.grouped_matmul.name,
            token_axes=logical_to_spec(("batch",), rules, dict(mesh.shape))[0],
            expert_axis="expert",
            tensor_axis="tensor",
            platform=kernels.platform,
            weight_specs={
                name: logical_to_spec(axes, rules, dict(mesh.shape)) for name, axes in EXPERT_WEIGHT_AXES.items()
            },
        )
    return Layout(mesh, rules, plan, kernels.platform, kernels.grouped_matmul, kernels.attention)
