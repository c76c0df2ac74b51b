"""MXFP4 format and weight-only matmul: quantise/dequantise against a hand-written decode, the OCP
rounding rules, the Pallas kernel in interpret mode against the reference, lowering at Qwen3.5-27B
shapes for ROCm and CUDA, and shape errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.kernels import mxfp4

# e2m1 code -> value, written out from the OCP MX spec (bit 3 sign, bits 2-1 exponent, bit 0 mantissa).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _hand_dequant(w_packed, scales):
    w_packed, scales = np.asarray(w_packed), np.asarray(scales)
    N, half = w_packed.shape
    out = np.empty((N, 2 * half))
    for n in range(N):
        for i in range(half):
            byte, scale = int(w_packed[n, i]), 2.0 ** (int(scales[n, (2 * i) // 32]) - 127)
            out[n, 2 * i] = E2M1[byte & 0xF] * scale
            out[n, 2 * i + 1] = E2M1[byte >> 4] * scale
    return out


def _random_mx(N, K, seed=0):
    """Random packed codes and scales; element 0 of every block is +-6 (code 7 or 15), so the
    block's amax fixes the scale exactly and quantisation must give back the same bytes."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (N, K // 32, 32), dtype=np.uint8)
    codes[:, :, 0] = rng.choice(np.array([7, 15], np.uint8), (N, K // 32))
    codes = codes.reshape(N, K)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = rng.integers(100, 150, (N, K // 32), dtype=np.uint8)
    return jnp.asarray(packed), jnp.asarray(scales)


def test_dequantize_matches_hand_decode():
    packed, scales = _random_mx(8, 96)
    got = mxfp4.dequantize_mxfp4(packed, scales)
    np.testing.assert_array_equal(np.asarray(got), _hand_dequant(packed, scales))


def test_round_trip_exact_on_grid():
    packed, scales = _random_mx(16, 128, seed=1)
    w = mxfp4.dequantize_mxfp4(packed, scales)
    p2, s2 = mxfp4.quantize_mxfp4(w)
    np.testing.assert_array_equal(np.asarray(p2), np.asarray(packed))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(scales))
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize_mxfp4(p2, s2, jnp.bfloat16), np.float32),
                                  np.asarray(w))


def test_quantize_rounding_and_saturation():
    # amax 7: shared exponent floor(log2 7) - 2 = 0 (scale byte 127); 7 saturates to 6, ties go to
    # the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), 1.25 -> 1, 3.5 -> 4.
    block = np.zeros(32, np.float32)
    block[:9] = [7.0, 0.25, 0.75, 2.5, 5.0, -1.25, -3.5, 0.3, -0.0]
    # A second block scaled by 2^-10 and an all-zero third block (scale byte 0).
    w = np.stack([np.concatenate([block, block * 2.0**-10, np.zeros(32, np.float32)])])
    packed, scales = mxfp4.quantize_mxfp4(jnp.asarray(w))
    assert np.asarray(scales).tolist() == [[127, 117, 0]]
    want = np.array([6.0, 0.0, 1.0, 2.0, 4.0, -1.0, -4.0, 0.5, 0.0])
    got = _hand_dequant(packed, scales)[0]
    np.testing.assert_array_equal(got[:9], want)
    np.testing.assert_array_equal(got[32:41], want * 2.0**-10)
    assert not np.any(got[41:64]) and not np.any(got[9:32]) and not np.any(got[64:])


def test_quantization_error_bound():
    """|dequant(quant(w)) - w| <= amax / 4 per block: rounding moves a value by at most half a grid
    step (<= 1 in units of the scale, amax >= 4), saturation by at most 8 - 6 when amax < 8."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)) * 0.02, jnp.float32)
    err = jnp.abs(mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(w)) - w).reshape(64, 8, 32)
    amax = jnp.max(jnp.abs(w).reshape(64, 8, 32), axis=-1, keepdims=True)
    assert float(jnp.max(err / amax)) <= 0.25
    assert float(jnp.mean(err / amax)) < 0.05


# K = 96 is a multiple of 32 but not of the 64-element K block: the last K step is masked.
@pytest.mark.parametrize("M,dtype,blocks", [
    (1, jnp.float32, mxfp4.Mxfp4Blocks(block_k=64)),
    (5, jnp.bfloat16, mxfp4.Mxfp4Blocks(block_k=32, block_n=16, split_k=3)),   # 3 K splits, 4 N tiles
    (16, jnp.float32, None),
])
def test_interpret_matches_reference(M, dtype, blocks):
    packed, scales = _random_mx(64, 96, seed=M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 96)), dtype)
    if blocks is None:  # through the dispatcher, default blocks (block_k 128 > K, one masked step)
        got = mxfp4.mxfp4_matmul(x, packed, scales, impl="interpret")
    else:
        got = mxfp4.mxfp4_matmul_pallas(x, packed, scales, blocks=blocks, interpret=True)
    want = mxfp4.mxfp4_matmul_reference(x, packed, scales)
    assert got.dtype == x.dtype and got.shape == (M, 64)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * float(jnp.max(jnp.abs(want.astype(jnp.float32)))))


@pytest.mark.parametrize("platform", ["rocm", "cuda"])
def test_lowers_at_27b_shapes(platform):
    for case in mxfp4.report_cases():
        text = jax.jit(case.fn).trace(*case.args).lower(lowering_platforms=(platform,)).as_text()
        assert "triton" in text, case.name


def test_default_split_fills_the_device():
    assert mxfp4._resolve_blocks(mxfp4.Mxfp4Blocks(), 1, 5120, 17408).split_k == 2
    assert mxfp4._resolve_blocks(mxfp4.Mxfp4Blocks(), 1, 17408, 5120).split_k == 1


U8 = jnp.uint8


@pytest.mark.parametrize("x_shape,p_shape,p_dtype,s_shape,match", [
    ((1, 64), (32, 32), U8, (32, 3), "scales must be"),
    ((1, 96), (32, 32), U8, (32, 2), "x must be"),
    ((1, 64), (32, 32), jnp.int8, (32, 2), "w_packed must be"),
    ((1, 48), (32, 24), U8, (32, 1), "w_packed must be"),       # K = 48 is not a multiple of 32
    ((1, 64), (48, 32), U8, (48, 2), "multiple of block_n"),
])
def test_bad_shapes_raise(x_shape, p_shape, p_dtype, s_shape, match):
    args = (jnp.zeros(x_shape, jnp.float32), jnp.zeros(p_shape, p_dtype), jnp.zeros(s_shape, U8))
    with pytest.raises(ValueError, match=match):
        mxfp4.mxfp4_matmul(*args, impl="interpret")


def test_split_must_divide_k_steps():
    packed, scales = _random_mx(32, 96)
    with pytest.raises(ValueError, match="split_k=2 must divide the 3 K steps"):
        mxfp4.mxfp4_matmul_pallas(jnp.zeros((1, 96)), packed, scales,
                                  blocks=mxfp4.Mxfp4Blocks(block_k=32, split_k=2))


def test_quantize_bad_shape_raises():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize_mxfp4(jnp.zeros((4, 48)))


# ---------------------------------------------------------------------------------------------
# Grouped (per-expert) MXFP4 matmul and the linear wrapper


def _random_experts(E, Dout, Din, seed):
    packed, scales = _random_mx(E * Dout, Din, seed)
    return packed.reshape(E, Dout, Din // 2), scales.reshape(E, Dout, Din // 32)


@pytest.mark.parametrize("dtype,sizes,M,blocks", [
    (jnp.float32, (3, 0, 5, 1), 9, mxfp4.moe.GroupedBlocks(block_in=32)),    # 2 Din steps, an idle expert
    (jnp.bfloat16, (4, 4, 0, 2), 10, mxfp4.moe.GroupedBlocks()),              # block_in clamped to Din
    (jnp.float32, (2, 1, 1, 0), 6, mxfp4.moe.GroupedBlocks(block_out=16)),    # 2 rows past sum: zeros
])
def test_grouped_interpret_matches_reference(dtype, sizes, M, blocks):
    packed, scales = _random_experts(4, 32, 64, seed=M)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, 64)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    got = mxfp4.mxfp4_grouped_matmul_pallas(x, packed, scales, gs, blocks=blocks, interpret=True)
    want = mxfp4.mxfp4_grouped_matmul_reference(x, packed, scales, gs)
    # The reference is the bf16 grouped matmul on the hand-decoded experts.
    w = np.stack([_hand_dequant(packed[e], scales[e]) for e in range(4)])
    rows = np.repeat(np.arange(4), sizes)
    hand = np.zeros((M, 32))
    hand[:len(rows)] = np.einsum("mk,mnk->mn", np.asarray(x, np.float64)[:len(rows)], w[rows])
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    scale = float(np.abs(hand).max())
    np.testing.assert_allclose(np.asarray(want, np.float32), hand, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
                               atol=tol * scale)
    assert not np.any(np.asarray(got, np.float32)[sum(sizes):])


def test_grouped_bad_shapes_raise():
    packed, scales = _random_experts(4, 32, 64, seed=0)
    with pytest.raises(ValueError, match="x must be"):
        mxfp4.mxfp4_grouped_matmul(jnp.zeros((3, 32)), packed, scales, jnp.zeros(4, jnp.int32), impl="reference")
    with pytest.raises(ValueError, match="scales must be"):
        mxfp4.mxfp4_grouped_matmul(jnp.zeros((3, 64)), packed, scales[:, :, :1], jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must be"):
        mxfp4.mxfp4_grouped_matmul(jnp.zeros((3, 64)), packed, scales, jnp.zeros(3, jnp.int32))


def test_linear_flattens_leading_axes_and_quantizes_inputs():
    packed, scales = _random_mx(32, 64, seed=3)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 64)), jnp.float32)
    got = mxfp4.mxfp4_linear(x, packed, scales)
    assert got.shape == (2, 3, 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ _hand_dequant(packed, scales).T, rtol=1e-5,
                               atol=1e-4)
    # With dynamic activation quantisation the product is exactly that of the two MXFP4 operands.
    got = mxfp4.mxfp4_linear(x, packed, scales, input_scale_mode="even")
    xq = np.asarray(mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(x, "even")))
    np.testing.assert_allclose(np.asarray(got), xq @ _hand_dequant(packed, scales).T, rtol=1e-5, atol=1e-4)
    assert not np.allclose(xq, np.asarray(x))


def test_even_scale_mode_rounds_amax_up_from_1_75():
    """Quark's "even" rule: amax 7 = 1.75 * 4 takes shared exponent 1 (7 / 2 = 3.5 -> 4, i.e. 8) where
    the OCP floor rule keeps 0 and saturates 7 to 6; amax 6.9 (< 1.75 * 4) is the same in both."""
    w = np.zeros((2, 32), np.float32)
    w[0, 0], w[1, 0] = 7.0, 6.9
    p_floor, s_floor = mxfp4.quantize_mxfp4(jnp.asarray(w), "floor")
    p_even, s_even = mxfp4.quantize_mxfp4(jnp.asarray(w), "even")
    assert np.asarray(s_floor).tolist() == [[127], [127]]
    assert np.asarray(s_even).tolist() == [[128], [127]]
    assert _hand_dequant(p_floor, s_floor)[:, 0].tolist() == [6.0, 6.0]
    assert _hand_dequant(p_even, s_even)[:, 0].tolist() == [8.0, 6.0]
    with pytest.raises(ValueError, match="scale_mode"):
        mxfp4.quantize_mxfp4(jnp.asarray(w), "ceil")
