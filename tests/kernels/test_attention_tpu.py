"""The Pallas TPU (Mosaic) attention kernel: numerics against the jnp oracle in interpret mode (any host), its
HBM traffic from its block specs against the byte floor, and compiled by libtpu for a compile-only TPU chip at
Qwen3.5-27B's verify shapes."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels.attention import attention_reference
from dflash_jax.kernels.attention_tpu import attention_tpu, key_block, steps, traffic


@pytest.mark.parametrize("S,causal,window", [(256, True, None), (256, False, None), (256, True, 24),
                                             (2100, True, None), (2100, True, 700), (2100, False, None)])
def test_matches_the_reference_in_interpret_mode(S, causal, window):
    """Rows at different depths of the cache; S = 2100 walks 5 key blocks of 512 (the last one partly past S) and
    skips the blocks no query sees (a window of 700: 3 steps, row 1's blocks 2..4); the cache past each row's keys
    holds NaN, which must not reach the output."""
    B, T, N, K, H = 2, 16, 8, 2, 128
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, K, S, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, K, H, S), jnp.float32)
    q_start = jnp.array([40, S - 2 * T])
    kv_len = q_start + T
    want = attention_reference(q, k, v, q_start, kv_len, causal=causal, window=window)
    past = jnp.arange(S)[None, None, :] >= kv_len[:, None, None]  # [B, 1, S]
    k = jnp.where(past[..., None], jnp.nan, k)
    v = jnp.where(past[:, :, None, :], jnp.nan, v)
    got = attention_tpu(q, k, v, q_start, kv_len, causal=causal, window=window, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def _random_tree(key, B: int, T: int):
    """[B, T, T] bool: each row's ancestor mask (row t: t and its ancestors) of random trees, parents before
    children."""
    parents = np.asarray(jax.random.randint(key, (B, T), 0, np.arange(T) + 1)) - 1  # parent of t in [-1, t)
    mask = np.zeros((B, T, T), bool)
    for b in range(B):
        for t in range(T):
            mask[b, t, t] = True
            if parents[b, t] >= 0:
                mask[b, t] |= mask[b, parents[b, t]]
    return jnp.asarray(mask)


@pytest.mark.parametrize("S,T,mid", [(256, 9, 100), (1100, 17, 504)])
def test_a_tree_mask_matches_the_reference_in_interpret_mode(S, T, mid):
    """A draft tree's verify: each query sees the prefix and, among the T new keys, its own path (random trees).
    Row 0 has no prefix, row 1's new keys straddle key blocks (S = 1100: blocks of 512, from 504), row 2's last
    new key is past its length (unseen); the cache past each row's keys holds NaN."""
    B, N, K, H = 3, 4, 2, 128
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, K, S, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, K, H, S), jnp.float32)
    tree = _random_tree(ks[3], B, T)
    q_start = jnp.array([0, mid, S - 2 * T])
    kv_len = q_start + T - jnp.array([0, 0, 1])
    want = attention_reference(q, k, v, q_start, kv_len, tree=tree)
    past = jnp.arange(S)[None, None, :] >= kv_len[:, None, None]  # [B, 1, S]
    k = jnp.where(past[..., None], jnp.nan, k)
    v = jnp.where(past[:, :, None, :], jnp.nan, v)
    got = attention_tpu(q, k, v, q_start, kv_len, tree, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # the tree is not the causal mask: the chain kernel gives another answer
    assert not np.allclose(attention_tpu(q, k, v, q_start, kv_len, interpret=True), want, atol=1e-3)


@pytest.mark.parametrize("context", [4096, 32768, 131072])
def test_the_kernel_moves_at_most_1_3x_the_byte_floor_at_long_contexts(context):
    """27B verify (16 tokens, 24 / 4 heads of 256, bf16) at the loop's cache (context + 32 positions): the key
    blocks it fetches over K, V, q and the output once (the floor)."""
    T, N, K, H, S = 16, 24, 4, 256, context + 32
    kv_len = context + T
    floor = K * 2 * kv_len * H * 2 + 2 * T * N * H * 2
    moved = traffic([context], [kv_len], T=T, N=N, K=K, H=H, S=S, itemsize=2)
    assert floor <= moved <= 1.3 * floor
    # a sliding window of 2048 reads about the window, whatever the context
    windowed = traffic([context], [kv_len], T=T, N=N, K=K, H=H, S=S, itemsize=2, window=2048)
    assert windowed <= K * 2 * (2048 + T + 2 * key_block(S)) * H * 2 + 2 * T * N * H * 2


def test_a_causal_window_bounds_the_walk_whatever_the_cache_length():
    """The drafter's sliding layers (window 2048, a 16-token block): the grid's key steps cover at most the window's
    keys plus two blocks at any cache length, and the steps and bytes moved are the same at 32K and 128K (both in
    blocks of 2048 keys); without a window the walk has a step per block."""
    T, N, K, H = 16, 32, 8, 128
    walks = {S: steps(S, T, 2048, True) for S in (4096 + 32, 32768 + 32, 131072 + 32)}
    for S, n in walks.items():
        assert n * key_block(S) <= 2048 + T + 2 * key_block(S)
    assert walks[32768 + 32] == walks[131072 + 32] == 3 and steps(131072 + 32, T, None, True) == 65
    moved = [traffic([S - 32 - T], [S - 32], T=T, N=N, K=K, H=H, S=S, itemsize=2, window=2048)
             for S in (32768 + 32, 131072 + 32)]
    assert moved[0] == moved[1]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (jax[tpu])")
def test_compiles_for_a_tpu_at_27b_verify_shapes():
    from dflash_jax.perf import compile_report

    one = jax.sharding.SingleDeviceSharding(compile_report.tpu_devices("v5e:2x2")[0])
    B, T, N, K, H, S = 1, 16, 24, 4, 256, 4096
    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    compiled = jax.jit(attention_tpu).lower(arg((B, T, N, H)), arg((B, K, S, H)), arg((B, K, H, S)),
                                            arg((B,), jnp.int32), arg((B,), jnp.int32)).compile()
    assert "tpu_custom_call" in compiled.as_text()  # the Mosaic kernel, not an XLA fallback
    # K, V and the scores stay in VMEM: no HBM temporaries of the cache's size
    assert compiled.memory_analysis().temp_size_in_bytes < B * K * S * H * 2
