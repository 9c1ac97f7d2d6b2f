"""RoPE + YaRN against formulas written out here from the DeepSeek-V3 release (model.py:
`precompute_freqs_cis`, `find_correction_dim`, `find_correction_range`, `linear_ramp_factor`,
`apply_rotary_emb`) and complex multiplication in NumPy."""

import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import ModelConfig, load_config
from maxmoe.model.rope import apply_rope, attention_scale, inverse_frequencies, rotary_magnitude, yarn_mscale

REPO = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-5, atol=1e-5)


def reference_yarn_frequencies(dim, base, factor, original, beta_fast, beta_slow):
    """The release's YaRN frequencies, one line per step of its code."""
    plain = np.array([1.0 / base ** (2 * i / dim) for i in range(dim // 2)])

    def correction(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(beta_fast)), 0)
    high = min(math.ceil(correction(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.array([min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)])
    smooth = 1.0 - ramp
    return plain / factor * (1 - smooth) + plain * smooth


def v3_671b() -> ModelConfig:
    """DeepSeek-V3 with YaRN: the 4K pre-training config plus its context-extension overlay."""
    files = [str(REPO / "configs" / name) for name in ("deepseek_v3_671b.yaml", "context_ext_yarn.yaml")]
    return load_config(files).model


@pytest.mark.smoke
@pytest.mark.parametrize(
    "dim,base,factor,original,fast,slow",
    [
        (64, 10000.0, 40.0, 4096, 32.0, 1.0),  # DeepSeek-V3 671B
        (8, 10000.0, 4.0, 64, 32.0, 1.0),  # tiny.yaml
        (32, 50000.0, 8.0, 512, 16.0, 2.0),
        (16, 10000.0, 4.0, 16, 32.0, 1.0),
    ],
)
def test_yarn_inverse_frequencies(dim, base, factor, original, fast, slow):
    m = ModelConfig(
        qk_rope_head_dim=dim,
        rope_theta=base,
        rope_scaling="yarn",
        rope_factor=factor,
        rope_original_max_position=original,
        rope_beta_fast=fast,
        rope_beta_slow=slow,
    )
    want = reference_yarn_frequencies(dim, base, factor, original, fast, slow)
    np.testing.assert_allclose(inverse_frequencies(m), want, rtol=1e-12)


def test_yarn_671b_interpolates_low_frequencies_and_keeps_high_ones():
    m = v3_671b()
    plain = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    got = inverse_frequencies(m)
    # low = floor(64 ln(4096 / (64 pi)) / (2 ln 1e4)) = 10, high = ceil(64 ln(4096 / (2 pi)) / (2 ln 1e4)) = 23
    np.testing.assert_allclose(got[:11], plain[:11], rtol=1e-12)
    np.testing.assert_allclose(got[23:], plain[23:] / 40.0, rtol=1e-12)
    assert np.all((got[11:23] < plain[11:23]) & (got[11:23] > plain[11:23] / 40.0))


def test_no_scaling_gives_plain_frequencies():
    m = ModelConfig(qk_nope_head_dim=16, qk_rope_head_dim=16, rope_theta=10000.0, rope_scaling="none", rope_factor=40.0)
    want = np.array([10000.0 ** (-2 * i / 16) for i in range(8)])
    np.testing.assert_allclose(inverse_frequencies(m), want, rtol=1e-12)
    assert attention_scale(m) == pytest.approx((16 + 16) ** -0.5, rel=1e-12)
    assert rotary_magnitude(m) == 1.0


def test_mscale_formula():
    for factor, m in [(40.0, 1.0), (4.0, 0.707), (8.0, 1.0)]:
        assert yarn_mscale(factor, m) == pytest.approx(0.1 * m * math.log(factor) + 1.0, rel=1e-12)
    assert yarn_mscale(1.0, 1.0) == 1.0
    assert yarn_mscale(0.5, 1.0) == 1.0


def test_attention_scale_671b():
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert attention_scale(v3_671b()) == pytest.approx(192**-0.5 * mscale**2, rel=1e-12)
    assert rotary_magnitude(v3_671b()) == pytest.approx(1.0, rel=1e-12)


def test_rotary_magnitude_when_mscales_differ():
    """Hugging Face's YaRN: cos/sin carry mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    m = ModelConfig(rope_scaling="yarn", rope_factor=40.0, rope_mscale=0.707, rope_mscale_all_dim=1.0)
    want = (0.1 * 0.707 * math.log(40.0) + 1) / (0.1 * 1.0 * math.log(40.0) + 1)
    assert rotary_magnitude(m) == pytest.approx(want, rel=1e-12)


@pytest.mark.smoke
@pytest.mark.parametrize("scaling", ["none", "yarn"])
def test_apply_rope_is_complex_multiplication_of_adjacent_pairs(scaling):
    m = ModelConfig(
        qk_rope_head_dim=8, rope_theta=10000.0, rope_scaling=scaling, rope_factor=4.0, rope_original_max_position=16
    )
    rng = np.random.default_rng(0)
    b, t, h, r = 2, 12, 3, 8
    x = rng.normal(size=(b, t, h, r)).astype(np.float32)
    positions = np.stack([np.arange(t), np.arange(t) + 37]).astype(np.int32)  # second row: offset
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), m))

    if scaling == "none":
        freqs = np.array([10000.0 ** (-2 * i / r) for i in range(r // 2)])
    else:
        freqs = reference_yarn_frequencies(r, 10000.0, 4.0, 16, 32.0, 1.0)
    z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2].astype(np.float64)  # pairs (x0, x1)
    rotation = np.exp(1j * positions[:, :, None, None] * freqs[None, None, None, :])
    w = z * rotation
    want = np.stack([w.real, w.imag], axis=-1).reshape(b, t, h, r)
    np.testing.assert_allclose(got, want, **TOL)


def test_apply_rope_preserves_dtype_and_relative_position():
    """q.k after rotation depends only on the position difference."""
    m = ModelConfig(qk_rope_head_dim=8, rope_scaling="none")
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 1, 1, 8)).astype(np.float32)
    k = rng.normal(size=(1, 1, 1, 8)).astype(np.float32)

    def dot_at(pq, pk):
        rq = apply_rope(jnp.asarray(q), jnp.full((1, 1), pq, jnp.int32), m)
        rk = apply_rope(jnp.asarray(k), jnp.full((1, 1), pk, jnp.int32), m)
        return float((rq * rk).sum())

    assert dot_at(5, 2) == pytest.approx(dot_at(13, 10), rel=1e-5, abs=1e-5)
    assert apply_rope(jnp.asarray(q, jnp.bfloat16), jnp.zeros((1, 1), jnp.int32), m).dtype == jnp.bfloat16
    # Position 0 is the identity.
    np.testing.assert_allclose(np.asarray(apply_rope(jnp.asarray(q), jnp.zeros((1, 1), jnp.int32), m)), q, **TOL)
