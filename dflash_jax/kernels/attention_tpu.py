"""Attention of a decode or verify block over the K/V cache as a Pallas TPU (Mosaic) kernel; its oracle is
``attention.attention_reference`` (same arguments, same cache layout).

Why: on TPU the XLA form of verify's attention (16 tokens x the query heads of each KV head scoring every
cached key) writes its f32 scores to HBM and reads them back in each softmax pass: ~4x the K/V bytes the op
must read (docs/compile.md). Here one program per (row, KV head) walks the cache in key blocks with an online
softmax (running max, sum and f32 accumulator in VMEM; the M = T x query heads per KV head query rows stacked
t-major): HBM sees q once, each key block of K [S, H] and V [H, S] that holds a visible key once, and the output
once. Step j of a row's walk visits key block first + j, first being the block of the row's first visible key
(so blocks wholly before a sliding window are never visited); steps past its last visible block map onto that
block, which the pipeline already holds, so they cost no transfer and no compute. With a causal window the walk
has at most ``steps`` = (window + T - 2) // bk + 2 steps whatever the cache's length (the keys any query sees
span window + T - 1 positions); otherwise one per key block. The cache's length S is bounded only by HBM.
``traffic`` is that accounting (the compiler cannot see inside a Mosaic call; the call hands it the static bound,
every step's block). A query that sees no key at all returns zeros (the reference averages V then).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG = -1e30  # finite "minus infinity": a fully masked row stays NaN-free


def key_block(S: int) -> int:
    """Keys per block: S/8 rounded down to a power of two in [512, 2048] (at most S): coarse enough to amortise a
    grid step, fine enough that the last, partly visible block wastes little at short contexts."""
    if S <= 512:
        return S
    bk = 512
    while bk < 2048 and 2 * bk <= S // 8:
        bk *= 2
    return bk


def _visible(q_start, kv_len, T: int, window: int | None, causal: bool):
    """The keys [lo, hi) some query of the row may see (traced int32 scalars)."""
    hi = jnp.minimum(kv_len, q_start + T) if causal else kv_len
    lo = jnp.maximum(q_start - window + 1, 0) if window is not None else 0
    return lo, jnp.maximum(hi, lo + 1)


def _block(j, q_start, kv_len, *, T, window, causal, bk):
    """(The key block step j visits, whether it computes): block first + j, clamped to the last visible one."""
    lo, hi = _visible(q_start, kv_len, T, window, causal)  # both >= 0: lax.div (no sign logic for Mosaic)
    blk, last = jax.lax.div(lo, bk) + j, jax.lax.div(hi - 1, bk)
    return jnp.minimum(blk, last), blk <= last


def steps(S: int, T: int, window: int | None, causal: bool) -> int:
    """Grid steps along the keys: every key block, or, with a causal window, the most blocks that the
    window + T - 1 keys any query of the row sees can touch."""
    bk = key_block(S)
    n = pl.cdiv(S, bk)
    return min(n, (window + T - 2) // bk + 2) if causal and window is not None else n


def _kernel(q_start_ref, kv_len_ref, q_ref, k_ref, v_ref, *rest, scale, causal, window, group, T, bk, tree):
    if tree:  # the tree's new keys [T, H] / [H, T] and its mask [M, T] (int32), then the output and scratch
        kn_ref, vn_ref, tree_ref, o_ref, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, m_ref, l_ref, acc_ref = rest
    b, j = pl.program_id(0), pl.program_id(2)
    q_start, kv_len = q_start_ref[b], kv_len_ref[b]  # with a tree: the prefix's length (the walk's keys)

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, _NEG)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    blk, live = _block(j, q_start, kv_len, T=T, window=window, causal=causal, bk=bk)

    @pl.when(live)
    def _():
        q = q_ref[0, 0]  # [M, H], rows t-major: row = t * group + g
        s = jax.lax.dot_general(q, k_ref[0, 0], (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * scale  # [M, bk]
        kpos = blk * bk + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        qpos = q_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, s.shape, 0), group)
        mask = kpos < kv_len
        if causal:
            mask = mask & (kpos <= qpos)
        if window is not None:
            mask = mask & (kpos > qpos - window)
        # keys past kv_len (the last block's tail, past S: unwritten memory) must not reach the sum even as NaN
        vpos = blk * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        _online(s, mask, jnp.where(vpos < kv_len, v_ref[0, 0], 0), m_ref, l_ref, acc_ref)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        if tree:  # the T new keys (cache rows q_start .. q_start + T - 1) each query's path marks
            s = jax.lax.dot_general(q_ref[0, 0], kn_ref[0, 0], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale  # [M, T]
            _online(s, tree_ref[0] != 0, vn_ref[0, 0], m_ref, l_ref, acc_ref)
        o_ref[0, 0] = (acc_ref[...] / jnp.maximum(l_ref[...], 1e-30)).astype(o_ref.dtype)


def _online(s, mask, v, m_ref, l_ref, acc_ref):
    """One online-softmax step: scores s [M, n] (f32) under ``mask`` [M, n] over values v [H, n] into the running
    max m [M, 1], sum l [M, 1] and accumulator acc [M, H]."""
    s = jnp.where(mask, s, _NEG)
    m_old = m_ref[...]  # [M, 1]
    m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_old - m_new)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [M, H]
    m_ref[...] = m_new


def traffic(q_start, kv_len, *, T: int, N: int, K: int, H: int, S: int, itemsize: int, causal: bool = True,
            window: int | None = None) -> int:
    """HBM bytes the kernel moves for rows (q_start [B], kv_len [B]), from its grid and block specs: the pipeline
    fetches a K and a V block at each grid step whose block index (the index maps' ``_block``) differs from the
    previous step's, per (row, KV head); q and the output move once."""
    bk = key_block(S)
    walk = jnp.arange(steps(S, T, window, causal))
    fetches = 0
    for qs, kl in zip(q_start, kv_len, strict=True):
        index, _ = _block(walk, jnp.int32(qs), jnp.int32(kl), T=T, window=window, causal=causal, bk=bk)
        fetches += 1 + int(jnp.count_nonzero(jnp.diff(index)))
    return K * fetches * 2 * bk * H * itemsize + 2 * len(q_start) * T * N * H * itemsize


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "interpret"))
def attention_tpu(q, k, v, q_start, kv_len, tree=None, *, causal=True, window=None, scale=None, interpret=False):
    """q [B, T, N, H], k [B, K, S, H], v [B, K, H, S], q_start [B], kv_len [B] -> [B, T, N, H] (q's dtype).

    ``attention_reference``'s contract, except that a query with no visible key returns zeros. ``tree``
    [B, T, T] bool (a draft tree's mask, ``attention_reference``'s): the walk covers the keys before q_start,
    and one more step at its end scores the T new keys (cache rows q_start + j, read once as [T, H] / [H, T])
    under the tree mask, repeated per query head of the group."""
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    M = T * G
    bk = key_block(S)
    scale = H**-0.5 if scale is None else scale
    extra, extra_specs, walk_len = (), [], kv_len
    if tree is not None:
        if window is not None or not causal:
            raise ValueError("attention_tpu: a tree mask replaces the causal mask (causal=True, no window)")
        if tree.shape != (B, T, T):
            raise ValueError(f"attention_tpu: tree mask shape {tree.shape}, want {(B, T, T)} (rows, queries, keys)")
        walk_len = jnp.minimum(kv_len, q_start)  # the prefix
        row = lambda c, s, n: jax.lax.dynamic_slice_in_dim(c, s, n, axis=1)  # noqa: E731
        written = q_start[:, None] + jnp.arange(T)[None, :] < kv_len[:, None]  # [B, T]: new keys in the cache
        # keys past kv_len (unwritten memory) must not reach the sum even as NaN
        kn = jnp.where(written[:, None, :, None], jax.vmap(lambda c, s: row(c, s, T))(k, q_start), 0)  # [B, K, T, H]
        vn = jnp.where(written[:, None, None, :], jax.vmap(
            lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, T, axis=2))(v, q_start), 0)  # [B, K, H, T]
        seen = tree & written[:, None, :]  # [B, T, T]
        extra = (kn, vn, jnp.repeat(seen.astype(jnp.int32), G, axis=1))  # mask [B, M, T], rows t-major
        extra_specs = [pl.BlockSpec((1, 1, T, H), lambda b, h, j, qs, kl: (b, h, 0, 0)),
                       pl.BlockSpec((1, 1, H, T), lambda b, h, j, qs, kl: (b, h, 0, 0)),
                       pl.BlockSpec((1, M, T), lambda b, h, j, qs, kl: (b, 0, 0))]
    qk = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, H)  # [B, K, M, H]
    at = lambda j, qs, kl: _block(j, qs, kl, T=T, window=window, causal=causal, bk=bk)[0]  # noqa: E731
    item = q.dtype.itemsize
    walked = min(S, steps(S, T, window, causal) * bk) + (T if tree is not None else 0)  # keys the walk can visit
    cost = pl.CostEstimate(flops=4 * B * K * M * walked * H, transcendentals=B * K * M * walked,
                           bytes_accessed=B * K * (2 * walked * H + 2 * M * H) * item)  # static bound
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, causal=causal, window=window, group=G, T=T, bk=bk,
                          tree=tree is not None),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, K, steps(S, T, window, causal)),
            in_specs=[pl.BlockSpec((1, 1, M, H), lambda b, h, j, qs, kl: (b, h, 0, 0)),
                      pl.BlockSpec((1, 1, bk, H), lambda b, h, j, qs, kl: (b, h, at(j, qs[b], kl[b]), 0)),
                      pl.BlockSpec((1, 1, H, bk), lambda b, h, j, qs, kl: (b, h, 0, at(j, qs[b], kl[b]))),
                      *extra_specs],
            out_specs=pl.BlockSpec((1, 1, M, H), lambda b, h, j, qs, kl: (b, h, 0, 0)),
            scratch_shapes=[pltpu.VMEM((M, 1), jnp.float32), pltpu.VMEM((M, 1), jnp.float32),
                            pltpu.VMEM((M, H), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((B, K, M, H), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost, interpret=interpret, name="attention_tpu",
    )(q_start.astype(jnp.int32), walk_len.astype(jnp.int32), qk, k, v, *extra)
    return out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
