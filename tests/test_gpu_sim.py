"""The programs a GPU process builds, proven on CPU: initialisation never runs a kernel, and under
a simulated H200 (sm_90) and B200 (sm_100) process (tests/simulated_gpu.py) the train and eval
programs of the GPU suite's variants and of configs/proxy_1gpu.yaml build, initialise
abstractly and lower for CUDA with the kernels `auto` picks there.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import load_config
from maxmoe.kernels import attention as attention_kernels
from maxmoe.model.transformer import abstract_variables, init_variables, logits

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/tiny.yaml")


def tiny_model(*overrides):
    return load_config([TINY], ["model.num_layers=2", "model.mtp_num_layers=0", *overrides]).model


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Every attention kernel call, by name and sequence length; the kernels still run (interpreted)."""
    calls = []
    for name in attention_kernels.KERNELS:
        real = getattr(attention_kernels, f"{name}_attention")

        def record(q, k, v, scale, *, interpret=False, _name=name, _real=real):
            calls.append((_name, q.shape[1]))
            return _real(q, k, v, scale, interpret=interpret)

        monkeypatch.setattr(attention_kernels, f"{name}_attention", record)
    return calls


@pytest.mark.smoke
def test_initialisation_runs_no_attention_kernel(kernel_calls):
    """The 8-token probe that creates the variables uses the xla core: the same variables as with
    `xla` for every kernel, even ones that cannot run on this host (cudnn, tokamax)."""
    expected = abstract_variables(tiny_model("model.attention=xla"))
    for attention in attention_kernels.KERNELS:
        got = abstract_variables(tiny_model(f"model.attention={attention}"))
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        assert jax.tree.leaves(got) == jax.tree.leaves(expected)
    assert kernel_calls == []


@pytest.mark.smoke
def test_logits_on_a_length_the_kernel_cannot_take_fall_back_to_xla_and_say_so(kernel_calls):
    """Triton takes lengths divisible by 16: at 8 tokens logits() runs xla (with a warning) and
    equals the xla model; at 16 tokens the kernel is what runs (traced only: its values against
    xla are test_kernels' business)."""
    model = tiny_model("model.attention=triton")
    variables = jax.jit(init_variables, static_argnums=0)(model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, model.vocab_size)
    oracle = jax.jit(lambda v, t: logits(tiny_model("model.attention=xla"), v, t))(variables, tokens)
    run = jax.jit(lambda v, t: logits(model, v, t))
    with pytest.warns(UserWarning, match="divisible by 16; got 8"):
        short = run(variables, tokens[:, :8])
    assert kernel_calls == []
    np.testing.assert_allclose(short, oracle[:, :8], rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a length the kernel takes: no fallback, no warning
        full = jax.eval_shape(run, variables, tokens)
    assert kernel_calls and set(kernel_calls) == {("triton", 16)}
    assert (full.shape, full.dtype) == (oracle.shape, jnp.float32)


def test_an_unpadded_buffer_builds_one_forward_kernel_per_gemm():
    """padded=False (one device: every row in a group) traces the forward and dx kernels once each,
    on the whole buffer, instead of once per row bucket; values and gradients equal XLA's."""
    from maxmoe.kernels import mosaic_ragged_dot
    from maxmoe.kernels.grouped_matmul import grouped_matmul

    built = []

    def forward(x_MK, w, sizes_G, transpose_rhs=False):
        built.append((x_MK.shape[0], transpose_rhs))
        w_GKN = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        return jax.lax.ragged_dot(x_MK, w_GKN, sizes_G).astype(x_MK.dtype)

    def weight_grad(x_MK, dy_MN, sizes_G):
        return jax.lax.ragged_dot_general(
            x_MK,
            dy_MN,
            sizes_G,
            jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
            ),
        )

    fn = mosaic_ragged_dot.make_grouped_matmul(mosaic_ragged_dot.Kernels(forward, weight_grad))
    x, w = jax.random.normal(jax.random.key(0), (384, 64)), jax.random.normal(jax.random.key(1), (3, 64, 32))
    sizes = jnp.array([100, 0, 284], jnp.int32)

    def loss(fn, x, w):
        return jnp.sum(jnp.sin(fn(x, w)))

    got = jax.jit(jax.value_and_grad(lambda x, w: loss(lambda x, w: fn(x, w, sizes, 1), x, w), argnums=(0, 1)))(x, w)
    assert built == [(384, False), (384, True)]
    built.clear()
    jax.eval_shape(lambda x, w: jax.grad(lambda x, w: loss(lambda x, w: fn(x, w, sizes), x, w))(x, w), x, w)
    assert sorted({rows for rows, _ in built}) == [128, 256, 384]  # padded: one kernel per bucket
    oracle = jax.value_and_grad(
        lambda x, w: loss(lambda x, w: grouped_matmul(x, w, sizes, backend="dense_loop"), x, w), argnums=(0, 1)
    )(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(oracle)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
