"""The Pallas TPU (Mosaic) attention kernel: numerics against the jnp oracle in interpret mode (any host), and
compiled by libtpu for a compile-only TPU chip at Qwen3.5-27B's verify shapes."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels.attention import attention_reference
from dflash_jax.kernels.attention_tpu import attention_tpu


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 24)])
def test_matches_the_reference_in_interpret_mode(causal, window):
    B, T, N, K, H, S = 2, 16, 8, 2, 128, 256
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
    k = jax.random.normal(ks[1], (B, K, S, H), jnp.float32)
    v = jax.random.normal(ks[2], (B, K, H, S), jnp.float32)
    q_start = jnp.array([40, 200])  # rows at different depths of the cache; keys past kv_len are garbage
    kv_len = q_start + T
    want = attention_reference(q, k, v, q_start, kv_len, causal=causal, window=window)
    got = attention_tpu(q, k, v, q_start, kv_len, causal=causal, window=window, interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


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
