"""The train state's layer stack in the pipeline's slot layout, and back to model order.

With mesh.pipeline > 1 every leaf under `moe_layers` (parameters, router biases, the
optimizer's moments) lives as [V, P, S, ...] with dim 1 sharded over `pipeline`
(maxmoe.parallel.pipeline_schedule.SlotLayout): stage p holds exactly the chunks it runs.
Keeping model order [L, ...] instead would move (V-1)/V of every stacked parameter and
gradient between stages each step (chunk v*P + p is not a contiguous block of layers).

Checkpoints stay in model order whatever the stage layout, so a run saved with
pipeline=2 resumes with pipeline=1 and back: save converts with `to_model_order`, restore
reads into `model_order_abstract` and converts with `to_stage_order`. Only the stacked
leaves are converted (one jitted program), the rest pass through untouched.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from maxmoe.config import Config
from maxmoe.model.stages import STACK
from maxmoe.parallel.pipeline import AXIS
from maxmoe.parallel.pipeline_schedule import SlotLayout


def slot_layout(config: Config) -> SlotLayout | None:
    """Where the layers (dense and MoE) sit on the stages; None without a pipeline."""
    m, mesh = config.model, config.mesh
    if mesh.pipeline == 1:
        return None
    moe = m.num_layers - m.first_k_dense
    return SlotLayout(moe, mesh.pipeline, mesh.pipeline_virtual, mesh.pipeline_pad_front, m.first_k_dense)


def _stacked(path) -> bool:
    return any(getattr(k, "key", None) == STACK for k in path)


def _map_stacked(fn, tree):
    return jax.tree_util.tree_map_with_path(lambda p, a: fn(a) if _stacked(p) else a, tree)


def stage_sharding(sharding: NamedSharding) -> NamedSharding:
    """[L, ...] sharding -> [V, P, S, ...]: P over `pipeline`, the layer dims unsharded."""
    rest = tuple(sharding.spec)[1:]
    return NamedSharding(sharding.mesh, PartitionSpec(None, AXIS, None, *rest))


def model_sharding(sharding: NamedSharding) -> NamedSharding:
    """[V, P, S, ...] sharding -> [L, ...] (the layer dim unsharded)."""
    rest = tuple(sharding.spec)[3:]
    return NamedSharding(sharding.mesh, PartitionSpec(None, *rest))


# The parameters outside the layer stack (embedding, dense layers, head, MTP) run on every
# stage; their master weights and optimizer state are ZeRO-1 over these axes, and the train
# step gathers their compute copy over them once per step (maxmoe.training.pipeline_step).
OUTER_ZERO1 = (AXIS,)


def outer_shardings(layout: Any, boxed: Any) -> Any:
    """The ZeRO-1 shardings over the stages of a flax-boxed state tree (params, opt_state)."""
    return layout.zero1_shardings(boxed, OUTER_ZERO1)


def stage_shardings(config: Config, shardings: Any, outer: Any = None) -> Any:
    """Model-order shardings of a state tree -> those of its stage layout.

    outer: a tree of the same structure whose entries replace those of the leaves outside
    the layer stack (their ZeRO-1 sharding over the stages); default: kept as given.
    """
    if slot_layout(config) is None:
        return shardings
    outer = shardings if outer is None else outer
    return jax.tree_util.tree_map_with_path(
        lambda path, s, o: stage_sharding(s) if _stacked(path) else o, shardings, outer
    )


def stage_abstract(config: Config, abstract: Any) -> Any:
    """ShapeDtypeStructs of a model-order tree -> the stage layout's shapes (shardings kept as given)."""
    slots = slot_layout(config)
    if slots is None:
        return abstract
    return _map_stacked(
        lambda s: jax.ShapeDtypeStruct(slots.stage_shape(s.shape), s.dtype, sharding=getattr(s, "sharding", None)),
        abstract,
    )


def model_order_abstract(config: Config, abstract: Any) -> Any:
    """ShapeDtypeStructs (with shardings) of a stage-layout tree -> model order: what a checkpoint holds."""
    slots = slot_layout(config)
    if slots is None:
        return abstract

    def one(s):
        sharding = model_sharding(s.sharding) if isinstance(s.sharding, NamedSharding) else s.sharding
        return jax.ShapeDtypeStruct((slots.layers, *s.shape[3:]), s.dtype, sharding=sharding)

    return _map_stacked(one, abstract)


def to_stages(config: Config, tree: Any) -> Any:
    """Model order -> stage layout, traceable (use inside jit)."""
    slots = slot_layout(config)
    return tree if slots is None else _map_stacked(slots.to_stages, tree)


def to_model(config: Config, tree: Any) -> Any:
    """Stage layout -> model order, traceable (use inside jit)."""
    slots = slot_layout(config)
    return tree if slots is None else _map_stacked(slots.to_model, tree)


def _convert_stacked(tree: Any, convert, out_sharding) -> Any:
    """Apply `convert` to the stacked leaves in one jitted program; other leaves are returned as they are."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    picked = [i for i, (path, _) in enumerate(leaves) if _stacked(path)]
    arrays = [leaves[i][1] for i in picked]
    converted = jax.jit(lambda xs: [convert(x) for x in xs], out_shardings=[out_sharding(x) for x in arrays])(arrays)
    out = [leaf for _, leaf in leaves]
    for i, x in zip(picked, converted, strict=True):
        out[i] = x
    return jax.tree.unflatten(treedef, out)


def to_model_order(config: Config, state: Any) -> Any:
    """A state of device arrays in the stage layout -> model order (what a checkpoint stores)."""
    slots = slot_layout(config)
    if slots is None:
        return state
    return _convert_stacked(state, slots.to_model, lambda x: model_sharding(x.sharding))


def to_stage_order(config: Config, state: Any, abstract: Any) -> Any:
    """A model-order state of device arrays -> the stage layout, on `abstract`'s shardings."""
    slots = slot_layout(config)
    if slots is None:
        return state
    targets = iter(s.sharding for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0] if _stacked(p))
    return _convert_stacked(state, slots.to_stages, lambda x: next(targets))
