"""Remat policies, batch-split dispatch and chunked all-to-alls compute what the plain program computes.

Oracle: the same model with model.remat=none, moe.overlap=none, moe.a2a_chunks=1, on the
same 2 x 4 mesh of fake CPU devices (that program is itself tested against one device and
the loop-over-experts MoE elsewhere). float32; every strategy dropless at these shapes
(capacity gets a factor that fits every copy, and the test checks nothing was dropped).
Each strategy's variants are compiled as one program, so the forward pass and the XLA
pipeline are shared.
"""

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import DISPATCH_STRATEGIES, load_config
from maxmoe.model.transformer import build_model, init_variables
from maxmoe.parallel.layout import build_layout
from maxmoe.parallel.names import REMAT_CHOICES

pytestmark = pytest.mark.slow  # one compiled fixture per dispatch strategy

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")

COMMON = [
    "model.compute_dtype=float32",
    "model.num_layers=2",
    "model.first_k_dense=0",
    "model.mtp_num_layers=0",
    "train.batch_size=8",
    "train.seq_len=16",
    "mesh.data=2",
    "mesh.expert=4",
    "moe.capacity_factor=8.0",
]
# Every remat policy and batch_split for every strategy; ragged_a2a also alone and with chunks.
# The other strategies pair batch_split with two policies, one program fewer each.
RAGGED_VARIANTS = {f"model.remat={policy}": [f"model.remat={policy}"] for policy in REMAT_CHOICES if policy != "none"}
RAGGED_VARIANTS.update(
    {
        "moe.overlap=batch_split": ["moe.overlap=batch_split"],
        "moe.a2a_chunks=3": ["moe.a2a_chunks=3"],
        "batch_split + a2a_chunks=2 + save_comm": [
            "moe.overlap=batch_split",
            "moe.a2a_chunks=2",
            "model.remat=save_comm",
        ],
    }
)
OTHER_VARIANTS = {
    "full + batch_split": ["model.remat=full", "moe.overlap=batch_split"],
    "save_matmuls": ["model.remat=save_matmuls"],
    "save_comm": ["model.remat=save_comm"],
    "save_moe + batch_split": ["model.remat=save_moe", "moe.overlap=batch_split"],
    "save_dots_comm": ["model.remat=save_dots_comm"],
}
# Fast XLA:CPU codegen: the values are the same, the compile is several times shorter.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
# The variants sum the same products in other orders (halves, recomputation); measured
# differences are ~2e-8 on gradients of ~1e-1, so 1e-5 relative leaves a wide margin.
TOLERANCE = 1e-5


def loss_and_grads(overrides, variables, tokens_BT):
    """value_and_grad of the next-token loss of the model `overrides` configure, and its dropped fraction."""
    config = load_config([TINY], COMMON + overrides)
    model = build_model(config.model, build_layout(config, jax.devices()[:8]))

    def loss(params):
        (logits_BTV, _), stats = model.apply(
            {"params": params, "router": variables["router"]}, tokens_BT[:, :-1], mutable=["moe_stats"]
        )
        log_probs = jax.nn.log_softmax(logits_BTV)
        nll = -jnp.take_along_axis(log_probs, tokens_BT[:, 1:, None], axis=-1).mean()
        dropped = jnp.max(
            jnp.stack([jnp.max(x) for path, x in jax.tree_util.tree_leaves_with_path(stats) if "dropped" in str(path)])
        )
        return nll, dropped

    (value, dropped), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
    return value, grads, dropped


@pytest.fixture(scope="module", params=DISPATCH_STRATEGIES)
def strategy_results(request):
    """{variant: (loss, grads, dropped)} for one strategy, every variant in one compiled program."""
    strategy = request.param
    variants = {"plain": [], **(RAGGED_VARIANTS if strategy == "ragged_a2a" else OTHER_VARIANTS)}
    config = load_config([TINY], COMMON)
    variables = nn.unbox(init_variables(config.model, jax.random.key(0)))
    tokens_BT = jnp.asarray(np.random.default_rng(3).integers(0, config.model.vocab_size, (8, 17)), jnp.int32)

    def all_variants(variables, tokens_BT):
        return {
            name: loss_and_grads([f"moe.dispatch={strategy}"] + overrides, variables, tokens_BT)
            for name, overrides in variants.items()
        }

    compiled = jax.jit(all_variants).trace(variables, tokens_BT).lower().compile(compiler_options=FAST_COMPILE)
    return strategy, jax.tree.map(np.asarray, compiled(variables, tokens_BT))


def test_variants_match_the_plain_program(strategy_results):
    strategy, results = strategy_results
    loss0, grads0, dropped0 = results.pop("plain")
    assert dropped0 == 0.0
    assert set(results) == set(RAGGED_VARIANTS if strategy == "ragged_a2a" else OTHER_VARIANTS)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads0))
    for name, (loss, grads, dropped) in results.items():
        assert dropped == 0.0, (strategy, name)
        np.testing.assert_allclose(loss, loss0, rtol=TOLERANCE, err_msg=f"{strategy} {name}")
        for path, g, g0 in zip(
            jax.tree_util.tree_leaves_with_path(grads0), jax.tree.leaves(grads), jax.tree.leaves(grads0)
        ):
            np.testing.assert_allclose(g, g0, rtol=0, atol=TOLERANCE * scale, err_msg=f"{strategy} {name} {path[0]}")


@pytest.mark.parametrize("variants", [RAGGED_VARIANTS, OTHER_VARIANTS], ids=["ragged_a2a", "others"])
def test_every_policy_and_batch_split_is_covered(variants):
    overrides = {o for v in variants.values() for o in v}
    assert {f"model.remat={p}" for p in REMAT_CHOICES if p != "none"} <= overrides
    assert "moe.overlap=batch_split" in overrides
