"""Rotary position embedding with YaRN context extension, as in the DeepSeek-V3 release.

Rotary dimensions are paired as adjacent elements (x[2i], x[2i+1]) rotated by the i-th
frequency: the complex-number convention of the DeepSeek-V3 reference code. (Hugging Face
reaches the same scores by permuting q and k alike with `rope_interleave`.)

YaRN (Peng et al. 2023) with the release's `rope_scaling` keys: frequencies whose
wavelength exceeds the original context (below `beta_slow` rotations) are interpolated by
`factor`, those above `beta_fast` rotations are kept, with a linear ramp in between.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, original_max_position: int) -> float:
    """The rotary dimension index whose frequency makes `rotations` turns over the original context."""
    return dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(model) -> np.ndarray:
    """Per-pair inverse frequencies [R/2] (float64 numpy), YaRN-corrected when rope_scaling='yarn'."""
    dim, base = model.qk_rope_head_dim, model.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if model.rope_scaling != "yarn":
        return freqs
    low = math.floor(_correction_dim(model.rope_beta_fast, dim, base, model.rope_original_max_position))
    high = math.ceil(_correction_dim(model.rope_beta_slow, dim, base, model.rope_original_max_position))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-zero width
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency, kept), 0: interpolate by factor
    return freqs / model.rope_factor * (1.0 - keep) + freqs * keep


def attention_scale(model) -> float:
    """Softmax scale: 1/sqrt(qk_nope + qk_rope), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (model.qk_nope_head_dim + model.qk_rope_head_dim) ** -0.5
    if model.rope_scaling == "yarn" and model.rope_mscale_all_dim:
        scale *= yarn_mscale(model.rope_factor, model.rope_mscale_all_dim) ** 2
    return scale


def rotary_magnitude(model) -> float:
    """YaRN's factor on cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim); 1 without YaRN."""
    if model.rope_scaling != "yarn":
        return 1.0
    return yarn_mscale(model.rope_factor, model.rope_mscale) / yarn_mscale(model.rope_factor, model.rope_mscale_all_dim)


def apply_rope(x_BTHR, positions_BT, model):
    """Rotate adjacent pairs of the last axis of x [B, T, H, R] by position x frequency."""
    inv_freq = jnp.asarray(inverse_frequencies(model), jnp.float32)
    angles_BTP = positions_BT.astype(jnp.float32)[..., None] * inv_freq
    magnitude = rotary_magnitude(model)
    cos = (jnp.cos(angles_BTP) * magnitude)[:, :, None, :]
    sin = (jnp.sin(angles_BTP) * magnitude)[:, :, None, :]
    xf = x_BTHR.astype(jnp.float32)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x_BTHR.shape).astype(x_BTHR.dtype)
