"""The dry run's f16 stand-in for bf16 (maxmoe.analysis.half_width)."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.analysis.half_width import bf16_dots_widened, compile_half_width, f16_text

LAYERS, TOKENS, D, F = 8, 512, 256, 1024


def test_only_bf16_element_types_are_rewritten():
    text = (
        'func.func @scale_bf16(%arg0: tensor<4x8xbf16> loc("bf16 input"), %arg1: tensor<bf16>) -> tensor<4x8xf32> {\n'
        "  %0 = stablehlo.convert %arg0 : (tensor<4x8xbf16>) -> tensor<4x8xf8E4M3FN>\n"
        '  %1 = stablehlo.custom_call @bf16_kernel(%0) {name = "xbf16x"} : (tensor<4x8xf8E4M3FN>) -> tensor<4x8xf32>\n'
    )
    expected = (
        'func.func @scale_bf16(%arg0: tensor<4x8xf16> loc("bf16 input"), %arg1: tensor<f16>) -> tensor<4x8xf32> {\n'
        "  %0 = stablehlo.convert %arg0 : (tensor<4x8xf16>) -> tensor<4x8xf8E4M3FN>\n"
        '  %1 = stablehlo.custom_call @bf16_kernel(%0) {name = "xbf16x"} : (tensor<4x8xf8E4M3FN>) -> tensor<4x8xf32>\n'
    )
    assert f16_text(text) == (expected, 3)


def _layer(x, w):
    w_in, w_out = w
    h = checkpoint_name(jnp.dot(x, w_in), "h")
    return x + jnp.dot(jax.nn.silu(h), w_out), None


def _loss(ws, x):
    policy = jax.checkpoint_policies.save_only_these_names("h")
    y, _ = jax.lax.scan(jax.checkpoint(_layer, policy=policy), x, ws)
    return jnp.sum(y.astype(jnp.float32) ** 2)


def _lowered(dtype):
    ws = (jnp.zeros((LAYERS, D, F), dtype), jnp.zeros((LAYERS, F, D), dtype))
    return jax.jit(jax.grad(_loss)).lower(ws, jnp.zeros((TOKENS, D), dtype))


def test_a_bf16_layer_scan_compiles_without_f32_copies_of_its_stacks():
    """A layer scan saving a bf16 residual per layer: the dry run's compile needs no more than the
    same program written in f16 (the oracle), and less than the saved stack with an f32 copy of
    it beside (which XLA:CPU's own bf16 program holds where it widens bf16 dots)."""
    half, replaced = compile_half_width(_lowered(jnp.bfloat16))
    assert (replaced > 0) == bf16_dots_widened()
    temp = half.memory_analysis().temp_size_in_bytes
    assert temp <= _lowered(jnp.float16).compile().memory_analysis().temp_size_in_bytes
    stack = LAYERS * TOKENS * F * 2
    assert stack <= temp < 3 * stack
    if bf16_dots_widened():
        assert _lowered(jnp.bfloat16).compile().memory_analysis().temp_size_in_bytes >= 3 * stack


def test_a_program_without_bf16_compiles_as_lowered():
    lowered = _lowered(jnp.float32)
    compiled, replaced = compile_half_width(lowered)
    assert replaced == 0
    plain = _lowered(jnp.float32).compile().memory_analysis()
    assert compiled.memory_analysis().temp_size_in_bytes == plain.temp_size_in_bytes
