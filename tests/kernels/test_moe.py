"""Grouped (per-expert) matmul: the Pallas kernel (compiled on a GPU, interpreted on a CPU: ``pallas_mode``)
against the ragged_dot reference, lowering at Qwen3.5-35B-A3B shapes for ROCm and CUDA, and shape errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_mode import INTERPRET, MODE

from dflash_jax.kernels import moe


def _case(group_sizes, trailing, dtype, din=64, dout=32, seed=0):
    rng = np.random.default_rng(seed)
    gs = np.asarray(group_sizes, np.int32)
    M = int(gs.sum()) + trailing
    x = jnp.asarray(rng.standard_normal((M, din)), dtype)
    w = jnp.asarray(rng.standard_normal((len(gs), dout, din)) / np.sqrt(din), dtype)
    return x, w, jnp.asarray(gs)


# E=8: empty groups, groups shorter and longer than the 16-row tile (17 straddles two tiles), a group
# of exactly one tile, and rows past sum(group_sizes) that must come out zero. The f32 case uses small
# blocks so the Din loop takes 4 steps and Dout has 2 column tiles; the last case has M = 9 < one tile.
_GROUPS = [3, 0, 17, 1, 0, 16, 5, 2]


@pytest.mark.parametrize("dtype,group_sizes,trailing,blocks", [
    (jnp.float32, _GROUPS, 7, moe.GroupedBlocks(block_out=16, block_in=16)),
    (jnp.bfloat16, _GROUPS, 7, None),
    (jnp.float32, [0, 2, 0, 0, 3, 0, 0, 0], 4, None),
])
def test_kernel_matches_reference(dtype, group_sizes, trailing, blocks):
    x, w, gs = _case(group_sizes, trailing, dtype)
    if blocks is None:  # through the dispatcher, default blocks
        got = moe.grouped_matmul(x, w, gs, impl=MODE)
    else:
        got = moe.grouped_matmul_pallas(x, w, gs, blocks=blocks, interpret=INTERPRET)
    want = moe.grouped_matmul_reference(x, w, gs)
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[1])
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert not np.any(np.asarray(got[x.shape[0] - trailing:], np.float32))


def test_tile_table_covers_every_row_once():
    gs = jnp.asarray([3, 0, 17, 1, 0, 16, 5, 2], jnp.int32)
    M = int(gs.sum()) + 7
    expert, first, end = np.asarray(jax.jit(moe._tile_table, static_argnums=(1, 2))(gs, M, 16))
    owner = np.full(M, -2)
    for e, f, t in zip(expert, first, end, strict=True):
        assert t - f <= 16 and np.all(owner[f:t] == -2)
        owner[f:t] = e
    assert np.array_equal(owner, np.concatenate([np.repeat(np.arange(8), np.asarray(gs)), np.full(7, -1)]))


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowers_at_35b_a3b_shapes(platform):
    for case in moe.report_cases():
        text = jax.jit(case.fn).trace(*case.args).lower(lowering_platforms=(platform,)).as_text()
        assert "triton" in text, case.name


@pytest.mark.parametrize("x_shape,w_shape,gs_shape,gs_dtype,match", [
    ((16,), (8, 32, 64), (8,), jnp.int32, "x must be"),
    ((16, 64), (8, 32, 48), (8,), jnp.int32, "w must be"),
    ((16, 64), (8, 32, 64), (7,), jnp.int32, "group_sizes must be"),
    ((16, 64), (8, 32, 64), (8,), jnp.float32, "group_sizes must be"),
    ((16, 64), (8, 48, 64), (8,), jnp.int32, "multiples of block_out"),
])
def test_bad_shapes_raise(x_shape, w_shape, gs_shape, gs_dtype, match):
    args = (jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, jnp.float32), jnp.zeros(gs_shape, gs_dtype))
    with pytest.raises(ValueError, match=match):
        moe.grouped_matmul(*args, impl=MODE)
