"""Causal attention cores in plain XLA: the dense oracle and a chunked (flash-style) version.

  xla      softmax(q k^T * scale) v with the whole [B, H, T, S] score matrix in float32 and a
           mask: memory quadratic in T, the masked upper half computed too. The oracle.
  chunked  the same result from [C, C] blocks with an online softmax under one custom VJP: only
           blocks on or below the diagonal are computed and nothing of size T x S is held (the
           backward keeps q, k, v, the output and one float32 log-sum-exp per query, and
           recomputes each block's scores). Memory linear in T; any platform.
  latent   context parallelism's core (`latent_attention`): a device's queries, at any positions,
           against the whole sequence's MLA latents, up-projected to keys and values block by
           block inside the key loop; its own VJP (maxmoe.parallel.context).
Precision matches the oracle: scores, softmax statistics and accumulators in float32, the
probabilities cast to v's dtype before the value matmul. GPU kernels (Pallas Triton, cuDNN) live
in maxmoe.kernels.attention; the choice among cores: docs/KERNELS.md, "Kernel choice".
Axis legend: B batch, T query time, S key time, H heads, K qk head dim, V v head dim, C chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxmoe.parallel.names import ATTENTION_CORE_SCOPE

NEG_INF = float(jnp.finfo(jnp.float32).min)


def xla_attention(q_BTHK, k_BSHK, v_BSHV, scale: float) -> jax.Array:
    """Softmax(q k^T * scale) v with a causal mask; scores and softmax in float32."""
    with jax.named_scope(ATTENTION_CORE_SCOPE):  # a profile's attention class (maxmoe.analysis.trace_breakdown)
        return _xla_attention(q_BTHK, k_BSHK, v_BSHV, scale)


def _xla_attention(q_BTHK, k_BSHK, v_BSHV, scale: float) -> jax.Array:
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
    with jax.named_scope(ATTENTION_CORE_SCOPE):
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


# ----------------------------------------------------------------------------------------
# Latent attention for context parallelism: local queries against the whole sequence's latents.
#
# Axis legend here: T local queries, S all keys (natural order), L kv latent, R rope dim,
# N qk_nope head dim, g query groups, n key blocks.


def latent_attention(
    q_BTHK, q_positions_BT, latent_BSL, k_rope_BSR, w_k_up_LHN, w_v_up_LHV, *, scale: float, block: int = 512
) -> jax.Array:
    """Causal MLA for queries at `q_positions` against keys 0..S-1 given as latents (the context-parallel core).

    q_BTHK: the queries [nope | rope], any positions (a device's zigzag chunks);
    latent_BSL, k_rope_BSR: the normalised kv latent and post-RoPE shared rope key of the whole
    sequence in natural order; w_k_up_LHN, w_v_up_LHV: the key and value up-projections.
    Equals softmax(q k^T * scale, causal by position) v with k = [latent w_k_up | k_rope] and
    v = latent w_v_up, but the up-projection runs inside the key loop, one block of `block`
    keys at a time, each block up-projected once (forward) and once again (backward): keys
    and values of the whole sequence never exist. Query groups (of up to `block` queries)
    whose last position precedes a key block skip it, so a device holding zigzag chunks
    d and 2C-1-d visits 2C + 1 chunks' worth of blocks, like every other device.
    Its own VJP returns the latents' and rope keys' gradients per key block.
    """
    t, s = q_BTHK.shape[1], latent_BSL.shape[1]
    return _latent(
        q_BTHK, q_positions_BT, latent_BSL, k_rope_BSR, w_k_up_LHN, w_v_up_LHV,
        float(scale), chunk_size(t, block), chunk_size(s, block),
    )  # fmt: skip


def latent_attention_forward(
    q_BTHK, q_positions_BT, latent_BSL, k_rope_BSR, w_k_up_LHN, w_v_up_LHV, *, scale: float, block: int = 512
):
    """`latent_attention`'s forward: the output [B, T, H, V] and the float32 log-sum-exp its backward needs."""
    cq, ck = chunk_size(q_BTHK.shape[1], block), chunk_size(latent_BSL.shape[1], block)
    return _latent_forward(q_BTHK, q_positions_BT, latent_BSL, k_rope_BSR, w_k_up_LHN, w_v_up_LHV, float(scale), cq, ck)


def latent_attention_backward(
    q_BTHK,
    q_positions_BT,
    latent_BSL,
    k_rope_BSR,
    w_k_up_LHN,
    w_v_up_LHV,
    out_BTHV,
    lse,
    d_out_BTHV,
    *,
    scale,
    block=512,
):
    """`latent_attention`'s backward: (dq, d_latent, d_k_rope, d_w_k_up, d_w_v_up) from the forward's output and lse."""
    cq, ck = chunk_size(q_BTHK.shape[1], block), chunk_size(latent_BSL.shape[1], block)
    residuals = (q_BTHK, q_positions_BT, latent_BSL, k_rope_BSR, w_k_up_LHN, w_v_up_LHV, out_BTHV, lse)
    dq, _, d_latent, d_rope, dw_k, dw_v = _latent_bwd(float(scale), cq, ck, residuals, d_out_BTHV)
    return dq, d_latent, d_rope, dw_k, dw_v


def _groups(x_BT_, size):
    """[B, T, *] -> [g, B, size, *]."""
    b, t = x_BT_.shape[:2]
    return x_BT_.reshape(b, t // size, size, *x_BT_.shape[2:]).swapaxes(0, 1)


def _latent_scores(q_BTHK, q_pos_BT, k_nope_BSHN, k_rope_BSR, k_start, scale):
    """Scaled float32 scores [B, H, T, S] of one query group against one key block, causally masked."""
    nope = k_nope_BSHN.shape[-1]
    scores = jnp.einsum("bthn,bshn->bhts", q_BTHK[..., :nope], k_nope_BSHN, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bthr,bsr->bhts", q_BTHK[..., nope:], k_rope_BSR, preferred_element_type=jnp.float32)
    visible_BTS = q_pos_BT[:, :, None] >= (k_start + jnp.arange(k_nope_BSHN.shape[1]))[None, None, :]
    return jnp.where(visible_BTS[:, None], scores * scale, NEG_INF)


def _up(latent_BSL, w_LH_):
    return jnp.einsum("bsl,lhk->bshk", latent_BSL, w_LH_)


def _latent_forward(q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, scale, cq, ck):
    """Output [B, T, H, V] and float32 log-sum-exp [g, B, H, cq]; key blocks outer, query groups inner."""
    b, _, h, _ = q_BTHK.shape
    vd = w_v_LHV.shape[-1]
    q_g, pos_g = _groups(q_BTHK, cq), _groups(q_pos_BT, cq)
    last_g = pos_g.max(axis=(1, 2))  # the last position of each query group
    lat_n, rope_n = _groups(latent_BSL, ck), _groups(k_rope_BSR, ck)
    ng = q_g.shape[0]

    def key_block(carry, j):
        k_nope, v = _up(lat_n[j], w_k_LHN), _up(lat_n[j], w_v_LHV)

        def group(g, carry):
            acc_g, max_g, sum_g = carry

            def update(state):
                acc, row_max, row_sum = state
                scores = _latent_scores(q_g[g], pos_g[g], k_nope, rope_n[j], j * ck, scale)
                new_max = jnp.maximum(row_max, scores.max(-1))
                probs = jnp.exp(scores - new_max[..., None])
                rescale = jnp.exp(row_max - new_max)
                pv = jnp.einsum("bhts,bshv->bhtv", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
                return acc * rescale[..., None] + pv, new_max, row_sum * rescale + probs.sum(-1)

            # Key block 0 is visible to every query, so each row's running max is finite after it.
            new = jax.lax.cond(last_g[g] >= j * ck, update, lambda x: x, (acc_g[g], max_g[g], sum_g[g]))
            return acc_g.at[g].set(new[0]), max_g.at[g].set(new[1]), sum_g.at[g].set(new[2])

        return jax.lax.fori_loop(0, ng, group, carry), None

    init = (
        jnp.zeros((ng, b, h, cq, vd), jnp.float32),
        jnp.full((ng, b, h, cq), NEG_INF, jnp.float32),
        jnp.zeros((ng, b, h, cq), jnp.float32),
    )
    (acc, row_max, row_sum), _ = jax.lax.scan(key_block, init, jnp.arange(lat_n.shape[0]))
    out_gBCHV = (acc / row_sum[..., None]).transpose(0, 1, 3, 2, 4).astype(latent_BSL.dtype)
    return _unblocks(out_gBCHV), row_max + jnp.log(row_sum)


# Inside a scan (the layer stack) jax's partial evaluation would split these loops and keep every
# block's probabilities as residuals; as a checkpoint with nothing saveable it keeps the inputs.
_latent_forward = jax.checkpoint(
    _latent_forward, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=(6, 7, 8)
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _latent(q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, scale, cq, ck):
    return _latent_forward(q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, scale, cq, ck)[0]


def _latent_fwd(q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, scale, cq, ck):
    out, lse = _latent_forward(q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, scale, cq, ck)
    return out, (q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, out, lse)


def _latent_bwd(scale, cq, ck, residuals, d_out_BTHV):
    """Per key block: up-project once, visit the query groups that see it, fold dk and dv back into
    the latent's, the rope key's and the up-projections' gradients."""
    q_BTHK, q_pos_BT, latent_BSL, k_rope_BSR, w_k_LHN, w_v_LHV, out_BTHV, lse_g = residuals
    dt, nope = latent_BSL.dtype, w_k_LHN.shape[-1]
    q_g, pos_g, do_g = _groups(q_BTHK, cq), _groups(q_pos_BT, cq), _groups(d_out_BTHV.astype(dt), cq)
    last_g = pos_g.max(axis=(1, 2))
    # delta = rowsum(dO * O): the softmax backward's correction term, one float32 per query.
    delta_BHT = jnp.einsum("bthv,bthv->bht", d_out_BTHV.astype(jnp.float32), out_BTHV.astype(jnp.float32))
    delta_g = delta_BHT.reshape(*delta_BHT.shape[:2], -1, cq).transpose(2, 0, 1, 3)
    lat_n, rope_n = _groups(latent_BSL, ck), _groups(k_rope_BSR, ck)
    ng = q_g.shape[0]

    def key_block(carry, j):
        dq_g, dw_k, dw_v = carry
        lat, k_rope = lat_n[j], rope_n[j]
        k_nope, v = _up(lat, w_k_LHN), _up(lat, w_v_LHV)

        def group(g, inner):
            def update(state):
                dk_nope, dk_rope, dv, dq = state
                q, do = q_g[g], do_g[g]
                scores = _latent_scores(q, pos_g[g], k_nope, k_rope, j * ck, scale)
                probs = jnp.exp(scores - lse_g[g][..., None])
                dv = dv + jnp.einsum("bhts,bthv->bshv", probs.astype(dt), do, preferred_element_type=jnp.float32)
                d_probs = jnp.einsum("bthv,bshv->bhts", do, v, preferred_element_type=jnp.float32)
                d_scores = (probs * (d_probs - delta_g[g][..., None]) * scale).astype(dt)
                dk_nope = dk_nope + jnp.einsum(
                    "bhts,bthn->bshn", d_scores, q[..., :nope], preferred_element_type=jnp.float32
                )
                dk_rope = dk_rope + jnp.einsum(
                    "bhts,bthr->bsr", d_scores, q[..., nope:], preferred_element_type=jnp.float32
                )
                dq_nope = jnp.einsum("bhts,bshn->bthn", d_scores, k_nope, preferred_element_type=jnp.float32)
                dq_rope = jnp.einsum("bhts,bsr->bthr", d_scores, k_rope, preferred_element_type=jnp.float32)
                return dk_nope, dk_rope, dv, dq + jnp.concatenate([dq_nope, dq_rope], axis=-1)

            dk_nope, dk_rope, dv, dq_g = inner
            new = jax.lax.cond(last_g[g] >= j * ck, update, lambda x: x, (dk_nope, dk_rope, dv, dq_g[g]))
            return new[0], new[1], new[2], dq_g.at[g].set(new[3])

        zeros = (
            jnp.zeros(k_nope.shape, jnp.float32),
            jnp.zeros(k_rope.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32),
        )
        dk_nope, dk_rope, dv, dq_g = jax.lax.fori_loop(0, ng, group, (*zeros, dq_g))
        dk_nope, dv = dk_nope.astype(dt), dv.astype(dt)
        d_lat = jnp.einsum("bshn,lhn->bsl", dk_nope, w_k_LHN, preferred_element_type=jnp.float32)
        d_lat += jnp.einsum("bshv,lhv->bsl", dv, w_v_LHV, preferred_element_type=jnp.float32)
        dw_k = dw_k + jnp.einsum("bsl,bshn->lhn", lat, dk_nope, preferred_element_type=jnp.float32)
        dw_v = dw_v + jnp.einsum("bsl,bshv->lhv", lat, dv, preferred_element_type=jnp.float32)
        return (dq_g, dw_k, dw_v), (d_lat, dk_rope)

    init = (
        jnp.zeros(q_g.shape, jnp.float32),
        jnp.zeros(w_k_LHN.shape, jnp.float32),
        jnp.zeros(w_v_LHV.shape, jnp.float32),
    )
    (dq_g, dw_k, dw_v), (d_lat_n, d_rope_n) = jax.lax.scan(key_block, init, jnp.arange(lat_n.shape[0]))
    return (
        _unblocks(dq_g).astype(q_BTHK.dtype),
        None,
        _unblocks(d_lat_n).astype(latent_BSL.dtype),
        _unblocks(d_rope_n).astype(k_rope_BSR.dtype),
        dw_k.astype(w_k_LHN.dtype),
        dw_v.astype(w_v_LHV.dtype),
    )


_latent.defvjp(_latent_fwd, _latent_bwd)
