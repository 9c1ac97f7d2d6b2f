"""The pure training step: gradients, AdamW, and the aux-loss-free bias update.

    state, metrics = train_step(state, batch)        # batch: int32 [B, T + 1]

The gradients are means over train.grad_accum micro-batches (maxmoe.training.accumulate) of the
objective (maxmoe.training.objective). Router biases are not optimizer parameters: after each
step every MoE layer's bias moves by bias_update_rate * sign(mean load - load), from that step's
global expert counts. A step whose loss, gradient norm or parameter update is not finite leaves
the state unchanged and counts it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from maxmoe.config import Config
from maxmoe.model.transformer import abstract_variables, init_variables
from maxmoe.parallel import replicas
from maxmoe.training.accumulate import make_grads_fn, weight_copy
from maxmoe.training.objective import make_loss_fn


class TrainState(flax.struct.PyTreeNode):
    """Everything a step reads and writes; what a checkpoint holds besides the data position."""

    step: jax.Array  # completed loop steps (skipped ones included)
    params: Any
    router: Any
    opt_state: Any
    bad_steps: jax.Array  # consecutive non-finite steps
    skipped: jax.Array  # total skipped steps


def update_router_bias(router: dict, stats: dict, rate: float) -> dict:
    """bias += rate * sign(mean_load - load) for every MoE layer (loads are global counts)."""
    flat_bias = traverse_util.flatten_dict(router)
    flat_stats = traverse_util.flatten_dict(stats)
    updated = {}
    for path, bias in flat_bias.items():
        load = flat_stats[path[:-1] + ("load",)]
        updated[path] = bias + rate * jnp.sign(load.mean(axis=-1, keepdims=True) - load)
    return traverse_util.unflatten_dict(updated)


def _moe_layer_order(path: tuple) -> tuple:
    """Sort key for MoE variables: the main stack first, then MTP depths (mtp_0, mtp_1, ...) in order."""
    top = str(path[0])
    depth = re.fullmatch(r"mtp_(\d+)", top)
    return (0, 0, top) if depth is None else (1, int(depth.group(1)), top)


def _per_layer(tree: dict, name: str) -> list[jax.Array]:
    """The leaves called `name`, main stack first, then MTP (scanned leaves have a leading layers axis)."""
    flat = traverse_util.flatten_dict(tree)
    return [flat[k] for k in sorted((k for k in flat if k[-1] == name), key=_moe_layer_order)]


def balance_metrics(stats: dict, router: dict | None = None) -> dict[str, jax.Array]:
    """Expert balance of one step, per MoE layer (main stack in order, then the MTP depths).

    moe_layer_imbalance [L]: max/mean expert load of each layer (1 is even; E/K means every
    token picks the same K experts); moe_imbalance: its maximum; dropped_frac: mean over
    layers; router_bias_spread [L] (when `router` is given): max - min of each layer's
    correction bias, how far the aux-loss-free update has had to push; expert_load [L, E]:
    token copies per expert (what a notebook plots; kept off metrics.jsonl).
    """
    loads = [x.reshape(-1, x.shape[-1]) for x in _per_layer(stats, "load")]
    if not loads:
        none = jnp.zeros((0,), jnp.float32)
        metrics = {"moe_imbalance": jnp.ones((), jnp.float32), "moe_layer_imbalance": none}
        metrics |= {"dropped_frac": jnp.zeros((), jnp.float32), "expert_load": jnp.zeros((0, 0), jnp.float32)}
        return metrics if router is None else {**metrics, "router_bias_spread": none}
    load = jnp.concatenate(loads)
    ratio = load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)
    dropped = jnp.concatenate([x.reshape(-1) for x in _per_layer(stats, "dropped")])
    metrics = {"moe_imbalance": ratio.max(), "moe_layer_imbalance": ratio, "dropped_frac": dropped.mean()}
    metrics["expert_load"] = load
    if router is not None:
        bias = jnp.concatenate([x.reshape(-1, x.shape[-1]) for x in _per_layer(router, "bias")])
        metrics["router_bias_spread"] = bias.max(-1) - bias.min(-1)
    return metrics


def make_train_step(config: Config, optimizer: optax.GradientTransformation, layout: Any = None) -> Callable:
    """A pure train_step(state, batch) -> (state, metrics); gradients from the accumulator.

    On a layout with more than one replica (mesh.across_domains=zero1 over several domains)
    params and optimizer state are on ZeRO-1 shardings (`maxmoe.training.programs`).
    """
    grads_fn = make_grads_fn(config, layout)

    def train_step(state: TrainState, batch_BT: jax.Array):
        loss, aux, grads = grads_fn(state.params, state.router, batch_BT)
        return apply_gradients(config, optimizer, state, loss, aux, grads)

    return train_step


def all_true(tree: Any) -> jax.Array:
    """Whether every element of every boolean array of `tree` is true (a scalar bool)."""
    leaves = [jnp.all(x) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def apply_gradients(
    config: Config,
    optimizer: optax.GradientTransformation,
    state: TrainState,
    loss: jax.Array,
    aux: dict,
    grads: Any,
    model_order: Callable = lambda tree: tree,
) -> tuple[TrainState, dict]:
    """The step after the gradients: AdamW, router bias update, skip-if-non-finite, metrics.

    model_order maps a router/stats tree to the model's layer order for the per-layer
    metrics (the pipeline keeps its layer stack in its own order).
    """
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(params, opt_state, router):
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        # Applied beside the update's own arithmetic (XLA fuses the two; applied in the branch
        # below, the sum rounded differently in the last bit); one parameter-sized buffer either way.
        new_params = optax.apply_updates(params, updates)
        new_router = update_router_bias(router, aux["moe_stats"], config.moe.bias_update_rate)
        # Finite loss and gradients can still give non-finite updates (e.g. a moment decay of 1):
        # such a step is bad too, and the parameters stay as they were. Entries that were not
        # finite already (e.g. loaded so) do not count: they would make every later step bad.
        fresh = jax.tree.map(lambda u, p: jnp.isfinite(u) | ~jnp.isfinite(p), updates, params)
        return jax.lax.cond(
            all_true(fresh),
            lambda: (new_params, new_opt_state, new_router, jnp.array(True)),
            lambda: (params, opt_state, router, jnp.array(False)),
        )

    # A skipped step leaves parameters, moments and router biases as they were. As a cond (not a
    # select of new and old) the update can write the donated buffers in place: selecting kept
    # the old ones alive beside the new (16% more temp in a dry run of a 100M-parameter model).
    params, opt_state, router, ok = jax.lax.cond(
        ok, update, lambda *kept: (*kept, jnp.array(False)), state.params, state.opt_state, state.router
    )
    new_state = state.replace(
        step=state.step + 1,  # loop steps, skipped ones included (the optimizer counts updates)
        params=params,
        router=router,
        opt_state=opt_state,
        bad_steps=jnp.where(ok, 0, state.bad_steps + 1),
        skipped=state.skipped + jnp.where(ok, 0, 1),
    )
    metrics = {
        "loss": loss,
        "lm_loss": aux["lm_loss"],
        "mtp_loss": aux["mtp_loss"],
        "seq_aux": aux["seq_aux"],
        "grad_norm": grad_norm,
        "skipped": new_state.skipped,
        "bad_steps": new_state.bad_steps,
        **balance_metrics(model_order(aux["moe_stats"]), model_order(new_state.router)),
    }
    return new_state, metrics


def make_eval_step(config: Config, layout: Any = None) -> Callable:
    """eval_step(params, router, batch) -> next-token loss (no MTP, no balance terms).

    With more than one replica each evaluates its own rows (in the compute dtype, as
    training does) and the losses are averaged: every row has the same positions, so
    that is the mean over the batch.
    """
    loss_fn = make_loss_fn(config, layout)

    def eval_step(params, router, batch_BT):
        return loss_fn(params, router, batch_BT)[1]["lm_loss"]

    if layout is None or layout.replicas == 1:
        return eval_step
    copy, _, _ = weight_copy(config, layout, abstract_variables(config.model, boxed=True)["params"])
    per_replica = replicas.replica_mean(eval_step, layout.mesh)

    def two_tier_eval_step(params, router, batch_BT):
        return per_replica(copy(params), router, batch_BT)

    return two_tier_eval_step


def _fresh_state(variables: dict, optimizer: optax.GradientTransformation) -> TrainState:
    """Step 0 around `variables`; boxed parameters give a boxed optimizer state."""
    params = variables["params"]
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        router=variables["router"],
        opt_state=optimizer.init(params),
        bad_steps=jnp.zeros((), jnp.int32),
        skipped=jnp.zeros((), jnp.int32),
    )


def init_state(config: Config, optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """A fresh state of plain arrays (parameters do not depend on the layout)."""
    return nn.unbox(_fresh_state(init_variables(config.model, rng), optimizer))


def abstract_state(config: Config, optimizer: optax.GradientTransformation, *, boxed: bool = False) -> TrainState:
    """`init_state`'s shapes and dtypes as jax.ShapeDtypeStruct; nothing is allocated or run.

    With boxed=True the parameters and optimizer state keep their logical-axis boxes (what
    `Layout.tree_shardings` reads).
    """
    variables = abstract_variables(config.model, boxed=True)
    state = jax.eval_shape(lambda v: _fresh_state(v, optimizer), variables)
    return state if boxed else nn.unbox(state)
