"""Grouped matmul: rows of x, sorted by group, each multiplied by its group's weight.

    y_MF = grouped_matmul(x_MD, w_GDF, group_sizes_G, backend="mosaic_gpu")
    y_MD = grouped_swiglu(x_MD, group_sizes_G, w_gate_GDF, w_up_GDF, w_down_GFD, backend=...)
    dw_GDF = grouped_wgrad(x_MD, dy_MF, group_sizes_G, backend=...)      the weight gradient alone

Backends (`moe.grouped_matmul`, `auto` resolved by `maxmoe.kernels.choice` before a program is
built): "ragged_dot" (`jax.lax.ragged_dot`, G x the useful FLOPs on XLA:GPU; the CPU choice),
"mosaic_gpu" (jax's Hopper kernels, `maxmoe.kernels.mosaic_ragged_dot`), "tokamax", "dense_loop"
(the test oracle) and the dry run's "balanced_stand_in" (never a config choice: the kernels'
buffers on CPU, values ignoring the group sizes). Rows past sum(group_sizes) give zeros, groups
may be empty, accumulation is float32. GSPMD does not partition Pallas kernels: under a mesh
they run inside the dispatch's shard_map. docs/KERNELS.md, "Grouped GEMM backends" has what
each backend runs and costs.
Legend: M rows, D input features, F output features, G groups (local experts).
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import GROUPED_MATMUL_BACKENDS
from maxmoe.kernels.mosaic_ragged_dot import mosaic_grouped_matmul, mosaic_grouped_wgrad
from maxmoe.parallel.names import EXPERT_GATE_UP, GROUPED_GEMM_SCOPE

# The dry run's grouped GEMM (see the module docstring); not in GROUPED_MATMUL_BACKENDS.
BALANCED_STAND_IN = "balanced_stand_in"


def grouped_matmul(x_MD, w_GDF, group_sizes_G, *, backend: str = "ragged_dot", padded: bool = True):
    """Multiply each group of rows of `x_MD` by that group's weight matrix.

    Rows are sorted by group: rows [sum(group_sizes[:g]), sum(group_sizes[:g+1]))
    belong to group g. `sum(group_sizes)` may be less than M (the buffer is padded
    for the worst case); rows past the sum give zeros. Groups may be empty.
    Accumulation is in float32 whatever the input dtype.

    Args:
        x_MD: [M, D] rows sorted by group.
        w_GDF: [G, D, F] one weight matrix per group.
        group_sizes_G: [G] int, rows per group; sum <= M.
        backend: one of maxmoe.config.GROUPED_MATMUL_BACKENDS (already resolved: not "auto").
        padded: False promises sum(group_sizes) == M, so kernels need not size work to the valid rows.

    Returns:
        [M, F] in the dtype of `x_MD`.

    Raises:
        ValueError: for an unknown backend, or operands the backend cannot take.
    """
    with jax.named_scope(GROUPED_GEMM_SCOPE):  # a profile's grouped-GEMM class (maxmoe.analysis.trace_breakdown)
        return _grouped_matmul(x_MD, w_GDF, group_sizes_G, backend, padded)


def _grouped_matmul(x_MD, w_GDF, group_sizes_G, backend: str, padded: bool):
    if backend == "ragged_dot":
        out_MF = jax.lax.ragged_dot(x_MD, w_GDF, group_sizes_G, preferred_element_type=jnp.float32)
    elif backend == "mosaic_gpu":
        out_MF = mosaic_grouped_matmul(x_MD, w_GDF, group_sizes_G, padded=padded)
    elif backend == "tokamax":
        out_MF = _tokamax(x_MD, w_GDF, group_sizes_G)
    elif backend == "dense_loop":
        out_MF = _dense_loop(x_MD, w_GDF, group_sizes_G)
    elif backend == BALANCED_STAND_IN:
        out_MF = _balanced_stand_in(x_MD, w_GDF, group_sizes_G)
    else:
        allowed = ", ".join(repr(b) for b in GROUPED_MATMUL_BACKENDS)
        raise ValueError(f"unknown grouped_matmul backend {backend!r}; expected one of {allowed}")
    return out_MF.astype(x_MD.dtype)


def grouped_swiglu(
    x_MD, group_sizes_G, w_gate_GDF, w_up_GDF, w_down_GFD, *, backend: str = "ragged_dot", padded: bool = True
):
    """down(silu(x @ gate) * (x @ up)) per group, with gate and up as one [D, 2F] GEMM.

    The weights stay separate parameters (checkpoints and the HF mapping keep w_gate and
    w_up); they are concatenated here, on local shards, so the kernel reads x once.
    """
    f = w_gate_GDF.shape[2]
    w_gate_up_GD2F = jnp.concatenate([w_gate_GDF, w_up_GDF], axis=2)
    gate_up_M2F = grouped_matmul(x_MD, w_gate_up_GD2F, group_sizes_G, backend=backend, padded=padded)
    gate_up_M2F = checkpoint_name(gate_up_M2F, EXPERT_GATE_UP)
    hidden_MF = jax.nn.silu(gate_up_M2F[:, :f]) * gate_up_M2F[:, f:]
    return grouped_matmul(hidden_MF, w_down_GFD, group_sizes_G, backend=backend, padded=padded)


def tokamax_problem() -> str:
    """'' when tokamax imports, else why not."""
    try:
        import tokamax  # noqa: F401 - optional: imported where used
    except Exception as e:  # noqa: BLE001 - any import failure means not usable here
        return f"tokamax is not installed ({type(e).__name__}; needs Python >= 3.12 and jax >= 0.11.1)"
    return ""


def _tokamax(x_MD, w_GDF, group_sizes_G):
    """tokamax.ragged_dot with the rows past the groups zeroed on the way in and out.

    Its kernels may leave rows no group covers unwritten (and their dx too): zeroing the
    input rows makes their gradient zero, zeroing the output gives the contract above.
    """
    problem = tokamax_problem()
    if problem:
        raise ValueError(f"moe.grouped_matmul=tokamax: {problem}")
    import tokamax

    valid_M1 = (jnp.arange(x_MD.shape[0]) < jnp.sum(group_sizes_G))[:, None]
    x_MD = jnp.where(valid_M1, x_MD, jnp.zeros((), x_MD.dtype))
    out_MF = tokamax.ragged_dot(x_MD, w_GDF, group_sizes_G.astype(jnp.int32), preferred_element_type=jnp.float32)
    return jnp.where(valid_M1, out_MF, 0.0)


def _group_masks(group_sizes_G, rows: int):
    """[G, M] bool: whether row m belongs to group g (rows sorted by group)."""
    ends_G = jnp.cumsum(group_sizes_G)
    rows_M = jnp.arange(rows)
    return (rows_M >= (ends_G - group_sizes_G)[:, None]) & (rows_M < ends_G[:, None])


def keep_live(out, group_sizes_G):
    """out, with the group sizes read (as zero) so a stand-in keeps them live in the program."""
    return out + jnp.sum(group_sizes_G).astype(out.dtype) * 0


def _dense_loop(x_MD, w_GDF, group_sizes_G):
    """Reference: for each group, a full [M, D] x [D, F] matmul masked to its rows."""
    in_group_GM = _group_masks(group_sizes_G, x_MD.shape[0])
    out_MF = jnp.zeros((x_MD.shape[0], w_GDF.shape[2]), jnp.float32)
    for g in range(w_GDF.shape[0]):
        in_group_M = in_group_GM[g]
        product_MF = jnp.einsum("md,df->mf", x_MD, w_GDF[g], preferred_element_type=jnp.float32)
        out_MF = out_MF + jnp.where(in_group_M[:, None], product_MF, 0.0)
    return out_MF


def balanced_blocks(x_MD, groups: int):
    """[G, R, ...]: x's rows as `groups` equal blocks of R = ceil(M / G), zero rows at the end."""
    rows = -(-x_MD.shape[0] // groups)
    pad = [(0, rows * groups - x_MD.shape[0])] + [(0, 0)] * (x_MD.ndim - 1)
    return jnp.pad(x_MD, pad).reshape(groups, rows, *x_MD.shape[1:])


def _balanced_stand_in(x_MD, w_GDF, group_sizes_G):
    """Dry runs: the rows as G equal blocks, one batched [M/G, D] x [D, F] GEMM per group.

    The buffers and FLOPs of a grouped GEMM over a full buffer of balanced groups; the
    values are the grouped product only when the groups are M/G rows each (group sizes are
    read only to keep them live).
    """
    m = x_MD.shape[0]
    out_GRF = jnp.einsum(
        "grd,gdf->grf", balanced_blocks(x_MD, w_GDF.shape[0]), w_GDF, preferred_element_type=jnp.float32
    )
    return keep_live(out_GRF.reshape(-1, w_GDF.shape[2])[:m], group_sizes_G)


WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
)


def grouped_wgrad(x_MD, dy_MF, group_sizes_G, *, backend: str = "ragged_dot"):
    """dw[g] = x[rows of g]^T @ dy[rows of g]: the weight gradient of `grouped_matmul` alone.

    [G, D, F] float32 (the kernels' own output dtype where they round). Rows past
    sum(group_sizes) contribute nothing. Per backend: "ragged_dot" a ragged_dot_general over
    the rows (XLA:GPU, and XLA:CPU, rewrite it into a dense dot over a masked [G, M, D] copy
    of x); "mosaic_gpu" the transposed Hopper kernel alone; "tokamax" tokamax's VJP of its
    ragged dot (the forward traced with it is unused; not checked that XLA removes it);
    "dense_loop" a masked product per group; the balanced stand-in one batched product over
    G equal row blocks (exact for M/G rows each).
    """
    with jax.named_scope(GROUPED_GEMM_SCOPE):
        return _grouped_wgrad(x_MD, dy_MF, group_sizes_G, backend)


def _grouped_wgrad(x_MD, dy_MF, group_sizes_G, backend: str):
    g = group_sizes_G.shape[0]
    if backend == "ragged_dot":
        return jax.lax.ragged_dot_general(x_MD, dy_MF, group_sizes_G, WGRAD_DIMS, preferred_element_type=jnp.float32)
    if backend == "mosaic_gpu":
        return mosaic_grouped_wgrad(x_MD, dy_MF, group_sizes_G).astype(jnp.float32)
    if backend == "tokamax":
        w_GDF = jnp.zeros((g, x_MD.shape[1], dy_MF.shape[1]), x_MD.dtype)
        _, vjp = jax.vjp(lambda w: _tokamax(x_MD, w, group_sizes_G), w_GDF)
        return vjp(dy_MF.astype(jnp.float32))[0].astype(jnp.float32)
    if backend == "dense_loop":
        in_group_GM = _group_masks(group_sizes_G, x_MD.shape[0]).astype(x_MD.dtype)
        return jnp.einsum("md,mf,gm->gdf", x_MD, dy_MF, in_group_GM, preferred_element_type=jnp.float32)
    if backend == BALANCED_STAND_IN:
        dw_GDF = jnp.einsum(
            "grd,grf->gdf", balanced_blocks(x_MD, g), balanced_blocks(dy_MF, g), preferred_element_type=jnp.float32
        )
        return keep_live(dw_GDF, group_sizes_G)
    allowed = ", ".join(repr(b) for b in GROUPED_MATMUL_BACKENDS)
    raise ValueError(f"unknown grouped_matmul backend {backend!r}; expected one of {allowed}")
