"""FP8 training GEMMs: quantisers against a NumPy loop, GEMM values and gradients against a
float64 matmul of the unquantised inputs, and the FP8 dot in the program lowered for CUDA."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxmoe.analysis.hlo import dot_flops
from maxmoe.kernels import fp8_matmul as fp8_matmul_module
from maxmoe.kernels.fp8_matmul import RECIPES, fp8_grouped_matmul, fp8_matmul
from maxmoe.kernels.fp8_quant import E4M3, E5M2, quantize, segment_quantize
from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN
from maxmoe.model.layers import project
from maxmoe.model.transformer import REMAT_POLICIES

NP_DTYPES = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
MAX = {E4M3: 448.0, E5M2: 57344.0}


def numpy_quantize(x, dtype, block, power_of_two=False):
    """Reference: one block at a time, scale from the block's own amax (partial blocks at the edges)."""
    rows, cols = x.shape
    br = rows if block[0] == 0 else block[0]
    bc = cols if block[1] == 0 else block[1]
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    q = np.zeros(x.shape, NP_DTYPES[dtype])
    scales = np.zeros(grid, np.float32)
    top = np.float32(MAX[dtype])
    inverse_top = np.float32(1.0 / MAX[dtype])
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].astype(np.float32)
            amax = np.float32(np.abs(tile).max())
            if amax == 0:
                s = np.float32(1)
            elif power_of_two:
                mantissa, exponent = math.frexp(float(amax * inverse_top))
                s = np.float32(2.0 ** (exponent - 1 if mantissa == 0.5 else exponent))
            else:
                s = np.float32(amax * inverse_top)
            scales[i, j] = s
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = np.clip(tile / s, -top, top).astype(NP_DTYPES[dtype])
    return q, scales


def sample(shape, seed):
    """Normal values spread over six decades, a few exact zeros, one all-zero row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape) * np.exp(rng.uniform(-7, 7, size=shape))
    x[rng.random(shape) < 0.05] = 0.0
    x[3] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize(
    "dtype,block,power_of_two",
    [
        (E4M3, (0, 0), False),
        (E5M2, (0, 0), False),
        (E4M3, (1, 128), False),
        (E4M3, (128, 128), False),
        (E4M3, (128, 1), False),
        (E5M2, (1, 128), False),
        (E4M3, (1, 32), True),
        (E4M3, (32, 1), True),
    ],
)
def test_quantize_equals_numpy_blocks(dtype, block, power_of_two):
    x = sample((136, 160), seed=1)  # partial blocks of 128 and 32 at both edges
    q, scales = jax.jit(quantize, static_argnums=(1, 2, 3))(jnp.asarray(x), dtype, block, power_of_two)
    q_ref, scales_ref = numpy_quantize(x, dtype, block, power_of_two)
    np.testing.assert_array_equal(np.asarray(scales), scales_ref)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), q_ref.astype(np.float32))
    if power_of_two:
        assert np.all(np.log2(scales_ref) == np.round(np.log2(scales_ref)))


def test_segment_quantize_equals_numpy_groups():
    x = sample((40, 20), seed=2)
    segments = np.repeat([0, 2, 3, 4], [10, 15, 9, 6])  # segment 1 empty; id 4 = past the groups
    q, scales = jax.jit(segment_quantize, static_argnums=2)(jnp.asarray(x), jnp.asarray(segments), 4)
    for g, lo, hi in ((0, 0, 10), (2, 10, 25), (3, 25, 34)):
        q_ref, s_ref = numpy_quantize(x[lo:hi], E4M3, (0, 1))
        np.testing.assert_array_equal(np.asarray(scales)[g], s_ref[0])
        np.testing.assert_array_equal(np.asarray(q)[lo:hi].astype(np.float32), q_ref.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(scales)[1], 1.0)


# ----------------------------------------------------------------------------------
# GEMM error bounds from the formats. Rounding to nearest moves a value the format holds as a
# normal number by at most u = 2**-(mantissa bits + 1) of itself (e4m3: 1/16, e5m2: 1/8), and
# a subnormal one by at most h = half the subnormal spacing times the block scale (e4m3:
# 2**-10, e5m2: 2**-17); the scale is at most amax / max for float32 scales and 2 amax / max
# for power-of-two ones, amax over the whole tensor bounding every block's. With operands
# a(1 + da) + ea and b(1 + db) + eb, |sum a b - sum a' b'| <= |err_a| @ |b| + |a| @ |err_b| +
# |err_a| @ |err_b| elementwise, err = u |x| + h scale. Float32 accumulation adds K 2**-24
# of |a| @ |b|. The bound does not depend on the block layout; the block layouts themselves
# are held exact by the quantiser tests above.
FORMAT = {  # dtype: (u, h)
    E4M3: (2.0**-4, 2.0**-10),
    E5M2: (2.0**-3, 2.0**-17),
}
OPERANDS = {  # recipe -> GEMM -> (lhs format, rhs format); 2.0 = power-of-two scales
    "tensorwise": {"forward": (E4M3, E4M3), "dgrad": (E5M2, E4M3), "wgrad": (E4M3, E5M2)},
    "blockwise": dict.fromkeys(("forward", "dgrad", "wgrad"), (E4M3, E4M3)),
    "mxfp8": dict.fromkeys(("forward", "dgrad", "wgrad"), (E4M3, E4M3)),
}


def element_error(x, dtype, recipe, amax):
    u, h = FORMAT[dtype]
    scale = amax / MAX[dtype] * (2.0 if recipe == "mxfp8" else 1.0)
    return u * np.abs(x) + h * scale


def gemm_bound(a, b, recipe, gemm, a_amax=None, b_amax=None):
    """Largest |fp8 GEMM - exact GEMM| the formats allow, elementwise, for a [M, K] @ b [K, N].

    a_amax, b_amax: the largest magnitude any of the operand's blocks can see (default: a's, b's).
    """
    fa, fb = OPERANDS[recipe][gemm]
    a_amax = np.abs(a).max() if a_amax is None else a_amax
    b_amax = np.abs(b).max() if b_amax is None else b_amax
    ea, eb = element_error(a, fa, recipe, a_amax), element_error(b, fb, recipe, b_amax)
    abs_ab = np.abs(a) @ np.abs(b)
    return ea @ np.abs(b) + np.abs(a) @ eb + ea @ eb + a.shape[1] * 2.0**-24 * abs_ab


def assert_within(got, exact, bound, what):
    err = np.abs(np.asarray(got, np.float64) - exact)
    worst = np.max(err / (bound + 1e-30))
    assert worst <= 1.0, f"{what}: error reaches {worst:.3f} of the format's bound"
    # and the operands were rounded to fp8: a float32 GEMM would be ~1e-7 off, fp8 ~1e-2
    assert np.max(err) > 1e-4 * np.max(np.abs(exact)), what


def operands(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[:, : k // 3] *= 30.0  # channels of different magnitude: tiles see different amax
    w = (rng.normal(size=(k, n)) * 0.05).astype(np.float32)
    cotangent = rng.normal(size=(m, n)).astype(np.float32)
    return x, w, cotangent


def run_cuda_blockwise_program(monkeypatch):
    """Blockwise's dense GEMMs here as on CUDA: the partial products summed one block at a time."""
    monkeypatch.setattr(fp8_matmul_module, "_blocks_batched", fp8_matmul_module._blocks_scanned)


@pytest.mark.parametrize("recipe,program", [(r, "default") for r in RECIPES] + [("blockwise", "cuda")], ids=str)
def test_fp8_matmul_value_and_gradients_within_format_bound(recipe, program, monkeypatch):
    if program == "cuda":
        run_cuda_blockwise_program(monkeypatch)
        x, w, ct = operands(300, 400, 48, seed=3)  # 4 blocks of the contraction (dw: 3), the last partial
    else:
        x, w, ct = operands(136, 160, 48, seed=3)  # partial 128-tiles in every dimension, 32-blocks in K

    def loss(x, w):
        return jnp.sum(fp8_matmul(x, w, recipe) * ct)

    y, (dx, dw) = jax.jit(lambda x, w: (fp8_matmul(x, w, recipe), jax.grad(loss, (0, 1))(x, w)))(x, w)
    x64, w64, ct64 = (v.astype(np.float64) for v in (x, w, ct))
    assert_within(y, x64 @ w64, gemm_bound(x64, w64, recipe, "forward"), "y")
    assert_within(dx, ct64 @ w64.T, gemm_bound(ct64, w64.T, recipe, "dgrad"), "dx")
    assert_within(dw, x64.T @ ct64, gemm_bound(x64.T, ct64, recipe, "wgrad"), "dw")


def test_blockwise_cuda_program_holds_one_partial_product(monkeypatch):
    """The batched program keeps all K/128 partial products; CUDA's scan one sum and one product."""
    m, k, n = 2048, 4096, 2048
    a, b = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)

    def temp_bytes():
        forward = jax.jit(lambda a, b: fp8_matmul_module.scaled_dot(a, b, "blockwise", "forward"))
        return forward.lower(a, b).compile().memory_analysis().temp_size_in_bytes

    product = m * n * 4  # one float32 [M, N]
    batched = temp_bytes()
    run_cuda_blockwise_program(monkeypatch)
    scanned = temp_bytes()
    assert batched >= (k // 128) * product, batched / product
    assert scanned <= 8 * product, scanned / product  # measured: 4.0 (sum, product, operands' copies)


GROUP_SIZES = np.array([30, 0, 60, 26])  # one empty group; 20 rows past the groups


@pytest.mark.parametrize(
    "recipe,backend",
    [(r, "ragged_dot") for r in RECIPES] + [("blockwise", "mosaic_gpu")] + [(r, BALANCED_STAND_IN) for r in RECIPES],
    ids=str,
)
def test_fp8_grouped_matmul_value_and_gradients_within_format_bound(recipe, backend, request):
    # backend mosaic_gpu (a GPU target): blockwise's three GEMMs run the Triton kernels; the dry
    # run's stand-in (a kernel backend: its GEMMs, weight gradients included) on balanced groups
    calls = request.getfixturevalue("interpreted_fp8_kernels") if backend == "mosaic_gpu" else []
    group_sizes = np.array([34] * 4) if backend == BALANCED_STAND_IN else GROUP_SIZES
    x, _, ct = operands(136, 160, 48, seed=4)
    w = (np.random.default_rng(5).normal(size=(4, 160, 48)) * 0.05).astype(np.float32)
    sizes = jnp.asarray(group_sizes, jnp.int32)

    def loss(x, w):
        return jnp.sum(fp8_grouped_matmul(x, w, sizes, recipe, backend) * ct)

    y, (dx, dw) = jax.jit(
        lambda x, w: (fp8_grouped_matmul(x, w, sizes, recipe, backend), jax.grad(loss, (0, 1))(x, w))
    )(x, w)
    # forward twice (the value, the gradient's forward), dx, dw
    gemm, wgrad = "blockwise_grouped_gemm", "fp8_grouped_wgrad"
    assert calls == ([gemm, gemm, gemm, wgrad] if backend == "mosaic_gpu" else []), calls
    y, dx, dw = np.asarray(y), np.asarray(dx), np.asarray(dw)
    ends = np.cumsum(group_sizes)
    # tensorwise scales span all rows and all groups' weights: bound with the whole tensors' amax
    amax = {name: np.abs(v).max() for name, v in (("x", x), ("w", w), ("ct", ct))}
    for g in range(4):
        lo, hi = ends[g] - group_sizes[g], ends[g]
        if hi == lo:
            np.testing.assert_array_equal(dw[g], 0.0)
            continue
        xg, wg, ctg = x[lo:hi].astype(np.float64), w[g].astype(np.float64), ct[lo:hi].astype(np.float64)
        bound = gemm_bound(xg, wg, recipe, "forward", amax["x"], amax["w"])
        assert_within(y[lo:hi], xg @ wg, bound, f"y group {g}")
        bound = gemm_bound(ctg, wg.T, recipe, "dgrad", amax["ct"], amax["w"])
        assert_within(dx[lo:hi], ctg @ wg.T, bound, f"dx group {g}")
        bound = gemm_bound(xg.T, ctg, recipe, "wgrad", amax["x"], amax["ct"])
        assert_within(dw[g], xg.T @ ctg, bound, f"dw group {g}")
    np.testing.assert_array_equal(y[ends[-1] :], 0.0)
    np.testing.assert_array_equal(dx[ends[-1] :], 0.0)


def test_tensorwise_lowers_to_fp8_dots_for_cuda():
    x, w, ct = operands(64, 128, 32, seed=6)

    def step(x, w):
        return jax.value_and_grad(lambda x, w: jnp.sum(fp8_matmul(x, w, "tensorwise") * ct), (0, 1))(x, w)

    text = jax.jit(step).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    fp8_dots = [line for line in dots if "f8E4M3FN>" in line]
    assert len(fp8_dots) == 3, dots  # forward, dx, dw
    assert sum("f8E5M2>" in line for line in fp8_dots) == 2, fp8_dots  # the gradient operand of dx and dw
    assert all("-> tensor<" in line and "xf32>" in line.split("->")[-1] for line in fp8_dots)


def test_tiles_follow_rows_of_very_different_size():
    """Rows 12 decades apart: 1x128 and 1x32 tiles keep each row within the bound of its own amax;
    one scale for the whole tensor flushes the smallest rows to zero."""
    x, w, _ = operands(24, 160, 16, seed=7)
    x *= np.logspace(-6, 6, 24, dtype=np.float32)[:, None]
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    forward = jax.jit(fp8_matmul, static_argnums=2)
    for recipe in ("blockwise", "mxfp8"):
        y = np.asarray(forward(x, w, recipe))
        for i in range(24):
            bound = gemm_bound(x64[i : i + 1], w64, recipe, "forward")
            assert_within(y[i : i + 1], x64[i : i + 1] @ w64, bound, f"{recipe} row {i}")
    y = np.asarray(forward(x, w, "tensorwise"))
    np.testing.assert_array_equal(y[0], 0.0)


# What each GEMM quantises, restated from the recipes (DeepSeek-V3, OCP MX): (lhs format, lhs
# block, rhs format, rhs block, power-of-two scales); the lhs contracts its columns, the rhs its rows.
SPEC = {
    "tensorwise": {
        "forward": (E4M3, (0, 0), E4M3, (0, 0), False),
        "dgrad": (E5M2, (0, 0), E4M3, (0, 0), False),
        "wgrad": (E4M3, (0, 0), E5M2, (0, 0), False),
    },
    "blockwise": {
        "forward": (E4M3, (1, 128), E4M3, (128, 128), False),
        "dgrad": (E4M3, (1, 128), E4M3, (128, 128), False),
        "wgrad": (E4M3, (1, 128), E4M3, (128, 1), False),
    },
    "mxfp8": dict.fromkeys(("forward", "dgrad", "wgrad"), (E4M3, (1, 32), E4M3, (32, 1), True)),
}


def numpy_dequantized(x, dtype, block, power_of_two):
    q, scales = numpy_quantize(x, dtype, block, power_of_two)
    rows, cols = x.shape
    br = rows if block[0] == 0 else block[0]
    bc = cols if block[1] == 0 else block[1]
    full = np.repeat(np.repeat(scales.astype(np.float64), br, axis=0), bc, axis=1)[:rows, :cols]
    return q.astype(np.float64) * full


def assert_fp8_gemm_in_bfloat16(got, a, b, recipe, gemm, what):
    """got is bfloat16 and is the bfloat16 rounding of the float64 product of the fp8-rounded
    operands, up to float32 accumulation: a GEMM on fp8 operands that returns the compute dtype."""
    assert got.dtype == jnp.bfloat16, f"{what}: {got.dtype}, not the compute dtype bfloat16"
    fa, block_a, fb, block_b, power_of_two = SPEC[recipe][gemm]
    a64 = numpy_dequantized(np.asarray(a, np.float32), fa, block_a, power_of_two)
    b64 = numpy_dequantized(np.asarray(b, np.float32), fb, block_b, power_of_two)
    exact = a64 @ b64
    accumulation = a.shape[1] * 2.0**-24 * (np.abs(a64) @ np.abs(b64))
    # bfloat16 keeps 8 significant bits: half the spacing at 2**e is 2**(e - 8)
    half_ulp = 2.0 ** (np.floor(np.log2(np.abs(exact) + accumulation + 1e-30)) - 8)
    err = np.abs(np.asarray(got, np.float64) - exact)
    worst = np.max(err / (half_ulp + accumulation))
    assert worst <= 1.0, f"{what}: {worst:.3f} of bfloat16 rounding off the fp8 GEMM"


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_matmul_in_bfloat16_returns_bfloat16_products_of_fp8_operands(recipe):
    """In bf16 compute the FP8 GEMM hands back what a real FP8 GEMM with a bf16 output does:
    bfloat16 values, for the output and both gradients (not float32 that would carry more bits
    than the `none` program's bf16 matmuls)."""
    x, w, ct = (jnp.asarray(v, jnp.bfloat16) for v in operands(136, 160, 48, seed=8))

    def loss(x, w):
        return jnp.sum((fp8_matmul(x, w, recipe) * ct).astype(jnp.float32))

    y, (dx, dw) = jax.jit(lambda x, w: (fp8_matmul(x, w, recipe), jax.grad(loss, (0, 1))(x, w)))(x, w)
    assert_fp8_gemm_in_bfloat16(y, x, w, recipe, "forward", "y")
    assert_fp8_gemm_in_bfloat16(dx, ct, w.T, recipe, "dgrad", "dx")
    assert_fp8_gemm_in_bfloat16(dw, x.T, ct, recipe, "wgrad", "dw")


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_grouped_matmul_in_bfloat16_keeps_bfloat16(recipe):
    x = jax.ShapeDtypeStruct((136, 160), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4, 160, 48), jnp.bfloat16)
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)

    def forward_and_grads(x, w):
        y, pullback = jax.vjp(lambda x, w: fp8_grouped_matmul(x, w, sizes, recipe), x, w)
        return y, *pullback(jnp.ones_like(y))

    y, dx, dw = jax.eval_shape(forward_and_grads, x, w)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3


@pytest.mark.parametrize("recipe", ["none", *RECIPES])
def test_save_matmuls_keeps_the_fp8_gemms_outputs_as_it_keeps_dots(recipe):
    """model.remat=save_matmuls on a two-GEMM MLP recomputes no GEMM in the backward pass: the
    compiled dot FLOPs equal those without remat (the oracle) and are below full remat's. A bf16
    dot is kept by the dot policy; an FP8 GEMM, hidden from it in a custom VJP (and under mxfp8
    a platform switch), by its output's name."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (64, 128), jnp.bfloat16)
    w_in, w_out = (0.1 * jax.random.normal(k, s, jnp.bfloat16) for k, s in zip(keys[1:], [(128, 256), (256, 128)]))

    def mlp(x, w_in, w_out):
        return jnp.sum(project(jax.nn.silu(project(x, w_in, recipe)), w_out, recipe).astype(jnp.float32) ** 2)

    def flops(policy):
        fn = mlp if policy is None else jax.checkpoint(mlp, policy=REMAT_POLICIES[policy])
        return dot_flops(jax.jit(jax.value_and_grad(fn, argnums=(1, 2))).lower(x, w_in, w_out).compile().as_text())

    plain = flops(None)
    assert flops("save_matmuls") == plain < flops("full")
