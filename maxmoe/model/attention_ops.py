"""Causal attention cores in plain XLA: the dense oracle and a chunked (flash-style) version.

  xla      softmax(q k^T * scale) v with the whole [B, H, T, S] score matrix in float32 and
           a mask: memory quadratic in T, the masked upper half computed too. The oracle.
  chunked  the same result from [C, C] blocks with an online softmax, forward and backward
           written as loops under one custom VJP: only the blocks on or below the diagonal
           are computed, and nothing of size T x S is ever held -- the backward pass keeps
           q, k, v, the output and one float32 log-sum-exp per query, and recomputes each
           block's scores. Memory is linear in T; any platform.
GPU kernels (Pallas Triton, cuDNN) live in maxmoe.kernels.attention.

Precision matches the oracle: scores, softmax statistics and accumulators in float32, the
probabilities cast to v's dtype before the value matmul.

Axis legend: B batch, T query time, S key time, H heads, K qk head dim, V v head dim, C chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = float(jnp.finfo(jnp.float32).min)


def xla_attention(q_BTHK, k_BSHK, v_BSHV, scale: float) -> jax.Array:
    """Softmax(q k^T * scale) v with a causal mask; scores and softmax in float32."""
    scores = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=jnp.float32) * scale
    t, s = q_BTHK.shape[1], k_BSHK.shape[1]
    mask_TS = jnp.arange(t)[:, None] >= jnp.arange(s)[None, :]
    scores = jnp.where(mask_TS, scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSHV.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, v_BSHV)


def chunk_size(t: int, preferred: int) -> int:
    """The largest divisor of t that is <= preferred."""
    return next(c for c in range(min(t, preferred), 0, -1) if t % c == 0)


def chunked_attention(q_BTHK, k_BSHK, v_BSHV, scale: float, chunk: int = 512) -> jax.Array:
    """Causal attention equal to `xla_attention`, computed in [chunk, chunk] blocks (T == S)."""
    t = q_BTHK.shape[1]
    if k_BSHK.shape[1] != t:
        raise ValueError(f"chunked attention is self-attention: {t} queries, {k_BSHK.shape[1]} keys")
    return _chunked(q_BTHK, k_BSHK, v_BSHV, float(scale), chunk_size(t, chunk))


def _blocks(x_BTH_, c):
    """[B, T, H, *] -> [n, B, C, H, *]: chunk i of the sequence at index i."""
    b, t = x_BTH_.shape[:2]
    return x_BTH_.reshape(b, t // c, c, *x_BTH_.shape[2:]).swapaxes(0, 1)


def _unblocks(x_nBCH_):
    n, b, c = x_nBCH_.shape[:3]
    return x_nBCH_.swapaxes(0, 1).reshape(b, n * c, *x_nBCH_.shape[3:])


def _block_scores(q_BCHK, k_BCHK, i, j, scale):
    """Scaled float32 scores [B, H, C, C] of query block i against key block j, causally masked."""
    c = q_BCHK.shape[1]
    scores = jnp.einsum("bthk,bshk->bhts", q_BCHK, k_BCHK, preferred_element_type=jnp.float32) * scale
    visible = (i * c + jnp.arange(c))[:, None] >= (j * c + jnp.arange(c))[None, :]
    return jnp.where(visible, scores, NEG_INF)


def _forward(q_BTHK, k_BSHK, v_BSHV, scale, c):
    """Output [B, T, H, V] and float32 log-sum-exp [n, B, H, C] per query."""
    q_n, k_n, v_n = _blocks(q_BTHK, c), _blocks(k_BSHK, c), _blocks(v_BSHV, c)
    b, _, h, _ = q_BTHK.shape
    vd = v_BSHV.shape[-1]

    def query_block(_, i):
        q = q_n[i]

        def key_block(j, carry):
            acc_BHCV, max_BHC, sum_BHC = carry
            scores = _block_scores(q, k_n[j], i, j, scale)
            new_max = jnp.maximum(max_BHC, scores.max(-1))
            probs = jnp.exp(scores - new_max[..., None])
            rescale = jnp.exp(max_BHC - new_max)
            pv = jnp.einsum("bhts,bshv->bhtv", probs.astype(v_n.dtype), v_n[j], preferred_element_type=jnp.float32)
            return acc_BHCV * rescale[..., None] + pv, new_max, sum_BHC * rescale + probs.sum(-1)

        init = (
            jnp.zeros((b, h, c, vd), jnp.float32),
            jnp.full((b, h, c), NEG_INF, jnp.float32),
            jnp.zeros((b, h, c), jnp.float32),
        )
        # Key blocks past the diagonal are never visited: the loop stops at block i.
        acc, row_max, row_sum = jax.lax.fori_loop(0, i + 1, key_block, init)
        out_BCHV = (acc / row_sum[..., None]).transpose(0, 2, 1, 3).astype(v_BSHV.dtype)
        return None, (out_BCHV, row_max + jnp.log(row_sum))

    _, (out_n, lse_n) = jax.lax.scan(query_block, None, jnp.arange(q_n.shape[0]))
    return _unblocks(out_n), lse_n


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(q_BTHK, k_BSHK, v_BSHV, scale, c):
    return _forward(q_BTHK, k_BSHK, v_BSHV, scale, c)[0]


def _chunked_fwd(q_BTHK, k_BSHK, v_BSHV, scale, c):
    out, lse_n = _forward(q_BTHK, k_BSHK, v_BSHV, scale, c)
    return out, (q_BTHK, k_BSHK, v_BSHV, out, lse_n)


def _chunked_bwd(scale, c, residuals, d_out_BTHV):
    """Flash-attention backward: per key block j, the query blocks i >= j; dq accumulated in place."""
    q_BTHK, k_BSHK, v_BSHV, out_BTHV, lse_n = residuals
    q_n, k_n, v_n = _blocks(q_BTHK, c), _blocks(k_BSHK, c), _blocks(v_BSHV, c)
    do_n = _blocks(d_out_BTHV.astype(v_BSHV.dtype), c)
    # delta = rowsum(dO * O): the softmax backward's correction term, one float32 per query.
    delta_n = _blocks(
        jnp.einsum("bthv,bthv->bth", d_out_BTHV.astype(jnp.float32), out_BTHV.astype(jnp.float32))[..., None], c
    )[..., 0].transpose(0, 1, 3, 2)
    n = q_n.shape[0]

    def key_block(dq_nBCHK, j):
        k, v = k_n[j], v_n[j]

        def query_block(i, carry):
            dk_BCHK, dv_BCHV, dq_nBCHK = carry
            q, do = q_n[i], do_n[i]
            probs = jnp.exp(_block_scores(q, k, i, j, scale) - lse_n[i][..., None])  # [B, H, Cq, Ck]
            dv_BCHV = dv_BCHV + jnp.einsum(
                "bhts,bthv->bshv", probs.astype(do.dtype), do, preferred_element_type=jnp.float32
            )
            d_probs = jnp.einsum("bthv,bshv->bhts", do, v, preferred_element_type=jnp.float32)
            d_scores = probs * (d_probs - delta_n[i][..., None]) * scale
            dk_BCHK = dk_BCHK + jnp.einsum(
                "bhts,bthk->bshk", d_scores.astype(q.dtype), q, preferred_element_type=jnp.float32
            )
            dq_i = jnp.einsum("bhts,bshk->bthk", d_scores.astype(k.dtype), k, preferred_element_type=jnp.float32)
            return dk_BCHK, dv_BCHV, dq_nBCHK.at[i].add(dq_i)

        init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), dq_nBCHK)
        # Query blocks before the diagonal never see key block j: the loop starts at j.
        dk, dv, dq_nBCHK = jax.lax.fori_loop(j, n, query_block, init)
        return dq_nBCHK, (dk, dv)

    dq_n, (dk_n, dv_n) = jax.lax.scan(key_block, jnp.zeros(q_n.shape, jnp.float32), jnp.arange(n))
    return (
        _unblocks(dq_n).astype(q_BTHK.dtype),
        _unblocks(dk_n).astype(k_BSHK.dtype),
        _unblocks(dv_n).astype(v_BSHV.dtype),
    )


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
