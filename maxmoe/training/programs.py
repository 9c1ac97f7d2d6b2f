"""The sharded, jitted programs of a run: state init, train step, eval step.

One place decides how state and batches are laid out on the mesh, so the train loop,
the CUDA lowering, the mesh sweep and the benchmarks compile the same program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxmoe.config import Config
from maxmoe.training import pipeline_step, stage_state
from maxmoe.training import step as step_lib
from maxmoe.training.optim import make_optimizer


@dataclasses.dataclass(frozen=True)
class Programs:
    """Shardings and jitted functions for one config on one layout."""

    state_shardings: Any  # TrainState of NamedShardings
    abstract_state: Any  # TrainState of ShapeDtypeStructs carrying those shardings
    batch_sharding: Any
    init: Callable  # init(rng) -> state
    train_step: Callable  # train_step(state, batch) -> (state, metrics); donates state
    eval_step: Callable  # eval_step(params, router, batch) -> lm loss
    optimizer: Any

    def abstract_batch(self, config: Config) -> jax.ShapeDtypeStruct:
        """The global batch's shape, for ahead-of-time lowering."""
        return jax.ShapeDtypeStruct(
            (config.train.batch_size, config.train.seq_len + 1), jnp.int32, sharding=self.batch_sharding
        )


def build_programs(config: Config, layout) -> Programs:
    """State shardings from the parameters' logical axes; step functions jitted with them.

    With pipeline stages the layer stack lives in the stage layout (maxmoe.training.stage_state):
    init builds model order and re-lays it inside the same program; the other parameters'
    master weights and optimizer state are sharded over the stages too. With more than one replica
    (mesh.across_domains=zero1) params and optimizer state sit on ZeRO-1 shardings (sharded
    over every device); the state's tree, shapes and dtypes do not change, so checkpoints
    restore across the two modes.
    """
    optimizer = make_optimizer(config.train)
    boxed = step_lib.abstract_state(config, optimizer, boxed=True)
    shardings = layout.tree_shardings(boxed)
    if layout.replicas > 1:
        shardings = shardings.replace(
            params=layout.zero1_shardings(boxed.params), opt_state=layout.zero1_shardings(boxed.opt_state)
        )
    # With stages, the parameters outside the layer stack are on every stage: their master
    # weights and moments are ZeRO-1 over the stages, gathered once per step (pipeline_step).
    outer = None
    if layout.stages > 1:
        outer = shardings.replace(
            params=stage_state.outer_shardings(layout, boxed.params),
            opt_state=stage_state.outer_shardings(layout, boxed.opt_state),
        )
    shardings = stage_state.stage_shardings(config, shardings, outer)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        stage_state.stage_abstract(config, nn.unbox(boxed)),
        shardings,
    )
    layout.check_array("the token batch", ("batch", None), (config.train.batch_size, config.train.seq_len + 1))
    batch_sharding = layout.batch_sharding()
    init = jax.jit(
        lambda key: stage_state.to_stages(config, step_lib.init_state(config, optimizer, key)), out_shardings=shardings
    )
    if layout.stages > 1:
        train_fn = pipeline_step.make_pipeline_train_step(config, optimizer, layout)
        eval_fn = pipeline_step.make_pipeline_eval_step(config, layout)
    else:
        train_fn = step_lib.make_train_step(config, optimizer, layout)
        eval_fn = step_lib.make_eval_step(config, layout)
    train_step = jax.jit(
        train_fn, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None), donate_argnums=0
    )
    eval_step = jax.jit(eval_fn, in_shardings=(shardings.params, shardings.router, batch_sharding))
    return Programs(shardings, abstract, batch_sharding, init, train_step, eval_step, optimizer)
