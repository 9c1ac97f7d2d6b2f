"""Routed experts on one device or expert-parallel over a mesh: route -> exchange -> grouped SwiGLU -> back.

    plan = make_dispatch_plan(mesh, moe_config, token_axes=..., weight_specs=...)   # build_layout's
    y_BTD, dropped = routed_experts(x_BTD, ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, plan=plan)

`routed_experts` is what the model calls (plan=None on one device: every expert local); it
returns the routed output and the fraction of token copies dropped. On a mesh the plan's
`routed_experts` enters `jax.shard_map` over the whole mesh and runs one `moe.dispatch` strategy
per shard (`maxmoe.parallel.dispatch_shard`): `ragged_a2a` (dropless unless `moe.buffer_factor`
bounds the buffer), `allgather` (dropless) or `capacity`. Options: `moe.overlap=batch_split`
(two independent halves; equal to `none` whenever nothing is dropped), `moe.a2a_chunks`,
`moe.fp8_dispatch`. Padding tokens (expert id E) are never sent.

docs/SHARDING.md, "Expert dispatch" has the strategies, specs, buffer bound, overlap and chunks.
Axis legend: B batch, T time, D embed, E experts, F expert_mlp, N tokens, K top-k, M rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from maxmoe.config import DISPATCH_STRATEGIES, MOE_OVERLAPS
from maxmoe.parallel import dispatch_shard
from maxmoe.parallel.collectives import RAGGED_A2A_IMPLS, has_native_ragged_all_to_all
from maxmoe.parallel.dispatch_shard import expert_swiglu
from maxmoe.parallel.shard_context import shard_map_in_context

# Logical axes of the routed experts' weights: the model declares its parameters with them and
# the mesh derives the shard_map's weight specs from them.
EXPERT_WEIGHT_AXES = {
    "w_gate": ("expert", "embed", "expert_mlp"),
    "w_up": ("expert", "embed", "expert_mlp"),
    "w_down": ("expert", "expert_mlp", "embed"),
}
__all__ = [
    "DispatchPlan",
    "EXPERT_WEIGHT_AXES",
    "expert_swiglu",
    "local_routed_experts",
    "make_dispatch_plan",
    "routed_experts",
]


def local_routed_experts(
    x_ND, expert_ids_NK, weights_NK, w_gate_EDF, w_up_EDF, w_down_EFD, backend="ragged_dot", fp8="none"
):
    """All experts on one device: sort the N*K token copies by expert, grouped matmul, unsort, combine."""
    n, k = expert_ids_NK.shape
    e = w_gate_EDF.shape[0]
    flat_ids = expert_ids_NK.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    rows_MD = x_ND[order // k]
    group_sizes_E = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    out_MD = expert_swiglu(rows_MD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, backend, fp8, padded=False)
    copies_NKD = jnp.zeros_like(out_MD).at[order].set(out_MD).reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", copies_NKD, weights_NK.astype(copies_NKD.dtype))


def routed_experts(
    x_BTD,
    expert_ids_BTK,
    weights_BTK,
    w_gate_EDF,
    w_up_EDF,
    w_down_EFD,
    *,
    plan=None,
    grouped_matmul="ragged_dot",
    fp8="none",
):
    """Routed MoE output [B, T, D] and the fraction of token copies dropped.

    `plan` is None on one device (all experts local, grouped GEMM `grouped_matmul`);
    otherwise it selects the expert-parallel strategy, the grouped GEMM, and carries the mesh.
    `fp8` ("none" or a maxmoe.kernels.fp8_matmul recipe) runs the grouped GEMMs in FP8.
    """
    b, t, d = x_BTD.shape
    k = expert_ids_BTK.shape[-1]
    if plan is None:
        y = local_routed_experts(
            x_BTD.reshape(b * t, d),
            expert_ids_BTK.reshape(b * t, k),
            weights_BTK.reshape(b * t, k),
            w_gate_EDF,
            w_up_EDF,
            w_down_EFD,
            grouped_matmul,
            fp8,
        )
        return y.reshape(b, t, d), jnp.zeros((), jnp.float32)
    return plan.routed_experts(x_BTD, expert_ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, fp8=fp8)


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchPlan:
    """How routed experts run on a mesh; immutable and hashable by identity (a module attribute).

    Attributes:
        mesh: the (data, expert, tensor) mesh.
        strategy: one of maxmoe.config.DISPATCH_STRATEGIES.
        token_axes: mesh axes the flattened token dim is sharded over inside the shard_map.
        expert_axis: the mesh axis experts are sharded over (tokens are exchanged over it), or a
            tuple of axes (with context parallelism: ("context", "expert"), one exchange group).
        tensor_axis: the mesh axis F is sharded over, or None when F is whole on every device.
        a2a_impl: the ragged all-to-all of ragged_a2a, one of RAGGED_A2A_IMPLS: "native"
            (GPU, TPU), "emulate" (the dense emulation, CPU) or "balanced_stand_in" (native
            buffers and balanced-routing bytes, for compiling a GPU-shaped program on CPU).
        buffer_factor: ragged_a2a receive buffer in units of n x K rows; 0 = dropless.
        capacity_factor: capacity strategy slots per expert in units of n x K / E.
        grouped_matmul: grouped GEMM backend for ragged_a2a and allgather.
        overlap: "none", or "batch_split": each shard's tokens run as two independent
            halves (exchange -> experts -> exchange back), so one half's collectives can
            hide under the other half's GEMMs. Each half has its own buffer (or capacity)
            bound, so with bounded buffers each half drops on its own.
        a2a_chunks: ragged_a2a: slices per (source, destination) block in each ragged
            all-to-all (the collective gets a2a_chunks x P slices; rows land where they did).
        fp8_dispatch: ragged_a2a sends the rows in fp8 with their scales when the experts run
            an fp8 recipe (`maxmoe.parallel.fp8_dispatch`).
        seq_axes: the trailing token axes that shard the sequence dim of [B, T] activations
            (context parallelism); tokens then enter the shard_map as [B, T] blocks and are
            flattened on each device, since flattening a sequence-sharded [B, T] globally
            would reshuffle it.
    """

    mesh: Mesh
    strategy: str
    token_axes: tuple
    expert_axis: str | tuple
    tensor_axis: str | None
    a2a_impl: str
    buffer_factor: float = 0.0
    capacity_factor: float = 1.25
    grouped_matmul: str = "ragged_dot"
    overlap: str = "none"
    a2a_chunks: int = 1
    fp8_dispatch: bool = False
    seq_axes: tuple = ()

    def __post_init__(self):
        if self.a2a_impl not in RAGGED_A2A_IMPLS:
            raise ValueError(f"unknown a2a_impl {self.a2a_impl!r}; expected one of {RAGGED_A2A_IMPLS}")
        if self.overlap not in MOE_OVERLAPS:
            raise ValueError(f"unknown moe.overlap {self.overlap!r}; expected one of {MOE_OVERLAPS}")
        if self.a2a_chunks < 1:
            raise ValueError(f"moe.a2a_chunks={self.a2a_chunks}: expected a positive integer")

    @property
    def token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    @property
    def expert_ranks(self) -> int:
        return math.prod(self.mesh.shape[a] for a in _axes_tuple(self.expert_axis))

    def buffer_rows(self, tokens_per_shard: int, top_k: int, num_experts: int) -> int:
        """ragged_a2a receive rows per expert rank: the dropless bound, or less with buffer_factor."""
        dropless = dispatch_shard.dropless_rows(
            tokens_per_shard, top_k, num_experts // self.expert_ranks, self.expert_ranks
        )
        if self.buffer_factor <= 0:
            return dropless
        return min(dropless, math.ceil(self.buffer_factor * tokens_per_shard * top_k))

    def capacity(self, tokens_per_shard: int, top_k: int, num_experts: int) -> int:
        """capacity slots per (shard, expert); never more than n (a token picks an expert once)."""
        slots = math.ceil(self.capacity_factor * tokens_per_shard * top_k / num_experts)
        return max(1, min(tokens_per_shard, slots))

    def routed_experts(self, x_BTD, expert_ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, fp8="none"):
        """Same result as `local_routed_experts` (up to dropped copies) on global arrays.

        `fp8` runs the grouped GEMMs of ragged_a2a and allgather in that recipe (not capacity's).

        Returns:
            y_BTD and the float32 fraction of all token copies dropped (0 when dropless).
        """
        b, t, d = x_BTD.shape
        k = expert_ids_BTK.shape[-1]
        num_experts = w_gate_EDF.shape[0]
        if num_experts % self.expert_ranks:
            raise ValueError(
                f"{num_experts} experts are not divisible by the {self.expert_ranks} "
                f"ranks of mesh axis {self.expert_axis!r}"
            )
        if self.seq_axes:
            return self._sequence_sharded(x_BTD, expert_ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, fp8)
        n_global = b * t
        pad = -n_global % self.token_shards
        x_ND = jnp.pad(x_BTD.reshape(n_global, d), ((0, pad), (0, 0)))
        ids_NK = jnp.pad(
            expert_ids_BTK.reshape(n_global, k).astype(jnp.int32), ((0, pad), (0, 0)), constant_values=num_experts
        )
        weights_NK = jnp.pad(weights_BTK.reshape(n_global, k), ((0, pad), (0, 0)))

        tokens = PartitionSpec(self.token_axes, None)
        w_in = PartitionSpec(self.expert_axis, None, self.tensor_axis)
        w_out = PartitionSpec(self.expert_axis, self.tensor_axis, None)
        # Nested in the per-replica shard_map of the two-tier step, only the in-domain axes go manual.
        y_ND, dropped_frac = shard_map_in_context(
            self._shard_fn(num_experts, k, fp8),
            mesh=self.mesh,
            in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
            out_specs=(tokens, PartitionSpec()),
        )(x_ND, ids_NK, weights_NK, w_gate_EDF, w_up_EDF, w_down_EFD)
        return y_ND[:n_global].reshape(b, t, d), jax.lax.stop_gradient(dropped_frac)

    def _shard_fn(self, num_experts: int, k: int, fp8: str):
        """shard(x_nD, ids_nK, weights_nK, w_gate, w_up, w_down) -> (y_nD, dropped fraction): one
        device's part of the strategy inside the shard_map."""

        def body(x_nD, ids_nK, weights_nK, *weights):
            # Buffers and capacity are sized for the rows this call sees (a half under batch_split).
            rows = x_nD.shape[0]
            if self.strategy == "ragged_a2a":
                run = functools.partial(
                    dispatch_shard.ragged_a2a_shard,
                    num_experts=num_experts,
                    buffer_rows=self.buffer_rows(rows, k, num_experts),
                    expert_axis=self.expert_axis,
                    a2a_impl=self.a2a_impl,
                    backend=self.grouped_matmul,
                    a2a_chunks=self.a2a_chunks,
                    fp8=fp8,
                    fp8_dispatch=self.fp8_dispatch and fp8 != "none",
                )
            elif self.strategy == "allgather":
                run = functools.partial(
                    dispatch_shard.allgather_shard,
                    num_experts=num_experts,
                    expert_axis=self.expert_axis,
                    backend=self.grouped_matmul,
                    fp8=fp8,
                )
            else:
                if fp8 != "none":
                    raise ValueError(f"fp8={fp8!r}: the capacity strategy has no grouped GEMM to run in FP8")
                run = functools.partial(
                    dispatch_shard.capacity_shard,
                    num_experts=num_experts,
                    capacity=self.capacity(rows, k, num_experts),
                    expert_axis=self.expert_axis,
                )
            return run(x_nD, ids_nK, weights_nK, *weights)

        def split_body(x_nD, ids_nK, weights_nK, *weights):
            # Two halves with no data dependence between them, so XLA's latency-hiding
            # scheduler may run one half's collectives under the other half's expert GEMMs.
            half = (x_nD.shape[0] + 1) // 2
            first = body(x_nD[:half], ids_nK[:half], weights_nK[:half], *weights)
            second = body(x_nD[half:], ids_nK[half:], weights_nK[half:], *weights)
            return jnp.concatenate([first[0], second[0]]), first[1] + second[1], first[2] + second[2]

        def shard(*args):
            run_body = split_body if self.overlap == "batch_split" and args[0].shape[0] > 1 else body
            y_nD, dropped, copies = run_body(*args)
            if self.tensor_axis is not None:
                y_nD = jax.lax.psum(y_nD, self.tensor_axis)
            dropped, copies = jax.lax.psum((dropped, copies), self.token_axes)
            return y_nD, dropped.astype(jnp.float32) / jnp.maximum(copies, 1).astype(jnp.float32)

        return shard

    def _sequence_sharded(self, x_BTD, ids_BTK, weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, fp8):
        """`routed_experts` for [B, T] tokens sharded over batch and sequence axes: each device
        flattens its own block (the batch and sequence must divide their shards)."""
        num_experts, k, d = w_gate_EDF.shape[0], ids_BTK.shape[-1], x_BTD.shape[-1]
        run = self._shard_fn(num_experts, k, fp8)

        def shard(x_BTD, ids_BTK, weights_BTK, *weights):
            b, t = x_BTD.shape[:2]
            y_nD, dropped_frac = run(
                x_BTD.reshape(b * t, d), ids_BTK.reshape(b * t, k), weights_BTK.reshape(b * t, k), *weights
            )
            return y_nD.reshape(b, t, d), dropped_frac

        batch = tuple(a for a in self.token_axes if a not in self.seq_axes) or None
        tokens = PartitionSpec(batch, self.seq_axes, None)
        w_in = PartitionSpec(self.expert_axis, None, self.tensor_axis)
        w_out = PartitionSpec(self.expert_axis, self.tensor_axis, None)
        y_BTD, dropped_frac = shard_map_in_context(
            shard,
            mesh=self.mesh,
            in_specs=(tokens, tokens, tokens, w_in, w_in, w_out),
            out_specs=(tokens, PartitionSpec()),
        )(x_BTD, ids_BTK.astype(jnp.int32), weights_BTK, w_gate_EDF, w_up_EDF, w_down_EFD)
        return y_BTD, jax.lax.stop_gradient(dropped_frac)


def _axes_tuple(axes) -> tuple:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def make_dispatch_plan(
    mesh: Mesh,
    moe_config,
    *,
    token_axes,
    expert_axis: str | tuple = "expert",
    tensor_axis: str = "tensor",
    weight_specs: dict,
    platform: str | None = None,
    grouped_matmul: str | None = None,
    seq_axes=None,
) -> DispatchPlan:
    """The expert-parallel plan for `mesh` and `moe_config` (a MoEConfig).

    Args:
        mesh: the device mesh; must have `expert_axis` (and `tensor_axis` if F is sharded).
        moe_config: reads dispatch ("auto" = "ragged_a2a"), buffer_factor, capacity_factor,
            emulate_ragged_a2a, overlap and a2a_chunks.
        token_axes: mesh axis, tuple of axes, or None sharding the batch dim of activations.
            Inside the shard_map tokens are sharded over these axes (minus `tensor_axis`)
            followed by any of data / `expert_axis` not among them: slicing a replicated
            dim is free, and every expert rank must own distinct tokens.
        expert_axis: mesh axis (or tuple of axes) the expert dim of the weights is sharded over.
        tensor_axis: mesh axis F may be sharded over.
        weight_specs: PartitionSpecs of "w_gate", "w_up" [E, D, F] and "w_down" [E, F, D];
            only whether F is sharded over `tensor_axis` is read (D enters unsharded).
        platform: the platform the program is compiled for ("cpu", "cuda", ...); decides
            whether ragged all-to-all is emulated. Default: jax.default_backend().
        grouped_matmul: the resolved grouped GEMM backend (maxmoe.kernels.choice);
            default: moe_config.grouped_matmul unless that is "auto", then "ragged_dot".
        seq_axes: mesh axes sharding the sequence dim of activations (context parallelism):
            the minor token axes, tokens entering the shard_map as [B, T] blocks.

    Raises:
        ValueError: for an unknown strategy or axis, or inconsistent F sharding.
    """
    strategy = "ragged_a2a" if moe_config.dispatch == "auto" else moe_config.dispatch
    if strategy not in DISPATCH_STRATEGIES:
        raise ValueError(
            f"unknown moe.dispatch {moe_config.dispatch!r}; expected 'auto' or one of {DISPATCH_STRATEGIES}"
        )
    if any(a not in mesh.axis_names for a in _axes_tuple(expert_axis)):
        raise ValueError(f"expert axis {expert_axis!r} is not a mesh axis {mesh.axis_names}")
    seq = tuple(a for a in _axes_tuple(seq_axes) if a != tensor_axis)
    axes = [a for a in _axes_tuple(token_axes) if a != tensor_axis and a not in seq]
    axes += [a for a in ("data", *_axes_tuple(expert_axis)) if a in mesh.axis_names and a not in axes + list(seq)]
    axes += list(seq)

    def shards_f(spec, dim):
        entry = tuple(spec)[dim] if len(tuple(spec)) > dim else None
        return tensor_axis in _axes_tuple(entry)

    f_sharded = {
        shards_f(weight_specs["w_gate"], 2),
        shards_f(weight_specs["w_up"], 2),
        shards_f(weight_specs["w_down"], 1),
    }
    if len(f_sharded) != 1:
        raise ValueError(f"w_gate, w_up and w_down must agree on sharding F over {tensor_axis!r}: {weight_specs}")
    f_axis = tensor_axis if f_sharded.pop() and mesh.shape.get(tensor_axis, 1) > 1 else None

    if moe_config.emulate_ragged_a2a == "auto":
        emulate = not has_native_ragged_all_to_all(platform or jax.default_backend())
    else:
        emulate = moe_config.emulate_ragged_a2a == "true"
    return DispatchPlan(
        mesh=mesh,
        strategy=strategy,
        token_axes=tuple(axes),
        expert_axis=expert_axis,
        tensor_axis=f_axis,
        a2a_impl="emulate" if emulate else "native",
        buffer_factor=moe_config.buffer_factor,
        capacity_factor=moe_config.capacity_factor,
        grouped_matmul=grouped_matmul
        or (moe_config.grouped_matmul if moe_config.grouped_matmul != "auto" else "ragged_dot"),
        overlap=moe_config.overlap,
        a2a_chunks=moe_config.a2a_chunks,
        fp8_dispatch=moe_config.fp8_dispatch,
        seq_axes=seq,
    )
