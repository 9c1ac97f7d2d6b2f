"""FP8 block-scaled weights as stored in the DeepSeek-V3 release.

Each linear weight `W` [out, in] is stored as float8_e4m3fn next to `W_scale_inv`, float32
[ceil(out/128), ceil(in/128)]: one scale per 128 x 128 block, edge blocks partial. The real
weight is `W.astype(f32) * scale_inv[i // 128, j // 128]` (the name says "inverse" because
the quantiser divided by it). NumPy only, with ml_dtypes (a jax dependency) for the float8 type.
"""

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448.0
DEFAULT_BLOCK = (128, 128)


def _as_e4m3(weight: np.ndarray) -> np.ndarray:
    """The weight as float8_e4m3fn; raw uint8 bytes (e.g. read without a float8 dtype) are viewed."""
    weight = np.asarray(weight)
    if weight.dtype == np.uint8:
        return weight.view(E4M3)
    if weight.dtype != E4M3:
        raise TypeError(f"fp8 weight must be float8_e4m3fn or uint8 bytes, got dtype {weight.dtype}")
    return weight


def scale_grid_shape(shape: tuple[int, int], block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of the per-block scale array for a weight of `shape`: ceil division per axis."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_fp8_blockwise(
    weight_e4m3: np.ndarray,
    scale_inv: np.ndarray,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype=np.float32,
) -> np.ndarray:
    """Dequantise a block-scaled fp8 weight [out, in] to `dtype`.

    `weight_e4m3` is float8_e4m3fn or its uint8 bytes; `scale_inv` has one float per
    `block` (rows, cols) tile. The product is formed in float32 and then cast to `dtype`.
    """
    weight = _as_e4m3(weight_e4m3)
    if weight.ndim != 2:
        raise ValueError(f"fp8 weight must be 2-D [out, in], got shape {weight.shape}")
    scale_inv = np.asarray(scale_inv, dtype=np.float32)
    expected = scale_grid_shape(weight.shape, block)
    if scale_inv.shape != expected:
        raise ValueError(
            f"scale_inv shape {scale_inv.shape} does not match weight {weight.shape} "
            f"in {block[0]}x{block[1]} blocks: expected {expected}"
        )
    rows, cols = weight.shape
    block_rows, block_cols = block
    out = np.empty((rows, cols), dtype=dtype)
    # One band of block rows at a time keeps the float32 temporaries small for big matrices.
    for band, row in enumerate(range(0, rows, block_rows)):
        scale_row = np.repeat(scale_inv[band], block_cols)[:cols]
        band_weight = weight[row : row + block_rows].astype(np.float32)
        out[row : row + block_rows] = (band_weight * scale_row).astype(dtype)
    return out


def quantize_fp8_blockwise(weight: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a 2-D weight to (float8_e4m3fn weight, float32 scale_inv), scale = block amax / 448.

    The release's recipe, used here to make test data. An all-zero block gets scale 1.
    """
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {weight.shape}")
    rows, cols = weight.shape
    block_rows, block_cols = block
    grid_rows, grid_cols = scale_grid_shape(weight.shape, block)
    padded = np.zeros((grid_rows * block_rows, grid_cols * block_cols), dtype=np.float32)
    padded[:rows, :cols] = weight
    tiles = padded.reshape(grid_rows, block_rows, grid_cols, block_cols)
    amax = np.abs(tiles).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    scaled = tiles / scale_inv[:, None, :, None]
    # Division can round a hair past 448, and e4m3fn has no infinity: past max it becomes NaN.
    scaled = np.clip(scaled, -E4M3_MAX, E4M3_MAX)
    quantized = scaled.reshape(padded.shape)[:rows, :cols].astype(E4M3)
    return quantized, scale_inv
