"""Grouped matmul: rows of x, sorted by group, each multiplied by its group's weight.

Legend: M rows, D input features, F output features, G groups (local experts).

Backends:
  "ragged_dot"  `jax.lax.ragged_dot`, one fused grouped GEMM; the production path.
  "dense_loop"  a plain loop over groups that masks rows and does a full matmul per
                group: G times the FLOPs, kept as the test oracle and for debugging.
"""

import jax
import jax.numpy as jnp

from maxmoe.config import GROUPED_MATMUL_BACKENDS


def grouped_matmul(x_MD, w_GDF, group_sizes_G, *, backend: str = "ragged_dot"):
    """Multiply each group of rows of `x_MD` by that group's weight matrix.

    Rows are sorted by group: rows [sum(group_sizes[:g]), sum(group_sizes[:g+1]))
    belong to group g. `sum(group_sizes)` may be less than M (the buffer is padded
    for the worst case); rows past the sum give zeros. Groups may be empty.
    Accumulation is in float32 whatever the input dtype.

    Args:
        x_MD: [M, D] rows sorted by group.
        w_GDF: [G, D, F] one weight matrix per group.
        group_sizes_G: [G] int, rows per group; sum <= M.
        backend: one of maxmoe.config.GROUPED_MATMUL_BACKENDS.

    Returns:
        [M, F] in the dtype of `x_MD`.

    Raises:
        ValueError: for an unknown backend.
    """
    if backend == "ragged_dot":
        out_MF = jax.lax.ragged_dot(x_MD, w_GDF, group_sizes_G, preferred_element_type=jnp.float32)
    elif backend == "dense_loop":
        out_MF = _dense_loop(x_MD, w_GDF, group_sizes_G)
    else:
        allowed = ", ".join(repr(b) for b in GROUPED_MATMUL_BACKENDS)
        raise ValueError(f"unknown grouped_matmul backend {backend!r}; expected one of {allowed}")
    return out_MF.astype(x_MD.dtype)


def _dense_loop(x_MD, w_GDF, group_sizes_G):
    """Reference: for each group, a full [M, D] x [D, F] matmul masked to its rows."""
    ends_G = jnp.cumsum(group_sizes_G)
    starts_G = ends_G - group_sizes_G
    rows_M = jnp.arange(x_MD.shape[0])
    out_MF = jnp.zeros((x_MD.shape[0], w_GDF.shape[2]), jnp.float32)
    for g in range(w_GDF.shape[0]):
        in_group_M = (rows_M >= starts_G[g]) & (rows_M < ends_G[g])
        product_MF = jnp.einsum("md,df->mf", x_MD, w_GDF[g], preferred_element_type=jnp.float32)
        out_MF = out_MF + jnp.where(in_group_M[:, None], product_MF, 0.0)
    return out_MF
