"""Attention of T new queries per row against a KV cache: target verify/decode and drafter blocks.

Where it sits: the target's gated full-attention layers (verify and decode) and the DFlash drafter's
attention layers call ``attention`` after RoPE and after writing the new K/V into the cache.

One contract serves both hot paths. The cache holds K/V for positions ``[0, kv_len)`` per row,
the new queries sit at positions ``q_start + t``. The cache layout (``cache_shapes``, ``write_cache``) is K
[B, K, S, H] and V [B, K, H, S]: each stored as its product reads it, contracting over the minor dimension
(scores q k^T over H, outputs p V over S), so XLA's dots take the caches as they are (with [B, S, K, H]
the CPU path copied both caches into those layouts on every call, ~1/4 of an attention layer's time at
656 rows), and one KV head's keys or values are one contiguous block for the kernel. The target's verify
is ``causal=True``; the DFlash drafter's block is ``causal=False`` (its block K/V were written behind the context), with
``window`` for its sliding-attention layers. GQA maps query head n to KV head n // (N // K), so
non-power-of-two groups (6 for Qwen3.5-27B) work. Softmax runs in f32.

The Pallas kernel is built for the decode/verify regime: few queries (T <= 16), a long cache,
memory bound. One program owns one (row b, KV head, split of S): it stacks the T x group query
rows that share the KV head into one [M, H] tile (M = T * group padded to a power of two >= 16, the
smallest MMA-friendly height), so every K/V block is read from HBM once per KV head instead of once
per query head. It walks S in blocks of ``block_k`` with an online softmax; the loop runs only over
the blocks some query can see (``kv_len``, the causal edge and the window bound it), so a short
row in a long-capacity cache costs its length, not the capacity. With ``k_splits > 1`` each program
takes one contiguous share of those blocks and writes f32 partials (acc, max, sum) that a jnp
combine merges: batch-1 decode has only K programs otherwise, far too few for 256 CUs.
HBM traffic ~ 2 * B * K * kv_len * H * itemsize (K and V once) + the small q/o/partials.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dflash_jax.kernels import dispatch
from dflash_jax.kernels.common import KernelCase, triton_params

# Finite "minus infinity" for masked scores: exp(NEG - NEG) stays 1 instead of NaN, and masked
# probabilities are zeroed explicitly, so fully masked blocks and empty splits add nothing.
_NEG = -1e30


def cache_shapes(batch: int, capacity: int, kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a K and a V cache of ``capacity`` positions: [B, K, S, H] and [B, K, H, S]."""
    return (batch, kv_heads, capacity, head_dim), (batch, kv_heads, head_dim, capacity)


def empty_cache(batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> tuple[jax.Array, jax.Array]:
    """A zero K and V cache (``cache_shapes``)."""
    return tuple(jnp.zeros(shape, dtype) for shape in cache_shapes(batch, capacity, kv_heads, head_dim))


def write_cache(k_cache, v_cache, k, v, start):
    """The caches with k, v [B, T, K, H] written at positions start[b] + t of row b (per-row offsets)."""
    def put(cache, new, s, axis):
        return jax.vmap(lambda c, n, s: lax.dynamic_update_slice_in_dim(c, n, s, axis=axis))(cache, new, s)
    return (put(k_cache, k.transpose(0, 2, 1, 3).astype(k_cache.dtype), start, 1),  # [B, K, T, H] at S
            put(v_cache, v.transpose(0, 2, 3, 1).astype(v_cache.dtype), start, 2))  # [B, K, H, T] at S


def attention_reference(q, k, v, q_start, kv_len, *, causal=True, window=None, scale=None, tree=None):
    """Plain-jnp attention; the oracle for the kernel.

    Args:
      q: [B, T, N, H] queries at positions q_start[b] + t.
      k: [B, K, S, H], v: [B, K, H, S] cache (``cache_shapes``); keys at positions >= kv_len[b] are ignored.
      q_start: [B] int32 position of each row's first query.
      kv_len: [B] int32 number of valid cache positions per row.
      causal: mask keys after each query's position.
      window: if set, also mask keys at positions <= query position - window.
      scale: softmax scale, default H ** -0.5.
      tree: a draft tree's mask [B, T, T] bool in place of the causal one (row t: the new tokens that are
        t's ancestors or t itself, their K/V in rows q_start + j): query t sees the keys before q_start and
        those of its own path. The causal mask is the tree whose rows are the lower triangle.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    scale = H**-0.5 if scale is None else scale
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    kpos = jnp.arange(S)[None, None, :]  # [1, 1, S]
    qpos = (q_start[:, None] + jnp.arange(T)[None, :])[:, :, None]  # [B, T, 1]
    mask = kpos < kv_len[:, None, None]
    if tree is not None:
        if window is not None or not causal:
            raise ValueError("attention: a tree mask replaces the causal mask (causal=True, no window)")
        new = kpos - q_start[:, None, None]  # [B, 1, S]: the new token a key belongs to, if 0 <= new < T
        path = jnp.take_along_axis(tree, jnp.clip(new, 0, T - 1).repeat(T, 1), axis=2)  # [B, T, S]
        mask = mask & ((new < 0) | ((new < T) & path))
    elif causal:
        mask = mask & (kpos <= qpos)
    if window is not None:
        mask = mask & (kpos > qpos - window)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bkhs->btkgh", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N, H).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Block configuration of the kernel (static; hashable so it can be a jit static argument).

    block_k: keys per loop step (power of two >= 16). num_warps / num_stages: Triton launch
    parameters (a gfx950 warp is a 64-lane wave, so num_warps <= 16). k_splits: programs per
    (row, KV head) sharing the key range (split-K / flash-decoding); 1 writes the output directly.
    """

    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 1
    k_splits: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def query_rows(T: int, group: int) -> int:
    """M: the stacked query rows per program, T * group padded to a power of two, at least 16."""
    return max(16, _next_pow2(T * group))


def default_blocks(B: int, T: int, N: int, K: int, H: int, S: int) -> AttentionBlocks:
    """The shipped configuration for a static shape (the compile report checks these at real shapes).

    From the gfx950 compile report (triton 3.8, the Triton jaxlib 0.10.2 bundles): the decode tile
    (M * H <= 16 * 256) runs block_k 32 on 4 warps (~121 VGPRs; block_k 64 spills SGPRs), the drafter
    tile [64, 128] block_k 32 on 8 warps (~138 VGPRs), and the verify tile [128, 256] needs block_k 16
    on 8 warps to keep its f32 accumulator in registers (~206 VGPRs; block_k 32 spills VGPRs, 16
    warps spill too). Split-K fills the GPU (~256 programs for 256 CUs) when B * K is small, but
    keeps >= 8 key blocks per split so the f32 partials stay small next to the K/V bytes.
    """
    tile = query_rows(T, N // K) * H
    block_k = 32 if tile <= 64 * 128 else 16
    want = _next_pow2(max(1, -(-256 // (B * K))))
    k_splits = max(1, min(want, S // (8 * block_k), 32))
    return AttentionBlocks(block_k=block_k, num_warps=4 if tile <= 16 * 256 else 8, num_stages=1,
                           k_splits=k_splits)


def _attention_kernel(q_start_ref, kv_len_ref, q_ref, k_ref, v_ref, *out_refs,
                      T, group, causal, window, scale, block_k, k_splits):
    """One (row b, KV head, split) program.

    q_start_ref, kv_len_ref: [1] int32 of row b. q_ref: [M, H], row r = t * group + g (rows past
    T * group are padding). k_ref [S, H], v_ref [H, S]: the whole cache of this row and KV head; blocks
    are loaded with a key mask, so S need not be a multiple of block_k and nothing past kv_len
    (possibly uninitialised, even NaN) is ever read. out_refs: o [M, H] when k_splits == 1, else
    acc [M, H] f32, m [M] f32, l [M] f32 (unnormalised partials for the combine).
    """
    M, H = q_ref.shape
    q_start = q_start_ref[0]
    kv_len = kv_len_ref[0]
    # Key range any query of this program can see: [lo, hi).
    hi = jnp.minimum(kv_len, q_start + T) if causal else kv_len
    lo = jnp.maximum(q_start - window + 1, 0) if window is not None else jnp.int32(0)
    first_blk = lo // block_k
    num_blks = jnp.maximum((hi + block_k - 1) // block_k - first_blk, 0)
    per_split = (num_blks + k_splits - 1) // k_splits
    start_blk = first_blk + pl.program_id(2) * per_split
    end_blk = jnp.minimum(start_blk + per_split, first_blk + num_blks)

    q = q_ref[...]  # [M, H]
    qpos = q_start + lax.broadcasted_iota(jnp.int32, (M, 1), 0) // group  # [M, 1]
    # f32 inputs: ask for IEEE dots (the Triton default for f32 is TF32).
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(blk, carry):
        m, l, acc = carry  # [M], [M], [M, H] f32
        start = blk * block_k
        kpos = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, bk]
        valid = kpos < kv_len  # [1, bk]
        kb = pltriton.load(k_ref.at[pl.ds(start, block_k), :], other=0,
                           mask=jnp.broadcast_to(valid.reshape(block_k, 1), (block_k, H)))  # [bk, H]
        s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [M, bk]
        mask = valid
        if causal:
            mask = mask & (kpos <= qpos)
        if window is not None:
            mask = mask & (kpos > qpos - window)
        s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        vb = pltriton.load(v_ref.at[:, pl.ds(start, block_k)], mask=jnp.broadcast_to(valid, (H, block_k)),
                           other=0)  # [H, bk]
        pv = lax.dot_general(p.astype(vb.dtype), vb, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)  # [M, H]
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (jnp.full((M,), _NEG, jnp.float32), jnp.zeros((M,), jnp.float32), jnp.zeros((M, H), jnp.float32))
    m, l, acc = lax.fori_loop(start_blk, end_blk, body, init)
    if k_splits == 1:
        (o_ref,) = out_refs
        # l == 0 only for rows that see no key at all (padding rows): write 0, not NaN.
        o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def _check_shapes(q, k, v, q_start, kv_len):
    if q.ndim != 4:
        raise ValueError(f"attention: q must be [B, T, N, H], got shape {q.shape}")
    B, T, N, H = q.shape
    if k.ndim != 4 or k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"attention: k must be [B, K, S, H] = [{B}, K, S, {H}] to match q {q.shape}, "
                         f"got shape {k.shape}")
    K, S = k.shape[1], k.shape[2]
    if v.shape != (B, K, H, S):
        raise ValueError(f"attention: v must be [B, K, H, S] = {[B, K, H, S]} to match k {k.shape}, "
                         f"got shape {v.shape}")
    if N % K:
        raise ValueError(f"attention: q heads N={N} (q {q.shape}) must be a multiple of KV heads K={K} "
                         f"(k {k.shape})")
    for name, x in (("q_start", q_start), ("kv_len", kv_len)):
        if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"attention: {name} must be an integer [B] = [{B}] array, "
                             f"got shape {x.shape} dtype {x.dtype}")
    if H & (H - 1) or H < 16:
        raise ValueError(f"attention: the kernel needs a power-of-two head dim >= 16, "
                         f"got H={H} (q {q.shape})")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_blocks(blocks: AttentionBlocks):
    bk = blocks.block_k
    if bk & (bk - 1) or bk < 16 or blocks.k_splits < 1 or not 1 <= blocks.num_warps <= 16:
        raise ValueError(f"attention: bad blocks {blocks}: block_k must be a power of two >= 16, "
                         "k_splits >= 1, 1 <= num_warps <= 16")


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "blocks", "interpret"))
def attention_pallas(q, k, v, q_start, kv_len, *, causal=True, window=None, scale=None, blocks=None,
                     interpret=False):
    """The Pallas kernel behind ``attention``; same contract. ``blocks=None`` picks ``default_blocks``.

    One difference from the reference, only for degenerate rows: a query that sees no key at all
    (kv_len 0, or a window that ends before the cache) gets 0, where the reference averages all of V.
    """
    _check_shapes(q, k, v, q_start, kv_len)
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    blocks = default_blocks(B, T, N, K, H, S) if blocks is None else blocks
    _check_blocks(blocks)
    G = N // K
    M = query_rows(T, G)
    ks = blocks.k_splits
    scale = H**-0.5 if scale is None else scale
    # [B, T, N, H] -> [B, K, T * G, H] -> pad rows to M: the query rows sharing one KV head, stacked.
    qr = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, M - T * G), (0, 0)))

    kernel = functools.partial(_attention_kernel, T=T, group=G, causal=causal, window=window, scale=scale,
                               block_k=blocks.block_k, k_splits=ks)
    row_spec = pl.BlockSpec((1,), lambda b, h, s: (b,))
    q_spec = pl.BlockSpec((None, None, M, H), lambda b, h, s: (b, h, 0, 0))
    k_spec = pl.BlockSpec((None, None, S, H), lambda b, h, s: (b, h, 0, 0))
    v_spec = pl.BlockSpec((None, None, H, S), lambda b, h, s: (b, h, 0, 0))
    if ks == 1:
        out_shape = jax.ShapeDtypeStruct((B, K, M, H), q.dtype)
        out_specs = q_spec
    else:
        out_shape = (jax.ShapeDtypeStruct((B, K, ks, M, H), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, ks, M), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, ks, M), jnp.float32))
        out_specs = (pl.BlockSpec((None, None, None, M, H), lambda b, h, s: (b, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, M), lambda b, h, s: (b, h, s, 0)),
                     pl.BlockSpec((None, None, None, M), lambda b, h, s: (b, h, s, 0)))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, K, ks),
        in_specs=[row_spec, row_spec, q_spec, k_spec, v_spec],
        out_specs=out_specs,
        compiler_params=triton_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="attention",
    )(q_start.astype(jnp.int32), kv_len.astype(jnp.int32), qr, k, v)
    if ks > 1:
        acc, m, l = out  # [B, K, ks, M, H], [B, K, ks, M] x2
        m_all = jnp.max(m, axis=2, keepdims=True)
        w = jnp.exp(m - m_all)  # empty splits have m = NEG and weigh 0
        l_all = jnp.sum(l * w, axis=2)
        out = jnp.sum(acc * w[..., None], axis=2) / jnp.where(l_all == 0, 1.0, l_all)[..., None]
    # [B, K, M, H] -> [B, T, N, H]
    o = out[:, :, : T * G].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
    return o.astype(q.dtype)


MAX_QUERIES = 16  # queries per row the kernel's tile holds (a verify block); longer inputs are chunked
# Queries per chunk of a long input (prefill) on the XLA path: bounds its f32 scores to [B, N, 256, S]
# (at 8192 prompt tokens a whole-prompt score tensor per attention layer is 4 x 8192 x 8448 x 4 bytes ~ 1 GiB
# on the shipped model, ~6 GiB at 27B) and keeps them in cache; a prefill's chunk c scores only the
# 256 (c + 1) keys it can see (``_reference_chunks``).
REFERENCE_QUERIES = 256
# A short input's keys on the XLA path: the shortest prefix of the cache, in steps of at least PREFIX_KEYS
# rows, at most MAX_PREFIXES branches per call (``key_prefixes``).
PREFIX_KEYS, MAX_PREFIXES = 128, 8


def _by_query_chunks(run, q, k, v, q_start, kv_len, size: int):
    """``run`` on consecutive ``size``-query chunks of q (each sees the keys up to its own positions)."""
    B, T = q.shape[:2]
    if T <= size:
        return run(q, k, v, q_start, kv_len)
    pad = -T % size
    chunks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, -1, size, *q.shape[2:])
    starts = jnp.arange(chunks.shape[1], dtype=jnp.int32) * size
    out = jax.lax.map(lambda c: run(c[0], k, v, q_start + c[1], kv_len), (jnp.moveaxis(chunks, 1, 0), starts))
    return jnp.moveaxis(out, 0, 1).reshape(B, -1, *q.shape[2:])[:, :T]


def prefill_keys_scored(T: int, S: int) -> int:
    """(query, key) scores a causal prefill of T queries from position 0 computes on the XLA path over a
    cache of S rows (``_reference_chunks``): T x S in one pass up to REFERENCE_QUERIES queries, else
    each chunk's queries times the keys up to the chunk's end."""
    if T <= REFERENCE_QUERIES:
        return T * S
    return sum((hi - lo) * keys for lo, hi, keys in _prefill_chunks(T, S))


def _prefill_chunks(T: int, S: int) -> list[tuple[int, int, int]]:
    """(lo, hi, keys) per ``REFERENCE_QUERIES``-query chunk [lo, hi) of a causal prefill from position 0:
    its queries see keys [0, keys) at most, keys = min(hi, S)."""
    size = REFERENCE_QUERIES
    return [(lo, min(lo + size, T), min(lo + size, T, S)) for lo in range(0, T, size)]


def key_prefixes(S: int) -> list[int]:
    """The key counts a short input's XLA attention picks from (``_seen_prefix``): multiples of a step of
    ``PREFIX_KEYS`` or more (at most ``MAX_PREFIXES`` of them), the last S."""
    step = -(-max(PREFIX_KEYS, -(-S // MAX_PREFIXES)) // PREFIX_KEYS) * PREFIX_KEYS
    return [*range(step, S, step), S]


def _seen_prefix(ref, q, k, v, q_start, kv_len, *, causal):
    """``ref`` over the shortest of ``key_prefixes`` that holds every key some query of the batch can see.

    A decode or verify step then costs its rows' lengths rounded up to the prefix step, not the capacity
    (a static cache is sized for the longest prompt bucket plus every new token: the shipped bench's rows
    see ~300 of 656 rows on average). The prefixes are static slices, one ``lax.switch`` branch each; keys
    past the one chosen are masked in every query, so the output equals one pass over all S keys (to
    rounding: softmax and p V reduce over fewer zeros).
    """
    lengths = key_prefixes(k.shape[2])
    if len(lengths) == 1:
        return ref(q, k, v, q_start, kv_len)
    seen = jnp.max(jnp.minimum(kv_len, q_start + q.shape[1]) if causal else kv_len)
    pick = jnp.minimum(jnp.searchsorted(jnp.asarray(lengths), seen), len(lengths) - 1)

    def prefix(n):
        return lambda q, k, v, q_start, kv_len: ref(q, k[:, :, :n], v[..., :n], q_start, kv_len)

    return lax.switch(pick, [prefix(n) for n in lengths], q, k, v, q_start, kv_len)


def _reference_chunks(q, k, v, q_start, kv_len, *, causal, window, scale):
    """The XLA path: ``attention_reference`` over the keys in view, a long input in ``REFERENCE_QUERIES``-query
    chunks.

    An input of up to ``REFERENCE_QUERIES`` queries (decode, verify, a drafter block, a short prompt) scores
    the shortest key prefix that covers it (``_seen_prefix``). A longer causal prefill (every row's queries
    start at position 0, as ``target.prefill``'s do) runs its chunks unrolled, chunk c [c*Q, (c+1)*Q)
    against keys [0, min((c+1)*Q, T, S)) only, the keys it can see: about half the quadratic FLOPs and
    score bytes of scoring the whole capacity. Anything else (queries that start later, or a non-causal
    block that sees every key up to kv_len) scores all S keys per chunk. ``lax.cond`` runs one of the two
    (the prefill's constant start folds it at compile time). A query that sees no key at all (kv_len 0,
    or past a short row's window: padding) averages the V rows it was given, as the reference does.
    """
    ref = functools.partial(attention_reference, causal=causal, window=window, scale=scale)
    size, (T, S) = REFERENCE_QUERIES, (q.shape[1], k.shape[2])
    if T <= size:
        return _seen_prefix(ref, q, k, v, q_start, kv_len, causal=causal)
    every_key = functools.partial(_by_query_chunks, ref, size=size)
    if not causal:
        return every_key(q, k, v, q_start, kv_len)

    def seen_keys(q, k, v, q_start, kv_len):
        # q_start == 0: the queries of [lo, hi) see keys < hi at most (and < kv_len, masked inside)
        outs = [ref(q[:, lo:hi], k[:, :, :keys], v[..., :keys], q_start + lo, kv_len)
                for lo, hi, keys in _prefill_chunks(T, S)]
        return jnp.concatenate(outs, axis=1)  # [B, T, N, H]

    return lax.cond(jnp.all(q_start == 0), seen_keys, every_key, q, k, v, q_start, kv_len)


@functools.cache
def _tree_fallback() -> None:
    """Says once per process why a draft tree's attention leaves the Pallas kernel."""
    logging.getLogger(__name__).warning("attention: the Pallas kernel masks causally; draft trees run the XLA "
                                        "attention with the tree mask instead")


def attention(q, k, v, q_start, kv_len, *, causal=True, window=None, scale=None, impl=None, tree=None):
    """Dispatching entry point; same contract as ``attention_reference``. A ``tree`` mask runs the XLA path in
    every mode (the kernel masks causally; said once in the log), over the keys in view as a verify does."""
    mode = dispatch.resolve(impl)
    if tree is not None:
        if mode != "reference":
            _tree_fallback()
        ref = functools.partial(attention_reference, causal=causal, window=window, scale=scale, tree=tree)
        return _seen_prefix(ref, q, k, v, q_start, kv_len, causal=causal)
    if mode == "reference":
        return _reference_chunks(q, k, v, q_start, kv_len, causal=causal, window=window, scale=scale)
    run = functools.partial(attention_pallas, causal=causal, window=window, scale=scale,
                            interpret=mode == "interpret")

    def pallas(q, k, v, q_start, kv_len):
        # Prefill: the kernel's tile is built for T <= 16 queries, so a prompt runs as 16-query
        # verify-shaped calls.
        return _by_query_chunks(run, q, k, v, q_start, kv_len, MAX_QUERIES)

    return pallas(q, k, v, q_start, kv_len)


# Real Qwen3.5 attention shapes: (N, K, H, causal). The drafter attends non-causally over context + block.
MODELS = {"27b": (24, 4, 256, True), "35b-a3b": (16, 2, 256, True), "drafter": (32, 8, 128, False)}


def report_cases() -> list[KernelCase]:
    """The shipped (default) configs at real shapes: batch 1 and 32, T = 1 (decode) and 16 (verify /
    drafter block), context 4K and 32K, bf16, each row's cache full (kv_len = S, block just written)."""
    cases = []
    for model, (N, K, H, causal) in MODELS.items():
        for B in (1, 32):
            for T in ((16,) if model == "drafter" else (1, 16)):
                for S in (4096, 32768):
                    q_start = jnp.full((B,), S - T, jnp.int32)
                    kv_len = jnp.full((B,), S, jnp.int32)
                    blocks = default_blocks(B, T, N, K, H, S)
                    # integer metadata is closed over so the args are pure data (the bench fills them)
                    fn = functools.partial(_case_fn, attention_pallas, q_start, kv_len, causal, blocks)
                    ref = functools.partial(_case_fn, attention_reference, q_start, kv_len, causal, None)
                    dt = jnp.bfloat16
                    args = (jax.ShapeDtypeStruct((B, T, N, H), dt),
                            *(jax.ShapeDtypeStruct(shape, dt) for shape in cache_shapes(B, S, K, H)))
                    itemsize = jnp.dtype(dt).itemsize
                    # K, V read once; q read, o written
                    bytes_moved = (2 * B * S * K * H + 2 * B * T * N * H) * itemsize
                    name = (f"attention/{model} b{B} t{T} ctx{S // 1024}k "
                            f"bk{blocks.block_k} w{blocks.num_warps} ks{blocks.k_splits}")
                    cases.append(KernelCase(name, fn, ref, args, bytes_moved))
    return cases


def _case_fn(f, q_start, kv_len, causal, blocks, q, k, v):
    kwargs = {} if blocks is None else {"blocks": blocks}
    return f(q, k, v, q_start, kv_len, causal=causal, **kwargs)
