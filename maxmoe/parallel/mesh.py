"""Devices -> a named ([pipeline,] [replica,] data, [context,] expert, tensor) mesh over scale-up domains; logical->mesh rules.

    mesh = build_mesh(config)                     # devices ordered by (domain, process, local id)
    spec = logical_to_spec(("batch", "seq", "embed"), resolve_rules(config), dict(mesh.shape))

`tensor` varies fastest, then `expert`, then `data`, so every [context x] expert x tensor block
lies inside one scale-up domain (else a ConfigError naming it, unless mesh.allow_cross_domain);
only `data`, `replica` and `pipeline` (outermost, mesh.pipeline > 1) may span domains. Under
mesh.across_domains=zero1, `replica` is the part of mesh.data that does not fit a domain beside
expert x tensor; no rule names it, and it is the minor factor of the ZeRO-1 sharding of master
weights and optimizer state (`zero1_spec`). Rules are data (`mesh.rules`): `resolve_rules` turns
the virtual axis `fsdp` into `data` (and `context`) or nothing, and `logical_to_spec` gives a mesh
axis to the first dimension that asks for it, leaving out axes of size 1. What runs on the mesh
(kernels, dispatch) is bound in maxmoe.parallel.layout.
docs/SHARDING.md ("Scale-up domains", "First come, first served", "Two tiers") has the reasoning.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from maxmoe.config import DEFAULT_RULES, Config, ConfigError, check_mesh_fits, mesh_sizes
from maxmoe.parallel.names import CONTEXT_AXIS, MESH_AXES, OPTIONAL_MESH_AXES, REPLICA_AXIS
from maxmoe.parallel.shard_context import axes_of


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
    block = sizes.get(CONTEXT_AXIS, 1) * sizes["expert"] * sizes["tensor"]
    if config.mesh.across_domains == "zero1" and domain_size % block == 0:
        inside = math.gcd(sizes["data"], domain_size // block)
        shape[REPLICA_AXIS], shape["data"] = sizes["data"] // inside, inside
    return {a: shape.get(a, 1) for a in MESH_AXES}


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

    block = sizes.get(CONTEXT_AXIS, 1) * sizes["expert"] * sizes["tensor"]
    message = None
    if straddles(block):  # each row: one [context x] expert x tensor block (of one stage, replica and data index)
        names = (
            "mesh.context x mesh.expert x mesh.tensor"
            if sizes.get(CONTEXT_AXIS, 1) > 1
            else "mesh.expert x mesh.tensor"
        )
        message = (
            f"{names} = {block} devices do not fit inside one "
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
    spec: PartitionSpec,
    shape: Sequence[int],
    mesh_shape: dict[str, int],
    over: Sequence[str] | None = None,
    keep_whole: Sequence[int] = (),
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
    replicated over it. `keep_whole`: dimensions the added axes do not split (a layer stack's
    `layers` under mesh.zero1_reduce=per_layer: each layer's gradient reduce-scatters on its own).
    """
    entries = [axes_of(e) for e in tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))]
    if over is None:
        used = {a for e in entries for a in e}
        over = [a for a in MESH_AXES if a != REPLICA_AXIS and a not in used] + [REPLICA_AXIS]
    for axis in (a for a in over if mesh_shape.get(a, 1) > 1):
        for dim, axes in enumerate(entries):
            if dim in keep_whole:
                continue
            if shape[dim] % (math.prod(mesh_shape[a] for a in axes) * mesh_shape[axis]) == 0:
                entries[dim] = (*axes, axis)
                break
    return PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in entries])


def resolve_rules(config: Config) -> dict[str, tuple[str, ...]]:
    """Logical axis -> mesh axes, with `fsdp` replaced by data (and context, when there is one) or dropped (off).

    With mesh.context > 1 the sequence is sharded over `context` and the experts over
    `context` x the expert rule's axes (context parallelism folds over expert parallelism).
    """
    # Under FSDP `context` shards weights like `data`: outside attention it is more data parallelism.
    fsdp = ["data", CONTEXT_AXIS] if config.mesh.context > 1 else ["data"]
    rules = {}
    for logical, axes in {**DEFAULT_RULES, **config.mesh.rules}.items():
        resolved = []
        for axis in axes:
            expanded = (fsdp if config.mesh.fsdp else []) if axis == "fsdp" else [axis]
            for name in expanded:
                if name not in resolved:
                    resolved.append(name)
        rules[logical] = tuple(resolved)
    if config.mesh.context > 1:
        rules["seq"] = (CONTEXT_AXIS,)
        rules["expert"] = (CONTEXT_AXIS, *(a for a in rules["expert"] if a != CONTEXT_AXIS))
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
