"""The train and eval steps with mesh.pipeline > 1: the micro-batch loop becomes the pipeline schedule.

    train_step(state, batch) -> (state, metrics)      as maxmoe.training.step, same metrics

The state's `moe_layers` leaves are in the stage layout (maxmoe.training.stage_state). The other
parameters (embedding, dense layers, head, MTP), which every stage computes with, keep master
weights and Adam moments ZeRO-1 over the stages (maxmoe.training.programs): once per step their
compute-dtype copy is gathered across the stages and their gradients, summed per stage by the
schedule, reduce-scattered back (maxmoe.parallel.replicas.compute_copy / reduce_to_zero1 over
`pipeline`). The train.grad_accum micro-batches (strided: maxmoe.training.accumulate.micro_batches)
run through maxmoe.parallel.pipeline's circular 1F1B schedule; loss, gradients and statistics are
the micro-batch scan's (mean over micro-batches of lm + mtp_loss_weight x mtp + seq_aux_alpha x
seq_aux, loads summed, other statistics averaged); step.apply_gradients then updates the state.

docs/SHARDING.md, "Pipeline stages" has where each piece runs and why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxmoe.config import Config
from maxmoe.model import stages
from maxmoe.model.transformer import abstract_variables
from maxmoe.parallel import replicas
from maxmoe.parallel.pipeline import AXIS, PipelineFns, pipeline_forward, pipeline_value_and_grad
from maxmoe.parallel.pipeline_schedule import build_schedule
from maxmoe.training import stage_state
from maxmoe.training.accumulate import micro_batches, weight_copy
from maxmoe.training.objective import make_output_loss, mean_stats
from maxmoe.training.step import TrainState, apply_gradients


def make_fns(config: Config, layout: Any, *, train: bool = True) -> PipelineFns:
    """The model's pre / chunk / post (and MTP as the tail) for the pipeline; post and tail
    compute the training loss's terms (train=True: post the next-token loss, the tail
    mtp_loss_weight x the MTP losses and MTP's seq_aux term), or post the next-token loss alone
    (evaluation)."""
    m = config.model
    hidden_only = config.train.loss_chunk > 0
    first = stages.make_first(m, layout)
    head = stages.make_head(m, layout, hidden_only=hidden_only)
    mtp = stages.make_mtp(m, layout, hidden_only=hidden_only)
    with_tail = train and m.mtp_num_layers > 0

    def pre(outer, outer_state, batch_BT):
        del outer_state
        return first(outer, batch_BT[:, :-1])

    def post(outer, outer_state, h_BTD, batch_BT):
        tokens, targets = batch_BT[:, :-1], batch_BT[:, 1:]
        output_loss = make_output_loss(config, layout.on_context_mesh())
        loss, aux = output_loss(outer["head"], head(outer, outer_state, h_BTD, tokens), [], targets, {})
        if not train:
            return aux["lm_loss"], {}
        if with_tail:  # the tail's statistics, zero here: the two are summed
            shapes = jax.eval_shape(lambda: mtp(outer, outer_state, h_BTD, tokens)[1])
            aux["moe_stats"] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return loss, aux

    def tail(outer, outer_state, h_BTD, batch_BT):
        tokens, targets = batch_BT[:, :-1], batch_BT[:, 1:]
        output_loss = make_output_loss(config, layout.on_context_mesh())
        depths, stats = mtp(outer, outer_state, h_BTD, tokens)
        return output_loss(outer["head"], None, depths, targets, stats)

    return PipelineFns(
        pre,
        stages.make_chunk(m, layout),
        post,
        aux_weight=config.moe.seq_aux_alpha,
        shared=(stages.DENSE,) if m.first_k_dense else (),
        tail=tail if with_tail else None,
    )


def _schedule(config: Config, fns: PipelineFns):
    m = config.mesh
    return build_schedule(m.pipeline, m.pipeline_virtual, config.train.grad_accum, 1 if fns.tail is None else 2)


def _stage_inputs(config: Config, params: dict, router: dict):
    stack, outer = stages.split_stack(params)
    stack_router, outer_state = stages.split_stack(router)
    slots = stage_state.slot_layout(config)
    state = {"router": stack_router, "mask": jnp.asarray(slots.mask()), "dense": jnp.asarray(slots.dense_at())}
    return stack, state, outer, outer_state


def _outer_weights(config: Config, layout: Any):
    """The outer parameters' (copy, zero1, in_stage): their master weights are ZeRO-1 over
    stage_state.OUTER_ZERO1, the copy every stage runs with is gathered over `pipeline`."""
    _, boxed = stages.split_stack(abstract_variables(config.model, boxed=True)["params"])
    return weight_copy(config, layout, boxed, over=stage_state.OUTER_ZERO1, axis=AXIS)


def make_pipeline_train_step(config: Config, optimizer: optax.GradientTransformation, layout: Any) -> Callable:
    """train_step(state, batch) -> (state, metrics) through the pipeline schedule."""
    accum = config.train.grad_accum
    fns = make_fns(config, layout)
    grad_fn = pipeline_value_and_grad(
        fns, _schedule(config, fns), layout.mesh, residuals=config.train.pipeline_residuals
    )
    outer_copy, outer_zero1, _ = _outer_weights(config, layout)

    def model_order(tree):
        return stage_state.to_model(config, tree)

    def train_step(state: TrainState, batch_BT: jax.Array):
        stack, stack_state, outer, outer_state = _stage_inputs(config, state.params, state.router)
        micro = micro_batches(batch_BT, accum)
        loss, (g_stack, g_outer_P), (stats, post) = grad_fn(stack, stack_state, outer_copy(outer), outer_state, micro)
        g_outer = replicas.reduce_to_zero1(g_outer_P, outer_zero1, 1.0, axis=AXIS)
        grads = {**g_outer, stages.STACK: g_stack}
        # post: the losses and the MTP depths' statistics (post's and the tail's); stats: every slot's, [V, P, S, ...].
        seq_aux = post["seq_aux"] + stats["moe"]["router"]["seq_aux"].sum()
        aux = {"lm_loss": post["lm_loss"], "mtp_loss": post["mtp_loss"], "seq_aux": seq_aux}
        aux["moe_stats"] = {**post["moe_stats"], stages.STACK: stats}
        return apply_gradients(config, optimizer, state, loss, mean_stats(aux, accum), grads, model_order)

    train_step.pipeline_info = grad_fn.info  # ring size, once traced
    return train_step


def make_pipeline_eval_step(config: Config, layout: Any) -> Callable:
    """eval_step(params, router, batch) -> next-token loss, through the forward ticks of the schedule."""
    accum = config.train.grad_accum
    fns = make_fns(config, layout, train=False)
    run = pipeline_forward(fns, _schedule(config, fns), layout.mesh)
    outer_copy, _, _ = _outer_weights(config, layout)

    def eval_step(params, router, batch_BT):
        stack, stack_state, outer, outer_state = _stage_inputs(config, params, router)
        return run(stack, stack_state, outer_copy(outer), outer_state, micro_batches(batch_BT, accum))[0]

    return eval_step
