"""The target's cache as an explicit, immutable pytree, and ``commit``: keep the first n verified tokens.

Sits under ``target.py`` (which fills it in prefill and verify) and above the loop in
``generate.py`` (which commits after each acceptance). Full-attention layers keep K/V for every
position; verify writes rows [len, len + T) and commit only advances ``lengths``, so rejected rows
are masked by length and overwritten later. Gated DeltaNet layers keep one recurrent state and a
conv window per row; verify leaves both untouched and records the per-token inputs (``pending``),
and commit replays the first n of them: the result is bit-for-bit the cache of processing only
those n tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax import kernels
from dflash_jax.config import TargetConfig
from dflash_jax.layers import slide_window


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNPending:
    """Per-token inputs of the delta-rule updates of a verify, kept for ``commit``."""

    mixed: jax.Array  # [B, T, C] raw conv inputs
    k: jax.Array  # [B, T, Hk, Dk] f32, L2-normalised
    v: jax.Array  # [B, T, Hv, Dv]
    g: jax.Array  # [B, T, Hv] f32
    beta: jax.Array  # [B, T, Hv] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNCache:
    conv: jax.Array  # [B, K-1, C] last raw conv inputs
    state: jax.Array  # [B, Hv, Dk, Dv] f32
    pending: GDNPending | None = None  # set by verify, consumed by commit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetCache:
    lengths: jax.Array  # [B] int32 tokens processed (committed) per row
    layers: tuple[AttentionCache | GDNCache, ...]


def init_cache(cfg: TargetConfig, batch: int, capacity: int, dtype) -> TargetCache:
    """An empty cache for ``batch`` rows of up to ``capacity`` tokens."""
    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            shape = (batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
            layers.append(AttentionCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))
        else:
            layers.append(GDNCache(
                conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
                state=jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim), jnp.float32)))
    return TargetCache(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers))


def commit(cache: TargetCache, n: jax.Array) -> TargetCache:
    """Keeps exactly the first n[b] tokens of the last verify in each row.

    Args:
      cache: the cache returned by ``verify`` (GDN layers carry ``pending``).
      n: [B] int32 in 0..T.
    Returns:
      The cache as if only those tokens had been processed, with no pending inputs.
    """
    n = n.astype(jnp.int32)
    layers = []
    for c in cache.layers:
        if isinstance(c, GDNCache):
            if c.pending is None:
                raise ValueError("commit: the cache has no pending verify inputs (call verify first)")
            p = c.pending
            state = kernels.gdn_replay(p.k, p.v, p.g, p.beta, c.state, n)
            c = GDNCache(conv=slide_window(c.conv, p.mixed, n), state=state)
        layers.append(c)
    return TargetCache(lengths=cache.lengths + n, layers=tuple(layers))
