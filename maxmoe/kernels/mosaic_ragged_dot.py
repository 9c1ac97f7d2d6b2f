"""Grouped GEMM on Hopper GPUs from jax's own Pallas Mosaic GPU kernels, forward and both gradients.

    y_MN = mosaic_grouped_matmul(x_MK, w_GKN, sizes_G)     # differentiable in x and w
    dw_GKN = mosaic_grouped_wgrad(x_MK, dy_MN, sizes_G)     # the transposed kernel alone

The contract of `maxmoe.kernels.grouped_matmul`: rows past sum(sizes_G) are zero (in the output
and in dx), the result has x's dtype. The kernels (`jax.experimental.pallas.ops.gpu`'s ragged
dot and transposed ragged dot) use `wgmma` (sm_90a, Hopper only), take bf16/f16 operands and
need K divisible by the K block; they are imported here only, and an import failure is one
clear error (`KernelUnavailable`). The wrapper adds the custom VJP, the zeroed padding rows, row
buckets (`BUCKETS` static prefixes picked by `lax.switch`, so the forward's work follows the
valid rows) and the SM count when lowering for CUDA on a CPU host (`HOPPER_SMS`).

docs/KERNELS.md, "Grouped GEMM backends" ("The Mosaic GPU wrapper") has the mechanics.
Legend: M rows, K contraction, N output features, G groups.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings

import jax
import jax.numpy as jnp

from maxmoe.kernels.varying import vary_alike, vary_over, varying_axes

BUCKETS = 4  # row prefixes the forward kernels may run on: M/4, M/2, 3M/4, M (in whole row blocks)
HOPPER_SMS = 132  # H100 / H200 SXM; used only when lowering for CUDA without a GPU in this process
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


class KernelUnavailable(RuntimeError):
    """The Mosaic GPU kernels cannot be imported from this jax."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes of one kernel call: rows (m), output features (n), contraction (k)."""

    m: int = 128
    n: int = 128
    k: int = 64
    stages: int = 4  # TMA pipeline depth (max_concurrent_steps)


# Tiles of the forward kernel per GEMM it runs, (contraction K, output N, transpose_rhs): the
# forward [D -> F] GEMMs and the dx GEMMs (transposed weights). Measured by a sweep on the device
# (benchmarks/grouped_matmul.py --tiles prints these entries with the rates they reached); a GEMM
# not listed takes `pick_blocks`' rule. Empty until the sweep has run on an H200.
TILES: dict[tuple[int, int, bool], Blocks] = {}


def forward_blocks(k: int, n: int, transpose_rhs: bool, tiles: dict | None = None) -> Blocks:
    """The forward kernel's tiles for a [*, k] x [k, n] GEMM: `tiles` (default TILES), else the rule."""
    listed = (TILES if tiles is None else tiles).get((k, n, transpose_rhs))
    return listed or pick_blocks(k, n)


def _largest_divisor(size: int, options: tuple[int, ...]) -> int | None:
    return next((b for b in options if size % b == 0), None)


def pick_blocks(k: int, n: int) -> Blocks:
    """Tiles for a [*, k] x [k, n] grouped GEMM; wgmma needs multiples of 64 here.

    Raises:
        ValueError: when k or n is not a multiple of 64.
    """
    block_k = _largest_divisor(k, (64,))
    block_n = _largest_divisor(n, (128, 64))
    if block_k is None or block_n is None:
        raise ValueError(
            f"the Mosaic GPU grouped matmul needs contraction and output sizes that are multiples of 64; got {k} and {n}"
        )
    return Blocks(m=128, n=block_n, k=block_k)


def mosaic_modules():
    """jax's Mosaic GPU ragged-dot modules, or KernelUnavailable naming the jax version."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except Exception as e:  # noqa: BLE001 - any failure means this jax does not ship usable kernels
        raise KernelUnavailable(
            f"jax {jax.__version__} has no usable jax.experimental.pallas.ops.gpu.ragged_dot_mgpu "
            f"({type(e).__name__}: {e}); use moe.grouped_matmul=ragged_dot"
        ) from None
    return ragged_dot_mgpu, transposed_ragged_dot_mgpu


class _JaxWithTargetDevices(types.SimpleNamespace):
    """`jax` as seen by a kernel module, except that devices report the target's SM count."""

    def __init__(self, sms: int):
        super().__init__()
        self._sms = sms

    def __getattr__(self, name):
        return getattr(jax, name)

    def devices(self, *args, **kwargs):
        return [types.SimpleNamespace(core_count=self._sms, platform="gpu")]

    local_devices = devices


@functools.cache
def _has_gpu_devices() -> bool:
    try:
        return hasattr(jax.devices()[0], "core_count") and jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def _call_with_sm_count(module, fn, *args, **kwargs):
    """Call a kernel builder that reads the SM count from jax.devices(), on a host without a GPU too."""
    if _has_gpu_devices():
        return fn(*args, **kwargs)
    saved = module.jax
    module.jax = _JaxWithTargetDevices(HOPPER_SMS)
    try:
        return fn(*args, **kwargs)
    finally:
        module.jax = saved


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The two raw kernels; tests substitute reference implementations with the same contract.

    forward(x[M, K], w[G, K, N] or [G, N, K] when transpose_rhs, sizes) -> [M, N]: rows of a
        group are written, rows past the groups are left unspecified.
    weight_grad(x[M, K], dy[M, N], sizes) -> [G, K, N]: x_g^T dy_g, zero for empty groups.
    """

    forward: callable
    weight_grad: callable


def mosaic_kernels(tiles: dict | None = None) -> Kernels:
    """jax's Hopper kernels behind the `Kernels` contract; the forward kernel's tiles from `tiles`
    (default TILES, see `forward_blocks`)."""
    ragged, transposed = mosaic_modules()

    def forward(x, w, sizes, transpose_rhs=False):
        n = w.shape[1] if transpose_rhs else w.shape[2]
        blocks = forward_blocks(x.shape[1], n, transpose_rhs, tiles)
        return ragged.ragged_dot(
            x,
            w,
            group_sizes=sizes,
            block_m=blocks.m,
            block_n=blocks.n,
            block_k=blocks.k,
            max_concurrent_steps=blocks.stages,
            grid_block_n=1,
            transpose_rhs=transpose_rhs,
        )

    def weight_grad(x, dy, sizes):
        # The kernel's output is [G, K, N]: K (x's features) is its row dim, the rows its contraction.
        out_blocks = pick_blocks(64, dy.shape[1])
        return _call_with_sm_count(
            transposed,
            transposed.transposed_ragged_dot,
            x,
            dy,
            group_sizes=sizes,
            block_m=pick_blocks(64, x.shape[1]).n,
            block_n=out_blocks.n,
            block_k=out_blocks.k,
            max_concurrent_steps=out_blocks.stages,
            grid_block_n=1,
        )

    # Each call is its own jit: jax lowers a jitted function once per module for each distinct
    # shape, so the copies a program holds of one GEMM (remat's recomputation, the MTP layer's
    # block, each bucket's backward) share one kernel lowering, the slow part of lowering
    # these kernels. XLA inlines the calls; nothing changes at run time.
    return Kernels(jax.jit(forward, static_argnames="transpose_rhs"), jax.jit(weight_grad))


def bucket_sizes(rows: int, block: int, buckets: int = BUCKETS) -> tuple[int, ...]:
    """Static row prefixes, ascending: whole blocks, the last one all `rows`."""
    blocks = -(-rows // block)
    sizes = sorted({min(rows, -(-blocks * i // buckets) * block) for i in range(1, buckets + 1)})
    return tuple(s for s in sizes if s > 0)


def _valid_rows(out, total):
    rows = jnp.arange(out.shape[0])[:, None]
    return jnp.where(rows < total, out, jnp.zeros((), out.dtype))


def _bucketed_forward(kernels: Kernels, x_MK, w, sizes_G, transpose_rhs: bool, buckets: int = BUCKETS):
    """forward() on the smallest of `buckets` row prefixes that holds every group's rows; zeros elsewhere."""
    m = x_MK.shape[0]
    total = jnp.sum(sizes_G)
    prefixes = bucket_sizes(m, Blocks().m, buckets)

    def run(rows):
        def branch(x_MK, w, sizes_G):
            out = _valid_rows(kernels.forward(x_MK[:rows], w, sizes_G, transpose_rhs=transpose_rhs), total)
            return jnp.pad(out, ((0, m - rows), (0, 0))) if rows < m else out

        return branch

    if len(prefixes) == 1:
        return run(m)(x_MK, w, sizes_G)
    index = jnp.searchsorted(jnp.asarray(prefixes, total.dtype), total, side="left")
    index = jnp.minimum(index, len(prefixes) - 1)
    return jax.lax.switch(index, [run(p) for p in prefixes], x_MK, w, sizes_G)


def make_grouped_matmul(kernels: Kernels):
    """A differentiable grouped matmul fn(x[M, K], w[G, K, N], sizes) -> [M, N] (x's dtype) over `kernels`."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def grouped_matmul(x_MK, w_GKN, sizes_G, axes, buckets):
        return vary_over(_bucketed_forward(kernels, x_MK, w_GKN, sizes_G, False, buckets), axes)

    def forward(x_MK, w_GKN, sizes_G, axes, buckets):
        return grouped_matmul(x_MK, w_GKN, sizes_G, axes, buckets), (x_MK, w_GKN, sizes_G)

    def backward(axes, buckets, residuals, dy_MN):
        x_MK, w_GKN, sizes_G = residuals
        # Rows past the groups carry no gradient; zero them so the kernels never read garbage.
        dy_MN = _valid_rows(dy_MN.astype(x_MK.dtype), jnp.sum(sizes_G))
        dx_MK = _bucketed_forward(kernels, dy_MN, w_GKN, sizes_G, True, buckets)
        dw_GKN = kernels.weight_grad(x_MK, dy_MN, sizes_G).astype(w_GKN.dtype)
        return vary_over(dx_MK, axes), vary_over(dw_GKN, axes), None

    grouped_matmul.defvjp(forward, backward)

    def call(x_MK, w_GKN, sizes_G, buckets=BUCKETS):
        x_MK, w_GKN, sizes_G = vary_alike(x_MK, w_GKN, sizes_G)  # maxmoe.kernels.varying: why
        axes = varying_axes(x_MK)
        return grouped_matmul(x_MK, w_GKN, sizes_G, axes, buckets)

    return call


@functools.cache
def _mosaic_kernels() -> Kernels:
    return mosaic_kernels()


@functools.cache
def _mosaic_grouped_matmul():
    return make_grouped_matmul(_mosaic_kernels())


def check_operands(x_MK, w_GKN) -> None:
    """Raise ValueError unless the kernels accept these operands."""
    if x_MK.dtype not in SUPPORTED_DTYPES or w_GKN.dtype != x_MK.dtype:
        raise ValueError(
            f"the Mosaic GPU grouped matmul needs bfloat16 or float16 operands of one dtype; got {x_MK.dtype} and "
            f"{w_GKN.dtype} (set model.compute_dtype=bfloat16)"
        )
    pick_blocks(w_GKN.shape[1], w_GKN.shape[2])
    pick_blocks(w_GKN.shape[2], w_GKN.shape[1])


def mosaic_grouped_matmul(x_MK, w_GKN, sizes_G, *, padded: bool = True):
    """Rows sorted by group times their group's weight, on jax's Hopper Mosaic GPU kernels.

    Same contract as `maxmoe.kernels.grouped_matmul.grouped_matmul`: rows past
    sum(sizes_G) give zeros; the result has x's dtype; differentiable in x and w.
    `padded=False` promises sum(sizes_G) == M (one device's sorted token copies): only the
    whole-buffer kernels are built, not one per row bucket.
    """
    check_operands(x_MK, w_GKN)
    return _mosaic_grouped_matmul()(x_MK, w_GKN, sizes_G.astype(jnp.int32), BUCKETS if padded else 1)


def mosaic_grouped_wgrad(x_MK, dy_MN, sizes_G):
    """dw[g] = x[rows of g]^T @ dy[rows of g] [G, K, N] on the transposed Hopper kernel alone
    (the weight gradient of `mosaic_grouped_matmul` without its forward); dy's rows past
    sum(sizes_G) are zeroed first. bf16/f16 operands of one dtype; K and N multiples of 64."""
    if x_MK.dtype not in SUPPORTED_DTYPES or dy_MN.dtype != x_MK.dtype:
        raise ValueError(
            f"the Mosaic GPU weight gradient needs bfloat16 or float16 operands of one dtype; got "
            f"{x_MK.dtype} and {dy_MN.dtype}"
        )
    pick_blocks(x_MK.shape[1], dy_MN.shape[1])
    x_MK, dy_MN, sizes_G = vary_alike(x_MK, dy_MN, sizes_G.astype(jnp.int32))
    dy_MN = _valid_rows(dy_MN, jnp.sum(sizes_G))
    return vary_over(_mosaic_kernels().weight_grad(x_MK, dy_MN, sizes_G), varying_axes(x_MK))
