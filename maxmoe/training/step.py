"""The pure training step: loss, gradients, AdamW update, and the aux-loss-free bias update.

    state, metrics = train_step(state, batch)

`batch` is int32 [B, T + 1]: inputs are tokens[:, :-1], targets tokens[:, 1:].
Loss = next-token cross-entropy (fp32 log-softmax; with train.loss_chunk > 0 fused with the
       head in blocks of vocabulary columns, never holding the whole [B, T, V] logits: training/loss.py)
     + mtp_loss_weight * mean over MTP depths of their cross-entropy
     + seq_aux_alpha * (sum over MoE layers of the sequence-wise balance loss).
Router biases are not optimizer parameters: after each step every MoE layer's bias moves
by bias_update_rate * sign(mean load - load), from that step's global expert counts.
A step whose loss, gradient norm or parameter update is not finite leaves the state unchanged and counts it.
"""

from __future__ import annotations

import dataclasses
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
from maxmoe.model.layers import LAYER_GRAD, LAYER_GRAD_ADD, LAYER_SUM
from maxmoe.model.transformer import (
    COMPUTE_DTYPES,
    abstract_variables,
    build_model,
    in_layout_order,
    init_variables,
    shift_left,
    uses_float32,
)
from maxmoe.parallel import layer_hooks, replicas
from maxmoe.training import layer_sums
from maxmoe.training.loss import cross_entropy, head_cross_entropies


class TrainState(flax.struct.PyTreeNode):
    """Everything a step reads and writes; what a checkpoint holds besides the data position."""

    step: jax.Array  # completed loop steps (skipped ones included)
    params: Any
    router: Any
    opt_state: Any
    bad_steps: jax.Array  # consecutive non-finite steps
    skipped: jax.Array  # total skipped steps


def _stats_leaves(stats: dict, name: str) -> list[jax.Array]:
    flat = traverse_util.flatten_dict(stats)
    return [v for k, v in flat.items() if k[-1] == name]


def make_output_loss(config: Config, layout: Any = None) -> Callable:
    """fn(w_head_DV, main, mtp, targets_BT, moe_stats) -> (loss, aux) from the model's outputs.

    main (None: the MTP terms alone) and mtp (one per depth) are logits, or with train.loss_chunk > 0 the final-normed
    hidden states the head is applied to block by block; moe_stats are the MoE layers'
    statistics (their seq_aux terms enter the loss).
    """
    weight, alpha = config.model.mtp_loss_weight, config.moe.seq_aux_alpha
    chunk = config.train.loss_chunk
    constrain = None if layout is None else layout.constrain

    def output_loss(w_head_DV, main, mtp, targets, stats):
        t = targets.shape[1]
        # Depth k predicts token t + k + 1: its last k positions have no target. main None:
        # the MTP terms alone (lm_loss 0; the pipeline computes the two on different stages).
        depths = ([0] if main is not None else []) + list(range(1, len(mtp) + 1))
        outputs = ([main] if main is not None else []) + list(mtp)
        targets_SBT = jnp.stack([shift_left(targets, k) if k else targets for k in depths])
        mask_SBT = jnp.stack(
            [jnp.broadcast_to((jnp.arange(t) < t - k).astype(jnp.float32), targets.shape) for k in depths]
        )
        # Made in natural order; the model's outputs are in the layout's (context parallelism: zigzag).
        targets_SBT = jnp.stack([in_layout_order(layout, x) for x in targets_SBT])
        mask_SBT = jnp.stack([in_layout_order(layout, x) for x in mask_SBT])
        if chunk > 0:  # main and mtp are hidden states: the head runs block by block, once for all of them
            losses = head_cross_entropies(
                jnp.stack(outputs),
                w_head_DV,
                targets_SBT,
                mask_SBT,
                chunk=chunk,
                dtype=COMPUTE_DTYPES[config.model.compute_dtype],
                constrain=constrain,
            )
        else:
            losses = jnp.stack([cross_entropy(x, y, m) for x, y, m in zip(outputs, targets_SBT, mask_SBT)])
        zero = jnp.zeros((), jnp.float32)
        lm_loss, mtp_losses = (losses[0], losses[1:]) if main is not None else (zero, losses)
        mtp_loss = jnp.mean(mtp_losses) if len(mtp) else zero
        seq_aux = sum((x.sum() for x in _stats_leaves(stats, "seq_aux")), zero)
        loss = lm_loss + weight * mtp_loss + alpha * seq_aux
        return loss, {"lm_loss": lm_loss, "mtp_loss": mtp_loss, "seq_aux": seq_aux, "moe_stats": stats}

    return output_loss


def make_loss_fn(config: Config, layout: Any = None) -> Callable:
    """loss_fn(params, router, batch) -> (loss, aux) for the config's model."""
    model = build_model(config.model, layout)
    output_loss = make_output_loss(config, layout)
    hidden_only = config.train.loss_chunk > 0

    def loss_fn(params, router, batch_BT, more=None):
        """more: further variable collections (maxmoe.model.layers: LAYER_GRAD and LAYER_GRAD_ADD,
        or LAYER_SUM and LAYER_INDEX; with running sums the loss gets `layer_sums.seed` of the
        sums the model carried out, value 0)."""
        more = more or {}
        tokens, targets = batch_BT[:, :-1], batch_BT[:, 1:]
        summing = LAYER_SUM in more
        (main, mtp), variables = model.apply(
            {"params": params, "router": router, **more},
            tokens,
            hidden_only=hidden_only,
            mutable=["moe_stats", LAYER_SUM] if summing else ["moe_stats"],
        )
        loss, aux = output_loss(params["head"], main, mtp, targets, variables.get("moe_stats", {}))
        return (loss + layer_sums.seed(variables[LAYER_SUM]), aux) if summing else (loss, aux)

    return loss_fn


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


def mean_stats(aux: dict, accum: int) -> dict:
    """Sums over micro-batches -> a step's figures: loads stay summed (global counts), the rest averaged."""
    aux = {k: (v if k == "moe_stats" else v / accum) for k, v in aux.items()}
    aux["moe_stats"] = jax.tree_util.tree_map_with_path(
        lambda p, v: v if getattr(p[-1], "key", "") == "load" else v / accum, aux["moe_stats"]
    )
    return aux


def _accumulated_grads(config: Config, layout: Any) -> Callable:
    """grads(params, router, batch) -> (loss, aux, grads): means over grad_accum micro-batches (a scan)."""
    grad_fn = jax.value_and_grad(make_loss_fn(config, layout), has_aux=True)
    accum = config.train.grad_accum

    def grads_fn(params, router, batch_BT):
        if accum == 1:
            (loss, aux), grads = grad_fn(params, router, batch_BT)
            return loss, aux, grads

        def body(carry, micro):
            (loss, aux), grads = grad_fn(params, router, micro)
            carry = jax.tree.map(jnp.add, carry, (loss, aux, grads))
            return carry, None

        # Strided split keeps each micro-batch spread over every data shard.
        micro = replicas.micro_batches(batch_BT, accum)
        shapes = jax.eval_shape(grad_fn, params, router, micro[0])
        (loss0, aux0), grads0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (loss, aux, grads), _ = jax.lax.scan(body, (loss0, aux0, grads0), micro)
        return loss / accum, mean_stats(aux, accum), jax.tree.map(lambda g: g / accum, grads)

    return grads_fn


def float32_leaves(boxed_params: Any) -> Any:
    """True for the leaves the model uses in float32 (norm scales, the router's gate), per leaf."""
    return jax.tree_util.tree_map_with_path(lambda path, _: uses_float32(path), nn.unbox(boxed_params))


def weight_copy(
    config: Config, layout: Any, boxed_params: Any, over: Any = None, axis: str = replicas.REPLICA
) -> tuple[Callable, Any, Any]:
    """(copy, zero1, in_domain) for master weights kept ZeRO-1 (`Layout.zero1_shardings(.., over)`).

    boxed_params: the weights' flax-boxed abstract tree. copy(master) -> the compute-dtype copy
    on the in-domain shardings (`replicas.compute_copy`, gathered over `axis`; norm scales and
    the router's gate stay float32); zero1 / in_domain: the two trees of NamedShardings (the
    gradients' in-domain sums keep `in_domain`). Under mesh.gather_once (across domains) the
    copy of every weight that is not an expert's is whole inside the domain
    (`Layout.whole_shardings`): gathered here once per step, not per layer and micro-batch.
    """
    zero1, in_domain = layout.zero1_shardings(boxed_params, over), layout.tree_shardings(boxed_params)
    keep = float32_leaves(boxed_params)
    dtype = COMPUTE_DTYPES[config.model.compute_dtype]
    gathered = in_domain
    if config.mesh.zero1_gather == "per_step" and axis == replicas.REPLICA:
        gathered = layout.whole_shardings(boxed_params)

    def copy(master):
        return replicas.compute_copy(master, zero1, gathered, keep, dtype, axis)

    return copy, zero1, in_domain


def _two_tier_grads(config: Config, layout: Any) -> Callable:
    """grads(params, router, batch) -> (loss, aux, grads) under mesh.across_domains=zero1 (maxmoe.parallel.replicas).

    Params arrive float32 on their ZeRO-1 shardings; the compute-dtype copy is gathered
    across domains once, each replica accumulates float32 gradients of its micro-batches on
    the in-domain sharding, and one reduce-scatter per leaf returns their mean to ZeRO-1.
    Differentiating w.r.t. the compute copy: each use of a weight gets a compute-dtype
    cotangent, as when the model casts a float32 weight itself; only the sum over a
    weight's uses in one micro-batch (the embedding: main and MTP) is taken in that dtype.
    """
    boxed = abstract_variables(config.model, boxed=True)["params"]
    copy, zero1, in_domain = weight_copy(config, layout, boxed)
    grad_fn = jax.value_and_grad(make_loss_fn(config, layout), has_aux=True)
    accum, r = config.train.grad_accum, layout.replicas
    in_domain_specs = jax.tree.map(lambda s: s.spec, in_domain)
    sum_fn = _micro_batch_sums(config, layout, boxed, grad_fn, in_domain_specs)
    if config.mesh.zero1_reduce == "per_layer":
        return _per_layer_two_tier_grads(config, layout, boxed, copy, zero1, sum_fn, in_domain_specs)
    accumulate = replicas.make_accumulate(sum_fn, accum, layout.mesh, in_domain_specs)

    def grads_fn(params, router, batch_BT):
        loss_R, aux_R, grads_R = accumulate(copy(params), router, batch_BT)
        grads = replicas.reduce_to_zero1(grads_R, zero1, 1.0 / (accum * r))
        aux = mean_stats(jax.tree.map(lambda v: v.sum(0), aux_R), accum * r)
        return loss_R.sum(0) / (accum * r), aux, grads

    return grads_fn


def _micro_batch_sums(config: Config, layout: Any, boxed: Any, grad_fn: Callable, in_domain_specs: Any) -> Callable:
    """sum_fn(params, extra, micro_batch, sums) -> ((loss, aux), sums + gradients) for the two-tier step.

    Under mesh.sum_per_layer the layer stacks' weights add their gradients to the sums inside
    the backward layer loop (maxmoe.training.layer_sums); otherwise each micro-batch's
    gradients are taken whole, then added (replicas.adding).
    """
    paths = layer_hooks.stacked_paths(nn.get_partition_spec(boxed), float32_leaves(boxed))
    hook = layer_sums.LayerSums(layer_sums.layer_specs(paths, in_domain_specs), layout.mesh)
    return layer_sums.summing_grad_fn(make_loss_fn(config, dataclasses.replace(layout, layer_sum_hook=hook)), paths)


def _per_layer_two_tier_grads(config, layout, boxed, copy, zero1, sum_fn, in_domain_specs) -> Callable:
    """_two_tier_grads under mesh.reduce_per_layer: the layer stacks' weights reduce-scatter across
    domains inside the last micro-batch's backward pass, one layer at a time
    (maxmoe.parallel.replicas.LayerGrads); the other weights after the loop, as before."""
    accum, r = config.train.grad_accum, layout.replicas
    plan = replicas.plan_layer_grads(zero1, nn.get_partition_spec(boxed), float32_leaves(boxed), layout.shape)
    hooked = dataclasses.replace(layout, layer_grad_hook=replicas.LayerGrads(plan, layout.mesh, r))
    last_loss = make_loss_fn(config, hooked)

    def last_grad_fn(params, router, batch_BT, into, add):
        return last_loss(params, router, batch_BT, {LAYER_GRAD: into, LAYER_GRAD_ADD: add})

    accumulate = replicas.make_accumulate_layer_grads(sum_fn, last_grad_fn, plan, accum, layout.mesh, in_domain_specs)
    flat_zero1 = traverse_util.flatten_dict(zero1)

    def grads_fn(params, router, batch_BT):
        loss_R, aux_R, grads_R, layer = accumulate(copy(params), router, batch_BT)
        scale = 1.0 / (accum * r)
        others = replicas.reduce_to_zero1(grads_R, {p: flat_zero1[p] for p in grads_R}, scale)
        grads = traverse_util.unflatten_dict(
            {**others, **replicas.assemble_layer_grads(layer, plan, flat_zero1, scale)}
        )
        aux = mean_stats(jax.tree.map(lambda v: v.sum(0), aux_R), accum * r)
        return loss_R.sum(0) / (accum * r), aux, grads

    return grads_fn


def make_train_step(config: Config, optimizer: optax.GradientTransformation, layout: Any = None) -> Callable:
    """A pure train_step(state, batch) -> (state, metrics), with grad accumulation over a scan.

    On a layout with more than one replica (mesh.across_domains=zero1 over several
    domains) the gradients come from the two-tier step; params and optimizer state are
    then on ZeRO-1 shardings (`maxmoe.training.programs`).
    """
    two_tier = layout is not None and layout.replicas > 1
    grads_fn = _two_tier_grads(config, layout) if two_tier else _accumulated_grads(config, layout)

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
