"""FP8 block dequantisation against a per-element loop, and a quantise round trip."""

import ml_dtypes
import numpy as np
import pytest

from maxmoe.convert.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise, scale_grid_shape

SHAPES = [(256, 384), (200, 130), (7, 300), (128, 128), (1, 1)]


def loop_dequantize(weight_e4m3, scale_inv, block=(128, 128)):
    """Reference: out[i, j] = w[i, j] * s[i // block_rows, j // block_cols], one element at a time."""
    rows, cols = weight_e4m3.shape
    out = np.empty((rows, cols), dtype=np.float32)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = np.float32(weight_e4m3[i, j]) * scale_inv[i // block[0], j // block[1]]
    return out


def random_fp8(shape, block, seed):
    """Random finite e4m3 values (all magnitudes, both signs) and positive per-block scales."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 50.0, size=shape).astype(np.float32)
    weight = np.clip(values, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(1e-4, 2.0, size=scale_grid_shape(shape, block)).astype(np.float32)
    return weight, scale_inv


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_matches_loop(shape):
    weight, scale_inv = random_fp8(shape, (128, 128), seed=sum(shape))
    expected = loop_dequantize(weight, scale_inv)
    got = dequantize_fp8_blockwise(weight, scale_inv)
    assert got.dtype == np.float32 and got.shape == shape
    # Both compute one float32 product per element: bit-identical.
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_uint8_bytes(shape):
    weight, scale_inv = random_fp8(shape, (128, 128), seed=1 + sum(shape))
    raw = weight.view(np.uint8)
    np.testing.assert_array_equal(dequantize_fp8_blockwise(raw, scale_inv), loop_dequantize(weight, scale_inv))


def test_dequantize_other_block_and_dtype():
    block = (16, 32)
    weight, scale_inv = random_fp8((40, 70), block, seed=3)
    expected = loop_dequantize(weight, scale_inv, block)
    np.testing.assert_array_equal(dequantize_fp8_blockwise(weight, scale_inv, block=block), expected)
    as_bf16 = dequantize_fp8_blockwise(weight, scale_inv, block=block, dtype=ml_dtypes.bfloat16)
    assert as_bf16.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(as_bf16, expected.astype(ml_dtypes.bfloat16))


def test_dequantize_rejects_bad_input():
    weight, scale_inv = random_fp8((200, 130), (128, 128), seed=4)
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequantize_fp8_blockwise(weight, scale_inv[:1])
    with pytest.raises(TypeError, match="float8_e4m3fn or uint8"):
        dequantize_fp8_blockwise(weight.astype(np.float32), scale_inv)
    with pytest.raises(ValueError, match="2-D"):
        dequantize_fp8_blockwise(weight[0], scale_inv)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (7, 300)])
def test_quantize_dequantize_round_trip(shape):
    rng = np.random.default_rng(sum(shape))
    # Blocks of very different magnitudes, so per-block scaling matters.
    weight = rng.normal(size=shape).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 3, size=(shape[0], 1))
    quantized, scale_inv = quantize_fp8_blockwise(weight)
    assert quantized.dtype == ml_dtypes.float8_e4m3fn
    assert scale_inv.dtype == np.float32 and scale_inv.shape == scale_grid_shape(shape)
    assert np.isfinite(quantized.astype(np.float32)).all()
    restored = dequantize_fp8_blockwise(quantized, scale_inv)
    # e4m3: 3 mantissa bits, so round-to-nearest is within 2**-4 relative for normal values;
    # below the smallest normal (2**-6 in scaled units) the spacing is 2**-9, half of it absolute.
    # The 1e-6 terms absorb the float32 rounding of the divide and multiply.
    element_scale = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[: shape[0], : shape[1]]
    bound = np.maximum(np.abs(weight) * 2.0**-4, element_scale * 2.0**-10) * (1 + 1e-6) + np.abs(weight) * 1e-6
    assert (np.abs(restored - weight) <= bound).all()
    # Each block's largest magnitude lands on e4m3's largest value, 448.
    assert np.abs(quantized.astype(np.float32)).max() == 448.0


def test_quantize_zero_block_gets_unit_scale():
    weight = np.zeros((130, 10), dtype=np.float32)
    weight[129, 3] = -2.0
    quantized, scale_inv = quantize_fp8_blockwise(weight)
    np.testing.assert_array_equal(scale_inv, np.array([[1.0], [2.0 / 448.0]], dtype=np.float32))
    np.testing.assert_array_equal(dequantize_fp8_blockwise(quantized, scale_inv), weight)
