"""The layout: a device mesh with its rules, bound to the implementations of the model's operations.

`build_layout` takes the mesh (maxmoe.parallel.mesh: devices -> mesh, logical -> mesh rules) and
decides, once, what runs each sharded operation the model asks for: the expert dispatch
strategy (maxmoe.parallel.dispatch), the grouped-GEMM and attention kernels that `auto`
resolves to on the target (maxmoe.kernels.choice), FP8 projections through maxmoe's kernels
(maxmoe.kernels.fp8_dense). The model receives a `Layout` and calls its methods with logical
axes only; it never names a mesh axis or a kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxmoe.config import Config, ConfigError
from maxmoe.kernels.attention import kernel, sharded_attention
from maxmoe.kernels.choice import Choice, resolve_kernels
from maxmoe.kernels.fp8_dense import sharded_fp8_projection
from maxmoe.kernels.fp8_matmul import blockwise_kernels, fp8_matmul
from maxmoe.parallel import context as context_parallel
from maxmoe.parallel.dispatch import EXPERT_WEIGHT_AXES, make_dispatch_plan
from maxmoe.parallel.mesh import build_mesh, check_divisible, indivisible, logical_to_spec, resolve_rules, zero1_spec
from maxmoe.parallel.names import CONTEXT_AXIS, REPLICA_AXIS
from maxmoe.parallel.replicas import without_axis
from maxmoe.parallel.shard_context import axes_of, context_sharding, in_manual_context


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
            (maxmoe.kernels.choice.Choice: name and reason).
        layer_grads: mesh.zero1_reduce=per_layer (ZeRO-1 splits no `layers` dimension).
    """

    mesh: Mesh
    rules: dict
    dispatch_plan: Any = None
    platform: str = "cpu"
    grouped_matmul: Any = None
    attention: Any = None
    layer_grads: bool = False

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

    @property
    def context(self) -> int:
        """Size of the `context` axis (1 without context parallelism)."""
        return self.shape.get(CONTEXT_AXIS, 1)

    def sequence_order(self, t: int) -> np.ndarray | None:
        """The natural positions of a [B, t] activation's columns in layout order (the zigzag
        split over `context`), or None when the sequence stays in natural order."""
        return context_parallel.zigzag_order(t, self.context) if self.context > 1 else None

    def latent_attention(self, forward, backward):
        """fn(q, positions, latent, k_rope, w_k_up, w_v_up) running MLA's core on the latents, or None
        where the model materialises keys and values itself. With a `context` axis: the core (its
        `forward` and `backward`) on each device's queries, the latents all-gathered over `context`
        (maxmoe.parallel.context)."""
        if self.context == 1:
            return None
        spec = tuple(self.spec(("batch", "seq", "heads", "head_dim"))) + (None,) * 4
        return context_parallel.latent_attention(forward, backward, self.mesh, spec[0], spec[2])

    def attention_fn(self, name: str):
        """fn(q, k, v, scale) for attention kernel `name` [batch, seq, heads, head_dim], placed on the mesh."""
        interpret = self.platform != "cuda"  # Pallas kernels run in interpret mode off the GPU
        if self.mesh.size == 1:
            return lambda q, k, v, scale: kernel(name)(q, k, v, scale, interpret=interpret)
        return sharded_attention(name, self.mesh, self.spec(("batch", "seq", "heads", "head_dim")), interpret=interpret)

    def fp8_projection(self, recipe: str, x_axes: Sequence[str | None], w_axes: Sequence[str | None], contract: int):
        """fn(x [..., K], w [K, N]) running an FP8 projection's GEMMs on each device's shards
        (maxmoe.kernels.fp8_dense), or None where XLA's program runs them. On shards: blockwise
        with a kernel grouped backend (a GPU's, or the dry run's stand-in: the same switch as the
        experts'), its GEMMs through maxmoe's kernels; mxfp8 on a GPU inside a shard_map manual
        over some mesh axes only (the two-tier step's per-replica region, a pipeline stage),
        where jax's partitioning of scaled_matmul, a custom-partitioned call, cannot run. None
        also for a contraction / output merged from dims whose minor ones the rules shard.

        x_axes, w_axes: the logical axes of x [..., K...] and w [K..., N...] before the caller
        merges their `contract` contraction dims (and w's output dims) into one.
        """
        if recipe == "mxfp8":
            if self.platform != "cuda" or not in_manual_context():
                return None
            kernels = None
        elif recipe == "blockwise":
            kernels = blockwise_kernels(self.grouped_matmul.name if self.grouped_matmul is not None else "")
            if not kernels:
                return None
        else:
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
        """ZeRO-1 NamedShardings (`zero1_spec`, adding the axes `over`) for a tree of flax-boxed variables.

        With `layer_grads` (mesh.zero1_reduce=per_layer) the added axes split no `layers` dimension."""
        logical = nn.get_partition_spec(boxed_tree)
        shapes = nn.unbox(boxed_tree)

        def keep_whole(spec) -> tuple[int, ...]:
            names = tuple(spec) if spec is not None else ()
            return tuple(i for i, name in enumerate(names) if name == "layers") if self.layer_grads else ()

        return jax.tree.map(
            lambda spec, leaf: NamedSharding(
                self.mesh,
                zero1_spec(
                    self.spec(tuple(spec) if spec is not None else ()), leaf.shape, self.shape, over, keep_whole(spec)
                ),
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

    def whole_shardings(self, boxed_tree) -> Any:
        """`tree_shardings`, but every leaf without an `expert` logical axis whole over the mesh
        axes the batch is split over (its FSDP shards gathered; a tensor split kept): the weights
        mesh.zero1_gather=per_step gathers once per step. Experts' leaves keep `tree_shardings`."""
        batch_axes = axes_of(self.spec(("batch",))[0])

        def one(spec, sharding):
            if spec is not None and "expert" in tuple(spec):
                return sharding
            return NamedSharding(self.mesh, without_axis(sharding.spec, *batch_axes))

        return jax.tree.map(
            one,
            nn.get_partition_spec(boxed_tree),
            self.tree_shardings(boxed_tree),
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
    attention = kernels.attention
    if CONTEXT_AXIS in mesh.shape:
        # The latent core up-projects keys and values inside its key loop (config refuses other cores).
        attention = Choice(
            "chunked", f"mesh.context={mesh.shape[CONTEXT_AXIS]}: latents gathered, up-projected in the key loop"
        )
    if mesh.size > 1:
        plan = make_dispatch_plan(
            mesh,
            config.moe,
            grouped_matmul=kernels.grouped_matmul.name,
            token_axes=logical_to_spec(("batch",), rules, dict(mesh.shape))[0],
            seq_axes=logical_to_spec(("batch", "seq"), rules, dict(mesh.shape))[1],
            expert_axis=logical_to_spec(("expert",), rules, dict(mesh.shape))[0] or "expert",
            tensor_axis="tensor",
            platform=kernels.platform,
            weight_specs={
                name: logical_to_spec(axes, rules, dict(mesh.shape)) for name, axes in EXPERT_WEIGHT_AXES.items()
            },
        )
    layer_grads = config.mesh.zero1_reduce == "per_layer"
    return Layout(mesh, rules, plan, kernels.platform, kernels.grouped_matmul, attention, layer_grads)
