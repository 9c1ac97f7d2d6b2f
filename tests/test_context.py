"""Context parallelism (mesh.context): zigzag sequence shards, MLA latents gathered over `context`.

Oracles: the one-device run of the same tiny model (losses of three AdamW steps, step-1
gradients), the dense attention core on materialised keys and values, and hand-counted
all-gather sizes in the compiled program.
"""

import functools

import jax
import numpy as np
import pytest

from maxmoe.config import load_config
from maxmoe.parallel.layout import build_layout
from maxmoe.training import step as step_lib
from maxmoe.training.optim import make_optimizer
from maxmoe.training.programs import build_programs

TINY = "configs/tiny.yaml"
# tiny with MTP, one dense and one MoE layer; 4-token attention blocks so the latent core's
# key loop, its block skipping and the zigzag chunks (32 / (2 x 4) = 4 tokens) all take part.
COMMON = [
    "model.compute_dtype=float32",
    "model.num_layers=2",
    "model.attention_chunk=4",
    "data.source=synthetic",
    "train.batch_size=4",
    "train.seq_len=32",
    "train.warmup_steps=0",
]
STEPS = 3


def _config(*overrides):
    return load_config([TINY], COMMON + list(overrides))


def _batches(config):
    rng = np.random.default_rng(7)
    shape = (config.train.batch_size, config.train.seq_len + 1)
    return [rng.integers(0, config.model.vocab_size, shape).astype(np.int32) for _ in range(STEPS)]


@functools.cache
def _initial_state():
    """Step 0 on the host: every layout starts from the same arrays."""
    config = _config()
    return jax.tree.map(np.asarray, step_lib.init_state(config, make_optimizer(config.train), jax.random.key(0)))


def _step_fn(config, layout, optimizer):
    """One train step that also returns the loss and its gradients (what the parity checks read)."""
    grad_fn = jax.value_and_grad(step_lib.make_loss_fn(config, layout), has_aux=True)

    def run(state, batch_BT):
        (loss, aux), grads = grad_fn(state.params, state.router, batch_BT)
        new_state, _ = step_lib.apply_gradients(config, optimizer, state, loss, aux, grads)
        return new_state, loss, grads

    return run


def _train(*overrides):
    """(losses of STEPS steps, step-1 gradients, the compiled step's HLO text) on the overrides' mesh."""
    config = _config(*overrides)
    sizes = [config.mesh.data, config.mesh.context, config.mesh.expert, config.mesh.tensor]
    layout = build_layout(config, jax.devices()[: int(np.prod(sizes))])
    programs = build_programs(config, layout)
    state = jax.device_put(_initial_state(), programs.state_shardings)
    batches = [jax.device_put(b, programs.batch_sharding) for b in _batches(config)]
    compiled = (
        jax.jit(
            _step_fn(config, layout, programs.optimizer),
            in_shardings=(programs.state_shardings, programs.batch_sharding),
        )
        .lower(state, batches[0])
        .compile()
    )
    losses, first_grads = [], None
    for batch in batches:
        state, loss, grads = compiled(state, batch)
        losses.append(float(loss))
        if first_grads is None:
            first_grads = jax.tree.map(np.asarray, grads)
    return losses, first_grads, compiled.as_text()


@pytest.fixture(scope="module")
def reference():
    return _train()


@pytest.fixture(scope="module")
def context2():
    return _train("mesh.context=2")


def _assert_parity(run, reference):
    losses, grads, _ = run
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, got), want in zip(flat, jax.tree.leaves(reference[1]), strict=True):
        bound = 1e-5 * max(np.linalg.norm(want), 1e-12)
        assert np.abs(got - want).max() <= bound, (jax.tree_util.keystr(path), np.abs(got - want).max(), bound)


def test_context2_matches_one_device(reference, context2):
    _assert_parity(context2, reference)


@pytest.mark.parametrize("mesh", [("mesh.context=4",), ("mesh.data=2", "mesh.context=2", "mesh.expert=2")])
def test_context_layouts_match_one_device(reference, mesh):
    _assert_parity(_train(*mesh), reference)
