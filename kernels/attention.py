"""Attention of T new queries per row against a KV cache: target verify/decode and drafter blocks.

One contract serves both hot paths. The cache holds K/V for positions ``[0, kv_len)`` per row,
the new queries sit at positions ``q_start + t``. The target's verify is ``causal=True``; the
DFlash drafter's block is ``causal=False`` (its block K/V were written behind the context), with
``window`` for its sliding-attention layers. GQA maps query head n to KV head n // (N // K), so
non-power-of-two groups (6 for Qwen3.5-27B) work. Softmax runs in f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kernels import dispatch


def attention_reference(q, k, v, q_start, kv_len, *, causal=True, window=None, scale=None):
    """Plain-jnp attention; the oracle for the kernel.

    Args:
      q: [B, T, N, H] queries at positions q_start[b] + t.
      k, v: [B, S, K, H] cache; keys at positions >= kv_len[b] are ignored.
      q_start: [B] int32 position of each row's first query.
      kv_len: [B] int32 number of valid cache positions per row.
      causal: mask keys after each query's position.
      window: if set, also mask keys at positions <= query position - window.
      scale: softmax scale, default H ** -0.5.
    Returns:
      [B, T, N, H] in q's dtype.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = H**-0.5 if scale is None else scale
    qg = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    kpos = jnp.arange(S)[None, None, :]  # [1, 1, S]
    qpos = (q_start[:, None] + jnp.arange(T)[None, :])[:, :, None]  # [B, T, 1]
    mask = kpos < kv_len[:, None, None]
    if causal:
        mask = mask & (kpos <= qpos)
    if window is not None:
        mask = mask & (kpos > qpos - window)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N, H).astype(q.dtype)


def attention(q, k, v, q_start, kv_len, *, causal=True, window=None, scale=None, impl=None):
    """Dispatching entry point; same contract as ``attention_reference``."""
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return attention_reference(q, k, v, q_start, kv_len, causal=causal, window=window, scale=scale)
    raise NotImplementedError(f"attention: no Pallas kernel yet (mode {mode!r})")
