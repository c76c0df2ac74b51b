"""The attention Pallas kernel: numerics against the jnp reference (compiled on a GPU, interpreted on a
CPU: ``pallas_mode``), ROCm/CUDA lowering at real Qwen3.5 shapes (no GPU needed), and shape errors."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_mode import INTERPRET, MODE

from dflash_jax.kernels.attention import (
    AttentionBlocks,
    attention,
    attention_pallas,
    attention_reference,
    cache_shapes,
    key_prefixes,
    report_cases,
    write_cache,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _inputs(B, T, N, K, H, S, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((B, T, N, H), *cache_shapes(B, S, K, H)))
    return q, k, v


# Ragged rows (B = 3): a full cache whose length is not a multiple of block_k, a short row, and a
# mid-length row; q_start covers verify (block just written: q_start = kv_len - T), decode past the
# cache end (q_start = kv_len) and a drafter-like block well behind kv_len. Every query sees >= 1 key.
def _rows(S, T):
    kv_len = np.array([S, 37, 150])
    q_start = np.array([S - T, 37, 150 - T - 20])
    return jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)


# (T, N, K, H, causal, window, dtype, blocks): a covering subset of T {1, 5, 16} x causal x window x
# group {1, 6, 8} x H {256, 128} x dtype x split-K (1, 2, 3), few enough to keep interpret mode fast
# (each case is a ~3 s XLA compile).
CASES = [
    (1, 12, 2, 256, True, None, jnp.bfloat16, AttentionBlocks(block_k=64)),
    (16, 12, 2, 256, True, None, jnp.float32, None),  # the shipped verify config: block_k 32, 8 warps
    (5, 16, 2, 128, True, 48, jnp.float32, AttentionBlocks(block_k=32, k_splits=2)),
    (16, 16, 2, 128, False, None, jnp.bfloat16, AttentionBlocks(block_k=64, k_splits=3)),
    (16, 4, 4, 128, False, 64, jnp.float32, AttentionBlocks(block_k=16)),
    (1, 8, 1, 256, False, 32, jnp.float32, AttentionBlocks(block_k=64, k_splits=2)),
    (16, 4, 4, 256, True, 40, jnp.bfloat16, AttentionBlocks(block_k=64)),
]


@pytest.mark.parametrize("T,N,K,H,causal,window,dtype,blocks", CASES)
def test_kernel_matches_reference(T, N, K, H, causal, window, dtype, blocks):
    S = 200
    q, k, v = _inputs(3, T, N, K, H, S, dtype)
    q_start, kv_len = _rows(S, T)
    if blocks is None:  # the shipped config, reached through dispatch as the model calls it
        out = attention(q, k, v, q_start, kv_len, causal=causal, window=window, impl=MODE)
    else:
        out = attention_pallas(q, k, v, q_start, kv_len, causal=causal, window=window, blocks=blocks,
                               interpret=INTERPRET)
    ref = attention_reference(q, k, v, q_start, kv_len, causal=causal, window=window)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_dispatch_reference_mode():
    q, k, v = _inputs(1, 4, 4, 2, 128, 64, jnp.float32, seed=1)
    q_start, kv_len = jnp.array([40], jnp.int32), jnp.array([44], jnp.int32)
    np.testing.assert_array_equal(attention(q, k, v, q_start, kv_len, impl="reference"),
                                  attention_reference(q, k, v, q_start, kv_len))


# name: (B, T, N, K, H, S, causal): 27B verify, 35B-A3B decode at batch 32, drafter block (K = 8).
REAL = {
    "27b-verify": (1, 16, 24, 4, 256, 4096, True),
    "35b-decode": (32, 1, 16, 2, 256, 4096, True),
    "35b-verify": (1, 16, 16, 2, 256, 4096, True),
    "drafter": (1, 16, 32, 8, 128, 4096, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(REAL))
def test_compiled_kernel_at_real_shapes_matches_reference(name):
    """Too large for the interpreter: the compiled kernel only, each row's cache full (block just written)."""
    B, T, N, K, H, S, causal = REAL[name]
    q, k, v = _inputs(B, T, N, K, H, S, jnp.bfloat16)
    kv_len = jnp.full((B,), S, jnp.int32)
    args = (q, k, v, kv_len - T, kv_len)
    out = jax.jit(functools.partial(attention, causal=causal, impl="pallas"))(*args)
    ref = jax.jit(functools.partial(attention_reference, causal=causal))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
@pytest.mark.parametrize("name", list(REAL))
def test_lowers_at_real_shapes(name, platform):
    B, T, N, K, H, S, causal = REAL[name]
    sd = jax.ShapeDtypeStruct
    args = (sd((B, T, N, H), jnp.bfloat16), *(sd(shape, jnp.bfloat16) for shape in cache_shapes(B, S, K, H)),
            sd((B,), jnp.int32), sd((B,), jnp.int32))
    f = functools.partial(attention_pallas, causal=causal)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_report_cases_are_real_shapes():
    cases = report_cases()
    assert len({c.name for c in cases}) == len(cases)
    for c in cases:
        q, k = c.args[0], c.args[1]
        assert q.shape[3] in (128, 256) and k.shape[2] in (4096, 32768) and c.bytes_moved > 0


@pytest.mark.parametrize("change,match", [
    (dict(q=(2, 4, 8, 64, 1)), "q must be"),
    (dict(k=(2, 2, 48, 128)), "k must be"),
    (dict(v=(2, 2, 48, 64)), r"v must be \[B, K, H, S\]"),  # V stored like K (the old layout): refused
    (dict(k=(2, 3, 48, 64), v=(2, 3, 64, 48)), "multiple of KV heads"),
    (dict(kv_len=(3,)), "kv_len must be"),
    (dict(q=(2, 4, 8, 96), k=(2, 2, 48, 96), v=(2, 2, 96, 48)), "power-of-two head dim"),
])
def test_bad_shapes_raise(change, match):
    shapes = dict(q=(2, 4, 8, 64), k=(2, 2, 48, 64), v=(2, 2, 64, 48), q_start=(2,), kv_len=(2,))
    shapes.update(change)
    args = [jnp.zeros(shapes[n], jnp.int32 if n in ("q_start", "kv_len") else jnp.float32)
            for n in ("q", "k", "v", "q_start", "kv_len")]
    with pytest.raises(ValueError, match=match):
        attention_pallas(*args, interpret=INTERPRET)


def test_bad_blocks_raise():
    q, k, v = _inputs(1, 1, 2, 2, 64, 64, jnp.float32)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        attention_pallas(q, k, v, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                         blocks=AttentionBlocks(block_k=48), interpret=INTERPRET)


@pytest.mark.parametrize("causal,window", [(True, None), (True, 24), (False, None)])
@pytest.mark.parametrize("q_start,kv_len", [((0, 0), (40, 30)), ((0, 10), (40, 50))])
def test_reference_prefill_in_query_chunks_equals_one_pass(monkeypatch, causal, window, q_start, kv_len):
    """The XLA path runs a long input in REFERENCE_QUERIES-query chunks (bounded score tensor): a 40-query
    input at chunk 16 (two full chunks and a short one) equals the whole-input reference, rows of
    different lengths. Queries from position 0, causal: chunk c scores only keys [0, 16 (c + 1)); the
    non-causal case, whose queries see keys past their own chunk (kv_len 30 > 16), must not be cut."""
    monkeypatch.setattr(importlib.import_module("dflash_jax.kernels.attention"), "REFERENCE_QUERIES", 16)
    T, S = 40, 64
    q, k, v = _inputs(2, T, 4, 2, 32, S, jnp.float32)
    q_start, kv_len = jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    ref = attention_reference(q, k, v, q_start, kv_len, causal=causal, window=window)
    run = functools.partial(attention, causal=causal, window=window, impl="reference")
    np.testing.assert_allclose(np.asarray(run(q, k, v, q_start, kv_len)), np.asarray(ref), rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(run)(q, k, v, q_start, kv_len))
    assert "scan" in jaxpr  # the chunks, not one pass
    assert ("f32[2,2,16,32]" in jaxpr) == causal  # the first chunk's 16 keys of the 64 (only when causal)


def test_write_cache_writes_each_row_at_its_own_start():
    rng = np.random.default_rng(0)
    B, T, K, H, S = 3, 4, 2, 8, 10
    k_cache, v_cache = (rng.normal(size=shape).astype(np.float32) for shape in cache_shapes(B, S, K, H))
    k, v = (rng.normal(size=(B, T, K, H)).astype(np.float32) for _ in range(2))
    start = np.array([0, 3, 6])
    want_k, want_v = k_cache.copy(), v_cache.copy()
    for b, s in enumerate(start):
        want_k[b, :, s:s + T] = k[b].transpose(1, 0, 2)  # [K, T, H]
        want_v[b, :, :, s:s + T] = v[b].transpose(1, 2, 0)  # [K, H, T]
    got_k, got_v = write_cache(*map(jnp.asarray, (k_cache, v_cache, k, v, start)))
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)


def test_key_prefixes_cover_the_cache_in_at_most_eight_steps():
    assert key_prefixes(100) == [100]
    assert key_prefixes(656) == [128, 256, 384, 512, 640, 656]
    for S in (200, 4096, 4100, 32768):
        p = key_prefixes(S)
        assert p[-1] == S and len(p) <= 8 and p == sorted(p) and all(n % 128 == 0 for n in p[:-1])


# (T, causal, window, q_start, kv_len) over a cache of 300 rows (prefixes 128, 256, 300): the batch's furthest
# visible key picks the prefix, the shortest row must not pick it; boundaries 128 / 129 and the whole cache.
PREFIX_CASES = [
    (16, True, None, (112, 4), (128, 20)),  # verify, everything inside the first 128 keys
    (16, True, None, (113, 4), (129, 20)),  # one key past it: 256
    (1, True, None, (199, 10), (200, 11)),  # decode
    (16, False, None, (280, 0), (296, 16)),  # a drafter block at the end: all 300
    (16, False, 32, (100, 40), (116, 56)),  # sliding window
    (5, True, None, (0, 0), (5, 3)),  # a short prompt from position 0
]


@pytest.mark.parametrize("T,causal,window,q_start,kv_len", PREFIX_CASES)
def test_reference_scores_the_shortest_key_prefix_in_view(T, causal, window, q_start, kv_len):
    """A short input on the XLA path scores only the cache prefix its rows can see: the same output as
    one pass over all S keys, and a switch over the static prefixes (not one pass over the capacity)."""
    q, k, v = _inputs(2, T, 4, 2, 32, 300, jnp.float32, seed=3)
    q_start, kv_len = jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    run = functools.partial(attention, causal=causal, window=window, impl="reference")
    ref = attention_reference(q, k, v, q_start, kv_len, causal=causal, window=window)
    np.testing.assert_allclose(np.asarray(run(q, k, v, q_start, kv_len)), np.asarray(ref), rtol=1e-6, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(run)(q, k, v, q_start, kv_len))
    assert "cond[" in jaxpr and "f32[2,2,128,32]" in jaxpr and "f32[2,2,32,256]" in jaxpr
