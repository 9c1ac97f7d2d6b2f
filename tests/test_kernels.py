"""Kernel backends against their oracles: grouped matmul, attention, the chunked loss.

Oracles: the dense-loop grouped matmul (`dense_loop`) and a NumPy loop; the dense XLA
attention (`xla_attention`, itself checked against a dense MLA in test_model.py); the
plain cross-entropy of whole logits. The Mosaic GPU kernels cannot run without a GPU: their
wrapper (custom VJP, row masking, row buckets, shard_map axes) runs here on reference
kernels with the kernels' contract, and the kernels themselves are proven by lowering for
CUDA (tests/test_lowering.py). jax's Pallas Triton attention runs in interpret mode.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEFAULT_EMITTERS

from maxmoe.kernels import mosaic_ragged_dot
from maxmoe.kernels.attention import triton_attention
from maxmoe.kernels.choice import gpu_generation, resolve_attention, resolve_grouped_matmul
from maxmoe.kernels.grouped_matmul import BALANCED_STAND_IN, grouped_matmul, grouped_wgrad
from maxmoe.model.attention_ops import chunked_attention, xla_attention
from maxmoe.training.loss import cross_entropy, head_cross_entropies, head_cross_entropy

# float32 throughout; the implementations sum the same products in other orders.
TOL = dict(rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------
# Grouped matmul: the Mosaic GPU wrapper on reference kernels.


def reference_forward(x_MK, w, sizes_G, transpose_rhs=False):
    """The forward kernel's contract: group rows written, rows past the groups unspecified (NaN here)."""
    w_GKN = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
    ends = jnp.cumsum(sizes_G)
    rows = jnp.arange(x_MK.shape[0])
    out = jnp.full((x_MK.shape[0], w_GKN.shape[2]), jnp.nan, jnp.float32)
    for g in range(w_GKN.shape[0]):
        in_group = ((rows >= ends[g] - sizes_G[g]) & (rows < ends[g]))[:, None]
        out = jnp.where(in_group, x_MK @ w_GKN[g], out)
    return out.astype(x_MK.dtype)


def reference_weight_grad(x_MK, dy_MN, sizes_G):
    ends = jnp.cumsum(sizes_G)
    rows = jnp.arange(x_MK.shape[0])
    masks = [((rows >= ends[g] - sizes_G[g]) & (rows < ends[g]))[:, None] for g in range(sizes_G.shape[0])]
    return jnp.stack([jnp.where(m, x_MK, 0.0).T @ jnp.where(m, dy_MN, 0.0) for m in masks])


REFERENCE = mosaic_ragged_dot.Kernels(reference_forward, reference_weight_grad)


def numpy_grouped_matmul(x, w, sizes):
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size].astype(np.float64) @ w[g]
        start += size
    return out


@pytest.fixture(scope="module")
def wrapped():
    """The wrapper over reference kernels, and its gradient, jitted once."""
    fn = mosaic_ragged_dot.make_grouped_matmul(REFERENCE)
    target = jax.random.normal(jax.random.key(9), (512, 12))

    def loss(x, w, sizes):
        return jnp.sum(fn(x, w, sizes) * target)

    return jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1))), target


@pytest.mark.parametrize(
    "sizes",
    [[100, 0, 200, 212], [40, 0, 30, 0], [0, 0, 0, 0], [0, 300, 0, 50], [128, 128, 128, 128]],
    ids=["full", "short_empty", "all_empty", "one_bucket_up", "exact"],
)
def test_mosaic_wrapper_equals_the_dense_loop(wrapped, sizes):
    fn, grad, target = wrapped
    keys = jax.random.split(jax.random.key(len(sizes) + sum(sizes)), 2)
    x = jax.random.normal(keys[0], (512, 16))
    w = jax.random.normal(keys[1], (4, 16, 12)) / 4
    sizes = jnp.array(sizes, jnp.int32)
    out = fn(x, w, sizes)
    np.testing.assert_allclose(out, numpy_grouped_matmul(np.asarray(x), np.asarray(w), list(sizes)), **TOL)
    assert not np.any(np.asarray(out)[int(sizes.sum()) :]), "rows past the groups must be zero"

    def oracle(x, w):
        return jnp.sum(grouped_matmul(x, w, sizes, backend="dense_loop") * target)

    for got, want in zip(grad(x, w, sizes), jax.grad(oracle, argnums=(0, 1))(x, w)):
        np.testing.assert_allclose(got, want, **TOL)


def test_mosaic_wrapper_runs_the_kernel_on_the_smallest_row_prefix():
    """Work scales with the valid rows: the kernel sees only the bucket that holds them."""
    seen = []

    def recording_forward(x_MK, w, sizes_G, transpose_rhs=False):
        jax.debug.callback(lambda: seen.append(x_MK.shape[0]))
        return reference_forward(x_MK, w, sizes_G, transpose_rhs)

    fn = jax.jit(mosaic_ragged_dot.make_grouped_matmul(mosaic_ragged_dot.Kernels(recording_forward, None)))
    assert mosaic_ragged_dot.bucket_sizes(512, 128) == (128, 256, 384, 512)
    assert mosaic_ragged_dot.bucket_sizes(300, 128) == (128, 256, 300)
    assert mosaic_ragged_dot.bucket_sizes(65536, 128) == (16384, 32768, 49152, 65536)
    x, w = jnp.ones((512, 64)), jnp.ones((2, 64, 64))
    for sizes, rows in (([60, 60], 128), ([100, 100], 256), ([0, 257], 384), ([400, 112], 512), ([0, 0], 128)):
        seen.clear()
        jax.block_until_ready(fn(x, w, jnp.array(sizes, jnp.int32)))
        assert seen == [rows], (sizes, seen)


def test_mosaic_backend_inside_the_dispatch_shard_map(monkeypatch):
    """Expert-parallel ragged all-to-all on the Mosaic wrapper equals the single-device dense loop."""
    from test_dispatch import TOL as DISPATCH_TOL
    from test_dispatch import distributed, make_mesh, make_plan, random_problem, reference

    monkeypatch.setattr(
        mosaic_ragged_dot, "_mosaic_grouped_matmul", lambda: mosaic_ragged_dot.make_grouped_matmul(REFERENCE)
    )
    monkeypatch.setattr(mosaic_ragged_dot, "check_operands", lambda x, w: None)
    plan = make_plan(make_mesh((2, 4, 1)), "ragged_a2a", grouped_matmul="mosaic_gpu")
    assert plan.grouped_matmul == "mosaic_gpu"
    problem = random_problem(3, 8, 4, 8, 2)
    y_ref, grads_ref = reference(*problem)
    y, _, grads = distributed(plan, *problem)
    np.testing.assert_allclose(y, y_ref, **DISPATCH_TOL)
    for g, g_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, **DISPATCH_TOL)


def test_mosaic_operands_are_checked():
    x, w, sizes = jnp.ones((128, 64)), jnp.ones((2, 64, 64)), jnp.array([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mosaic_ragged_dot.mosaic_grouped_matmul(x, w, sizes)
    with pytest.raises(ValueError, match="multiples of 64"):
        mosaic_ragged_dot.mosaic_grouped_matmul(x.astype(jnp.bfloat16), jnp.ones((2, 64, 48), jnp.bfloat16), sizes)


@pytest.mark.parametrize("sizes", [[100, 0, 200, 0], [0, 0, 0, 0]], ids=["padded_empty", "all_empty"])
def test_tokamax_backend_through_its_reference_path_equals_the_dense_loop(sizes):
    """tokamax (optional, Python >= 3.12) picks its XLA implementation on CPU; the wrapper's masking is ours."""
    pytest.importorskip("tokamax")
    keys = jax.random.split(jax.random.key(2), 3)
    x, w = jax.random.normal(keys[0], (512, 16)), jax.random.normal(keys[1], (4, 16, 12)) / 4
    target = jax.random.normal(keys[2], (512, 12))
    sizes = jnp.array(sizes, jnp.int32)

    def loss(x, w, backend):
        return jnp.sum(grouped_matmul(x, w, sizes, backend=backend) * target)

    got = grouped_matmul(x, w, sizes, backend="tokamax")
    np.testing.assert_allclose(got, grouped_matmul(x, w, sizes, backend="dense_loop"), **TOL)
    grads = jax.grad(loss, argnums=(0, 1))
    for a, b in zip(grads(x, w, "tokamax"), grads(x, w, "dense_loop")):
        np.testing.assert_allclose(a, b, **TOL)


def test_dry_run_stand_in_equals_the_dense_loop_on_balanced_groups():
    """The dry run's grouped GEMM is the grouped product when every group has M/G rows (its premise)."""
    keys = jax.random.split(jax.random.key(3), 3)
    x, w = jax.random.normal(keys[0], (96, 16)), jax.random.normal(keys[1], (4, 16, 12)) / 4
    target = jax.random.normal(keys[2], (96, 12))
    sizes = jnp.full((4,), 24, jnp.int32)

    def loss(x, w, backend):
        return jnp.sum(grouped_matmul(x, w, sizes, backend=backend) * target)

    got = grouped_matmul(x, w, sizes, backend=BALANCED_STAND_IN)
    np.testing.assert_allclose(got, numpy_grouped_matmul(np.asarray(x), np.asarray(w), [24] * 4), **TOL)
    grads = jax.grad(loss, argnums=(0, 1))
    for a, b in zip(grads(x, w, BALANCED_STAND_IN), grads(x, w, "dense_loop")):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize(
    "backend,sizes",
    [
        ("ragged_dot", [40, 0, 50, 20]),
        ("dense_loop", [40, 0, 50, 20]),
        (BALANCED_STAND_IN, [32] * 4),
        ("mosaic_gpu", [40, 0, 50, 20]),
        ("tokamax", [40, 0, 50, 20]),
    ],
    ids=["ragged_dot", "dense_loop", "stand_in_balanced", "mosaic_wrapper", "tokamax_reference"],
)
def test_grouped_wgrad_equals_per_group_products(backend, sizes, monkeypatch):
    """dw[g] = x[rows of g]^T dy[rows of g] alone, float32, per backend (rows past the groups
    add nothing); mosaic_gpu: the wrapper on the reference weight-gradient kernel; tokamax: its
    VJP through its reference path (CPU)."""
    if backend == "tokamax":
        pytest.importorskip("tokamax")
    if backend == "mosaic_gpu":
        monkeypatch.setattr(mosaic_ragged_dot, "_mosaic_kernels", lambda: REFERENCE)
    keys = jax.random.split(jax.random.key(11), 2)
    x, dy = jax.random.normal(keys[0], (128, 64)), jax.random.normal(keys[1], (128, 128))
    dtype = jnp.bfloat16 if backend == "mosaic_gpu" else jnp.float32
    x, dy = x.astype(dtype), dy.astype(dtype)
    got = grouped_wgrad(x, dy, jnp.array(sizes, jnp.int32), backend=backend)
    assert got.dtype == jnp.float32 and got.shape == (4, 64, 128)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    ends = np.cumsum(sizes)
    want = np.stack([x64[e - s : e].T @ dy64[e - s : e] for s, e in zip(sizes, ends)])
    # the reference kernel, like its dot, rounds its output to bf16: within its unit roundoff 2^-8
    np.testing.assert_allclose(got, want, **(dict(rtol=2.0**-8, atol=1e-6) if dtype == jnp.bfloat16 else TOL))


# ----------------------------------------------------------------------------------
# Which implementation `auto` means.


def test_auto_choices_per_platform_and_device_kind():
    assert [gpu_generation(k) for k in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB", "")] == [
        "hopper"
    ] * 4
    assert [gpu_generation(k) for k in ("NVIDIA GB300", "NVIDIA B200", "NVIDIA A100-SXM4-80GB")] == [
        "blackwell",
        "blackwell",
        "other",
    ]
    assert resolve_grouped_matmul("auto", "cpu").name == "ragged_dot"
    assert resolve_grouped_matmul("auto", "gpu", "NVIDIA H200").name == "mosaic_gpu"
    assert resolve_grouped_matmul("auto", "cuda", "NVIDIA H200", "float32").name == "ragged_dot"
    blackwell = resolve_grouped_matmul("auto", "cuda", "NVIDIA GB300")
    assert blackwell.name == "ragged_dot" and "G x the useful FLOPs" in blackwell.reason
    assert resolve_grouped_matmul("dense_loop", "cuda", "NVIDIA H200").name == "dense_loop"
    assert resolve_attention("auto", "cpu").name == "chunked"
    assert resolve_attention("auto", "cuda", "NVIDIA H200").name in ("triton", "chunked")
    assert resolve_attention("xla", "cuda").name == "xla"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["moe.grouped_matmul=mosaic_gpu"], "moe.grouped_matmul=mosaic_gpu: needs an NVIDIA Hopper GPU"),
        (["model.attention=cudnn"], "model.attention=cudnn: cuDNN needs an NVIDIA GPU"),
    ],
)
def test_a_kernel_the_target_cannot_run_is_a_config_error(overrides, fragment):
    from maxmoe.config import ConfigError, load_config
    from maxmoe.parallel.layout import build_layout

    config = load_config([], overrides)
    with pytest.raises(ConfigError, match=fragment):
        build_layout(config, jax.devices()[:1], platform="cpu")
    with pytest.raises(ConfigError, match="compute_dtype=bfloat16"):
        resolve_grouped_matmul("mosaic_gpu", "cuda", "NVIDIA H200", "float32")


# ----------------------------------------------------------------------------------
# Attention.


def attention_problem(seed, b=2, t=48, h=3, k=12, v=8):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, key = (jax.random.normal(keys[i], (b, t, h, k)) for i in (0, 1))
    return q, key, jax.random.normal(keys[2], (b, t, h, v)), jax.random.normal(keys[3], (b, t, h, v))


def assert_attention_matches(fn, problem, scale=0.3):
    q, k, v, cotangent = problem
    np.testing.assert_allclose(fn(q, k, v, scale), xla_attention(q, k, v, scale), **TOL)

    def grads(attend):
        return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, scale) * cotangent), argnums=(0, 1, 2))(q, k, v)

    for name, got, want in zip("qkv", grads(fn), grads(xla_attention)):
        np.testing.assert_allclose(got, want, err_msg=f"d{name}", **TOL)


@pytest.mark.parametrize("chunk", [16, 48, 7], ids=["3_blocks", "one_block", "divisor_6"])
def test_chunked_attention_equals_xla(chunk):
    fn = jax.jit(lambda q, k, v, s: chunked_attention(q, k, v, s, chunk), static_argnums=3)
    assert_attention_matches(fn, attention_problem(chunk))


def test_triton_attention_in_interpret_mode_equals_xla():
    """MLA's shape: qk head dim 24 (16 nope + 8 rope), v head dim 16, padded inside the wrapper."""
    fn = jax.jit(lambda q, k, v, s: triton_attention(q, k, v, s, interpret=True), static_argnums=3)
    assert_attention_matches(fn, attention_problem(1, b=1, t=32, h=2, k=24, v=16))


def test_tokamax_attention_through_its_reference_path_equals_xla():
    pytest.importorskip("tokamax")
    from maxmoe.kernels.attention import tokamax_attention

    assert_attention_matches(tokamax_attention, attention_problem(5, b=1, t=32, h=2, k=24, v=16))


def attention_temp_bytes(name, t, b=1, h=2, k=32, chunk=64):
    q = jax.ShapeDtypeStruct((b, t, h, k), jnp.float32)
    attend = {"xla": xla_attention, "chunked": lambda q, k, v, s: chunked_attention(q, k, v, s, chunk)}[name]

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, 0.25))

    # compiled as users compile it: the bounds below were measured with XLA:CPU's fusion emitters
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options=DEFAULT_EMITTERS)
    return grad.trace(q, q, q).lower().compile().memory_analysis().temp_size_in_bytes


def test_attention_memory_grows_linearly_with_chunked_and_quadratically_with_xla():
    """Ahead-of-time compiled temp memory of forward + backward at T and 2T (nothing runs)."""
    chunked = attention_temp_bytes("chunked", 4096) / attention_temp_bytes("chunked", 2048)
    dense = attention_temp_bytes("xla", 4096) / attention_temp_bytes("xla", 2048)
    assert 1.7 < chunked < 2.3, chunked
    assert 3.5 < dense < 4.5, dense


# ----------------------------------------------------------------------------------
# The loss.


def test_head_cross_entropy_equals_plain_loss_and_gradients():
    keys = jax.random.split(jax.random.key(4), 3)
    b, t, d, v = 2, 24, 8, 50
    h = jax.random.normal(keys[0], (b, t, d))
    w = jax.random.normal(keys[1], (d, v)) / math.sqrt(d)
    targets = jax.random.randint(keys[2], (b, t), 0, v)
    mask = (jnp.arange(t) < t - 3).astype(jnp.float32)[None].repeat(b, 0)

    def plain(h, w, mask):
        return cross_entropy(jnp.einsum("btd,dv->btv", h, w), targets, mask)

    for chunk, m in ((16, mask), (7, None), (0, mask)):  # vocabulary blocks of 10, of 5 (divisors of 50), one

        def chunked(h, w, m=m, chunk=chunk):
            return head_cross_entropy(h, w, targets, m, chunk=chunk, dtype=jnp.float32)

        np.testing.assert_allclose(chunked(h, w), plain(h, w, m), **TOL)
        for got, want in zip(
            jax.grad(chunked, argnums=(0, 1))(h, w), jax.grad(lambda h, w, m=m: plain(h, w, m), argnums=(0, 1))(h, w)
        ):
            np.testing.assert_allclose(got, want, **TOL)


def test_stacked_losses_equal_separate_ones():
    """Main head and MTP depths through the head in one pass: each equals its own plain loss."""
    keys = jax.random.split(jax.random.key(6), 3)
    h = jax.random.normal(keys[0], (2, 3, 10, 8))
    w = jax.random.normal(keys[1], (8, 40)) / math.sqrt(8)
    targets = jax.random.randint(keys[2], (2, 3, 10), 0, 40)
    mask = jnp.stack([jnp.ones((3, 10)), jnp.broadcast_to(jnp.arange(10) < 9, (3, 10)).astype(jnp.float32)])
    got = head_cross_entropies(h, w, targets, mask, chunk=16, dtype=jnp.float32)  # blocks of 10 columns
    want = [cross_entropy(jnp.einsum("btd,dv->btv", h[s], w), targets[s], mask[s]) for s in range(2)]
    np.testing.assert_allclose(got, jnp.stack(want), **TOL)


def test_chunked_loss_temp_memory_at_the_proxy_shape_is_a_quarter_of_the_plain_loss():
    """proxy_1gpu: 8 x 4096 positions, D 2048, V 129,280, bf16 head; compiled, never run."""
    b, t, d, v = 8, 4096, 2048, 129280
    h = jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def plain(h, w, targets):
        logits = jnp.einsum("btd,dv->btv", h, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        return cross_entropy(logits, targets)

    def chunked(h, w, targets):
        return head_cross_entropy(h, w, targets, dtype=jnp.bfloat16)  # 8 blocks of 16,160 columns

    def temp(loss):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return grad.trace(h, w, targets).lower().compile().memory_analysis().temp_size_in_bytes

    plain_bytes, chunked_bytes = temp(plain), temp(chunked)
    assert plain_bytes > 4 * b * t * v, plain_bytes  # the whole float32 logits exist
    assert chunked_bytes <= plain_bytes / 4, (chunked_bytes, plain_bytes)


# ----------------------------------------------------------------------------------
# A training run: auto against the oracles.


def tiny_losses(*overrides, steps=3):
    from maxmoe.config import load_config
    from maxmoe.parallel.layout import build_layout
    from maxmoe.training.programs import build_programs

    config = load_config(
        ["configs/tiny.yaml"],
        [
            "model.compute_dtype=float32",
            "model.num_layers=1",  # one MoE layer and the MTP layer: the smallest program with both
            "model.first_k_dense=0",
            "train.batch_size=2",
            "train.seq_len=16",
            "train.warmup_steps=0",
            *overrides,
        ],
    )
    layout = build_layout(config, jax.devices()[:1])
    programs = build_programs(config, layout)
    state = programs.init(jax.random.key(0))
    rng = np.random.default_rng(3)
    losses = []
    for _ in range(steps):
        batch = rng.integers(0, config.model.vocab_size, (2, 17)).astype(np.int32)
        state, metrics = programs.train_step(state, jax.device_put(batch, programs.batch_sharding))
        losses.append(float(metrics["loss"]))
    return layout, losses


@pytest.mark.slow
def test_three_steps_with_auto_equal_the_oracles(monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    # Attention in 4 blocks of 4 positions, the loss in 4 blocks of 65 vocabulary columns.
    layout, auto = tiny_losses("model.attention_chunk=4", "train.loss_chunk=65")
    assert (layout.attention.name, layout.grouped_matmul.name) == ("chunked", "ragged_dot")
    _, oracle = tiny_losses("model.attention=xla", "moe.grouped_matmul=dense_loop", "train.loss_chunk=0")
    np.testing.assert_allclose(auto, oracle, **TOL)
