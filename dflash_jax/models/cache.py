"""The target's cache as explicit, immutable pytrees: the layout only.

Sits under ``layers.py`` (the Gated DeltaNet layer fills ``GDNCache`` and its ``GDNPending``) and
``target.py`` (``prefill``/``verify``/``commit``, where the invariant that ties them together is
stated). Full-attention layers keep K/V for every position (``AttentionCache``); Gated DeltaNet
layers keep one recurrent state and a conv window per row (``GDNCache``), plus, between a verify
and its commit, the per-token inputs of the verified tokens (``GDNPending``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.kernels.attention import empty_cache
from dflash_jax.models.rope import table


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    k: jax.Array  # [B, K, S, H]
    v: jax.Array  # [B, K, H, S] (``kernels.cache_shapes``: each as attention's product reads it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNPending:
    """What the commit needs of a verify's tokens: their conv inputs and their delta-rule updates
    (S <- e^g S + k u^T per token, ``kernels.gdn``)."""

    mixed: jax.Array  # [B, T, C] raw conv inputs, C head-grouped (layers.gdn_channel_order)
    k: jax.Array  # [B, T, Hk, Dk] f32, L2-normalised
    u: jax.Array  # [B, T, Hv, Dv] f32 the values each token writes (beta (v - decayed state^T k))
    g: jax.Array  # [B, T, Hv] f32 log-decay
    kernels: str = dataclasses.field(metadata=dict(static=True))  # the verify's kernel mode, for the replay


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNCache:
    conv: jax.Array  # [B, K-1, C] last raw conv inputs, C head-grouped (layers.gdn_channel_order)
    state: jax.Array  # [B, Hv, Dk, Dv] f32
    pending: GDNPending | None = None  # set by verify, consumed by commit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """The token tree a verify runs (``target.tree_of`` builds it from parent indices): T tokens per row,
    token 0 the root, parents before children. The chain is the tree whose parents are i - 1."""

    depths: jax.Array  # [B, T] int32: 0 at the root; a token's RoPE position is the row's length + its depth
    mask: jax.Array  # [B, T, T] bool: row t marks t's ancestors and t itself
    up: jax.Array  # [B, T, A] int32: t's m-th ancestor (m = 0 .. A-1; 0 is t), or -(m - depth) past the
    #   root: the conv window's input that many places before the root
    max_depth: int | None = dataclasses.field(default=None, metadata=dict(static=True))  # no token deeper
    #   (static, e.g. a draft tree's block - 1; None: up to T - 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetCache:
    lengths: jax.Array  # [B] int32 tokens processed (committed) per row
    layers: tuple[AttentionCache | GDNCache, ...]
    rope: jax.Array  # [S, 2, R/2] f32 cos/sin of every position (``rope.table``): a step gathers its rows


def split_pending(cache: TargetCache) -> tuple[TargetCache, tuple]:
    """(``cache`` with nothing pending, each layer's ``GDNPending`` or None): what a commit reuses in place
    apart from what it reads once."""
    pending = tuple(c.pending if isinstance(c, GDNCache) else None for c in cache.layers)
    return with_pending(cache, (None,) * len(pending)), pending


def with_pending(cache: TargetCache, pending: tuple) -> TargetCache:
    """``cache`` with each Gated DeltaNet layer's ``pending`` set from ``pending`` (``split_pending``'s)."""
    return dataclasses.replace(cache, layers=tuple(
        dataclasses.replace(c, pending=q) if isinstance(c, GDNCache) else c
        for c, q in zip(cache.layers, pending, strict=True)))


def init_cache(cfg: TargetConfig, batch: int, capacity: int, dtype) -> TargetCache:
    """An empty cache for ``batch`` rows of up to ``capacity`` tokens."""
    layers = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            layers.append(AttentionCache(*empty_cache(batch, capacity, cfg.num_key_value_heads, cfg.head_dim, dtype)))
        else:
            layers.append(GDNCache(
                conv=jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
                state=jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim), jnp.float32)))
    return TargetCache(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers),
                       rope=position_table(cfg, capacity))


def position_table(cfg: TargetConfig, capacity: int) -> jax.Array:
    """The target's RoPE cos/sin of positions [0, capacity) (``rope.table``), for its cache and its MTP head's."""
    return table(capacity, theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim, scaling=cfg.rope_scaling)
