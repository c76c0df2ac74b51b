"""Attention of a decode or verify block over the K/V cache as a Pallas TPU (Mosaic) kernel; its oracle is
``attention.attention_reference`` (same arguments, same cache layout).

Why: on TPU the XLA form of verify's attention (16 tokens x the query heads of each KV head scoring every
cached key) writes its f32 scores to HBM and reads them back in each softmax pass: ~4x the K/V bytes the op
must read (docs/compile.md). Here one program per (row, KV head) holds the row's K [S, H] and V [H, S] and
the [M, S] scores in VMEM (M = T x query heads per KV head, stacked t-major): HBM sees q, K, V once and the
output once. The whole key range sits in VMEM (K, V and f32 scores: ~6 MiB at S = 4128, H = 256, M = 96), so
S is bounded by the chip's scoped VMEM; a key-blocked online softmax would lift that. A query that sees no
key at all returns zeros (the reference averages V then). Not yet dispatched by the models: the compile
report and the tests use it directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG = -1e30  # finite "minus infinity": a fully masked row stays NaN-free


def _kernel(q_start_ref, kv_len_ref, q_ref, k_ref, v_ref, o_ref, *, scale, causal, window, group):
    b = pl.program_id(0)
    q = q_ref[0, 0]  # [M, H], rows t-major: row = t * group + g
    s = jax.lax.dot_general(q, k_ref[0, 0], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale  # [M, S]
    kpos = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    qpos = q_start_ref[b] + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, s.shape, 0), group)  # rows >= 0
    mask = kpos < kv_len_ref[b]
    if causal:
        mask = mask & (kpos <= qpos)
    if window is not None:
        mask = mask & (kpos > qpos - window)
    s = jnp.where(mask, s, _NEG)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=1, keepdims=True)), 0.0)
    denom = jnp.maximum(jnp.sum(p, axis=1, keepdims=True), 1e-30)
    o = jax.lax.dot_general(p.astype(v_ref.dtype), v_ref[0, 0], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [M, H]
    o_ref[0, 0] = (o / denom).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "window", "scale", "interpret"))
def attention_tpu(q, k, v, q_start, kv_len, *, causal=True, window=None, scale=None, interpret=False):
    """q [B, T, N, H], k [B, K, S, H], v [B, K, H, S], q_start [B], kv_len [B] -> [B, T, N, H] (q's dtype).

    ``attention_reference``'s contract, except that a query with no visible key returns zeros."""
    B, T, N, H = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    M = T * G
    scale = H**-0.5 if scale is None else scale
    qk = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, H)  # [B, K, M, H]
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, causal=causal, window=window, group=G),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(B, K),
            in_specs=[pl.BlockSpec((1, 1, M, H), lambda b, h, *_: (b, h, 0, 0)),
                      pl.BlockSpec((1, 1, S, H), lambda b, h, *_: (b, h, 0, 0)),
                      pl.BlockSpec((1, 1, H, S), lambda b, h, *_: (b, h, 0, 0))],
            out_specs=pl.BlockSpec((1, 1, M, H), lambda b, h, *_: (b, h, 0, 0))),
        out_shape=jax.ShapeDtypeStruct((B, K, M, H), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(q_start.astype(jnp.int32), kv_len.astype(jnp.int32), qk, k, v)
    return out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
