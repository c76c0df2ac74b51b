"""MXFP4 (OCP microscaling, e2m1 elements with an e8m0 scale per 32) weight-only matmul.

Where it sits: the quantised dense projections of the Qwen3.5-27B target at decode/verify time (MLP
5120 <-> 17408, attention q_proj 5120 -> 12288) call ``mxfp4_matmul`` in place of ``x @ w.T``; the
checkpoint loader (or ``quantize_mxfp4``) provides the packed weights.

Storage of a weight w [N, K] (N outputs, K inputs; blocks of 32 run along K):
- ``w_packed`` [N, K/2] uint8: e2m1 codes (sign, 2 exponent bits, 1 mantissa bit), element 2i in the
  low nibble and 2i+1 in the high nibble of byte i.
- ``scales`` [N, K/32] uint8: e8m0 exponents, block scale 2^(s - 127).

The Pallas kernel targets decode (M = 1..32 rows): a GEMV bound by reading the weights, whose bytes
MXFP4 cuts 3.8x against bf16. Grid (N / block_n, split_k, M tiles): a program walks its share of K in
``block_k`` steps; each step loads a [block_n, block_k/2] uint8 tile and its [block_n, block_k/32]
scales and decodes them with integer ops, no lookup table: a nibble's 3 magnitude bits shifted into
the exponent/mantissa field of an f16 (sign to the f16 sign bit) give exactly e2m1 x 2^-14, e2m1's
one subnormal code (0.5) landing on an f16 subnormal. The f16 is widened to f32, multiplied by the
block scale 2^(s-127) built from the exponent bits, the two nibble planes are interleaved
(stack + reshape, Triton's join), and one 2-D dot in x's dtype accumulates in f32. The 2^14 is
restored on the accumulator. With split_k > 1 (few N tiles, e.g. the down projection's N = 5120)
the programs write f32 partials that a jnp sum combines.
HBM traffic ~ N * K * (1/2 + 1/32) bytes + x and out.

Range: the kernel's intermediate e2m1 x 2^-14 x 2^(s-127) must stay a normal f32, so blocks with
s < 16 (scale below 2^-111, no real weight) may flush to zero; ``quantize_mxfp4`` never emits the
NaN scale 255.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dflash_jax.kernels import dispatch
from dflash_jax.kernels.common import KernelCase, triton_params

BLOCK = 32  # elements per scale (OCP MX block size)
_E2M1_EMAX = 2  # exponent of e2m1's largest normal, 6 = 1.5 * 2^2
_E2M1_MAX = 6.0
_F16_SHIFT = 2.0**14  # the f16 decode yields e2m1 value * 2^-14
_TARGET_PROGRAMS = 256  # gfx950 CUs: split K until every CU has a program


# ---------------------------------------------------------------------------------------------
# Format: quantise, dequantise, reference


@jax.jit
def quantize_mxfp4(w):
    """w [N, K] float (finite; K a multiple of 32) -> (w_packed [N, K/2] uint8, scales [N, K/32] uint8).

    OCP MX rule: the block's shared exponent is floor(log2(amax)) - 2 (e2m1's emax), clamped to
    e8m0's range; elements are divided by 2^shared, rounded to nearest-even on the e2m1 grid and
    saturated at +-6. An all-zero block gets scale byte 0.
    """
    N, K = _check_weight_dims(w.shape, "quantize_mxfp4")
    blocks = w.astype(jnp.float32).reshape(N, K // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)                                      # [N, K/32]
    _, exp = jnp.frexp(amax)  # amax = m * 2^exp, m in [0.5, 1): floor(log2(amax)) = exp - 1
    shared = jnp.where(amax > 0, exp - 1 - _E2M1_EMAX, -127)
    shared = jnp.clip(shared, -127, 127).astype(jnp.int32)
    # 2^-shared from its f32 bits: exact, and normal for every shared a finite amax gives (-127..125).
    inv = lax.bitcast_convert_type((127 - shared) << 23, jnp.float32)
    q = jnp.clip(blocks * inv[..., None], -_E2M1_MAX, _E2M1_MAX).astype(jnp.float4_e2m1fn)
    codes = lax.bitcast_convert_type(q, jnp.uint4).astype(jnp.uint8).reshape(N, K // 2, 2)
    w_packed = codes[..., 0] | (codes[..., 1] << 4)
    return w_packed, (shared + 127).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp4(w_packed, scales, dtype=jnp.float32):
    """(w_packed [N, K/2] uint8, scales [N, K/32] uint8) -> w [N, K] in ``dtype``."""
    N, K = _check_packed(w_packed, scales, "dequantize_mxfp4")
    codes = jnp.stack([w_packed & 0xF, w_packed >> 4], axis=-1).reshape(N, K)    # element order
    values = lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32)
    scale = lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu).astype(jnp.float32)
    return (values.reshape(N, K // BLOCK, BLOCK) * scale[..., None]).reshape(N, K).astype(dtype)


@jax.jit
def mxfp4_matmul_reference(x, w_packed, scales):
    """x [M, K] @ dequant(w).T -> [M, N] in x's dtype, accumulated in f32."""
    _check_matmul(x, w_packed, scales)
    w = dequantize_mxfp4(w_packed, scales, jnp.float32)
    out = jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Shape checks


def _check_weight_dims(shape, fn):
    if len(shape) != 2 or shape[1] % BLOCK:
        raise ValueError(f"{fn}: w must be [N, K] with K a multiple of {BLOCK}, got shape {shape}")
    return shape


def _check_packed(w_packed, scales, fn):
    if w_packed.ndim != 2 or w_packed.dtype != jnp.uint8 or w_packed.shape[1] % (BLOCK // 2):
        raise ValueError(f"{fn}: w_packed must be uint8 [N, K/2] with K a multiple of {BLOCK}, got "
                         f"{w_packed.dtype} {w_packed.shape}")
    N, K = w_packed.shape[0], 2 * w_packed.shape[1]
    if scales.shape != (N, K // BLOCK) or scales.dtype != jnp.uint8:
        raise ValueError(f"{fn}: scales must be uint8 [N={N}, K/32={K // BLOCK}] for w_packed "
                         f"{w_packed.shape}, got {scales.dtype} {scales.shape}")
    return N, K


def _check_matmul(x, w_packed, scales, fn="mxfp4_matmul"):
    N, K = _check_packed(w_packed, scales, fn)
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"{fn}: x must be [M, K={K}] for w_packed {w_packed.shape}, got shape {x.shape}")
    return x.shape[0], N, K


# ---------------------------------------------------------------------------------------------
# Pallas kernel


@dataclasses.dataclass(frozen=True)
class Mxfp4Blocks:
    """Tile sizes (powers of two). block_m is capped at M rounded up to a power of two >= 16 (the
    smallest MMA height); block_k (elements, >= 32) at K rounded up, a ragged last K step is masked.
    split_k must divide the K steps; None picks the smallest power of two giving >= 256 programs."""

    block_m: int = 32
    block_n: int = 32
    block_k: int = 512
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _resolve_blocks(blocks: Mxfp4Blocks, M: int, N: int, K: int) -> Mxfp4Blocks:
    bm = min(blocks.block_m, max(16, _next_pow2(M)))
    bn = min(blocks.block_n, N)
    bk = min(blocks.block_k, max(BLOCK, _next_pow2(K)))
    for name, v in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if v & (v - 1):
            raise ValueError(f"mxfp4_matmul: {name}={v} must be a power of two (M={M}, N={N}, K={K})")
    if bk < BLOCK:
        raise ValueError(f"mxfp4_matmul: block_k={bk} must be >= {BLOCK}")
    if N % bn:
        raise ValueError(f"mxfp4_matmul: N={N} (w_packed rows) must be a multiple of block_n={bn}")
    chunks = pl.cdiv(K, bk)
    split = blocks.split_k
    if split is None:
        split = 1
        while (N // bn) * split < _TARGET_PROGRAMS and chunks % (2 * split) == 0:
            split *= 2
    if split < 1 or chunks % split:
        raise ValueError(f"mxfp4_matmul: split_k={split} must divide the {chunks} K steps (K={K}, "
                         f"block_k={bk})")
    return dataclasses.replace(blocks, block_m=bm, block_n=bn, block_k=bk, split_k=split)


def _decode(packed, scales, block_n: int, block_k: int):
    """packed [bn, bk/2] uint8, scales [bn, bk/32] uint8 -> [bn, bk] f32 weights * 2^-14."""
    p = packed.astype(jnp.uint16)
    # Magnitude bits (E1 E0 M) to f16 bits 11..9, sign to bit 15: the f16 equals e2m1 * 2^-14.
    lo = ((p & 0x7) << 9) | ((p & 0x8) << 12)
    hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    # 2^(s-127) from its f32 exponent bits (s = 0 gives 0 instead of the subnormal 2^-127).
    scale = lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)   # [bn, bk/32]
    scale = jnp.broadcast_to(scale[:, :, None], (block_n, block_k // BLOCK, BLOCK // 2))
    scale = scale.reshape(block_n, block_k // 2)                                    # per packed byte

    def plane(bits):
        return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32) * scale

    return jnp.stack([plane(lo), plane(hi)], axis=-1).reshape(block_n, block_k)     # interleave


def _mxfp4_kernel(x_ref, p_ref, s_ref, o_ref, *, blocks: Mxfp4Blocks, M: int, K: int, steps: int, dot_dtype,
                  precision):
    # x_ref: [M, K]; p_ref: [N, K/2] uint8; s_ref: [N, K/32] uint8; o_ref: [M, N] or [split, M, N] f32
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    n, split, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, cols = m * bm, n * bn
    ragged = K % bk != 0
    row_limit = M if M % bm else None  # only a partial last row tile needs row masks

    def load(ref, r0, nr, c0, nc, row_limit, col_limit):
        # Masks only where the tile can leave the array: M rows, and K's last step when ragged.
        mask = None
        if row_limit is not None:
            mask = r0 + lax.broadcasted_iota(jnp.int32, (nr, nc), 0) < row_limit
        if ragged:
            in_k = c0 + lax.broadcasted_iota(jnp.int32, (nr, nc), 1) < col_limit
            mask = in_k if mask is None else mask & in_k
        tile = ref.at[pl.ds(r0, nr), pl.ds(c0, nc)]
        return tile[...] if mask is None else pltriton.load(tile, mask=mask, other=0)

    def step(i, acc):
        k0 = (split * steps + i) * bk
        x = load(x_ref, rows, bm, k0, bk, row_limit, K)                                  # [bm, bk]
        packed = load(p_ref, cols, bn, k0 // 2, bk // 2, None, K // 2)                  # [bn, bk/2]
        scales = load(s_ref, cols, bn, k0 // BLOCK, bk // BLOCK, None, K // BLOCK)      # [bn, bk/32]
        w = _decode(packed, scales, bn, bk).astype(dot_dtype)
        return acc + lax.dot_general(x.astype(dot_dtype), w, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    # A static trip count (split_k divides the K steps) keeps the loop an scf.for Triton can pipeline.
    acc = lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
    acc = acc * _F16_SHIFT
    out = o_ref.at[pl.ds(rows, bm), pl.ds(cols, bn)] if o_ref.ndim == 2 else \
        o_ref.at[split, pl.ds(rows, bm), pl.ds(cols, bn)]
    mask = None if row_limit is None else rows + lax.broadcasted_iota(jnp.int32, (bm, bn), 0) < M
    pltriton.store(out, acc.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def mxfp4_matmul_pallas(x, w_packed, scales, *, blocks: Mxfp4Blocks = Mxfp4Blocks(), interpret=False):
    """The Pallas kernel; same contract as ``mxfp4_matmul_reference``."""
    M, N, K = _check_matmul(x, w_packed, scales)
    blocks = _resolve_blocks(blocks, M, N, K)
    steps = pl.cdiv(K, blocks.block_k) // blocks.split_k
    dot_dtype = jnp.promote_types(x.dtype, jnp.bfloat16)
    # The Triton default for f32 dots is TF32; the reference is exact f32.
    precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    kernel = functools.partial(_mxfp4_kernel, blocks=blocks, M=M, K=K, steps=steps, dot_dtype=dot_dtype,
                               precision=precision)
    split = blocks.split_k
    out_shape = (M, N) if split == 1 else (split, M, N)
    out = pl.pallas_call(
        kernel,
        grid=(N // blocks.block_n, split, pl.cdiv(M, blocks.block_m)),
        out_shape=jax.ShapeDtypeStruct(out_shape, x.dtype if split == 1 else jnp.float32),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
    )(x, w_packed, scales)
    return out if split == 1 else out.sum(axis=0).astype(x.dtype)


def mxfp4_matmul(x, w_packed, scales, *, impl=None):
    """x [M, K] (bf16/f32) times an MXFP4 weight [N, K] -> [M, N] in x's dtype; the contract of
    ``mxfp4_matmul_reference``."""
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return mxfp4_matmul_reference(x, w_packed, scales)
    return mxfp4_matmul_pallas(x, w_packed, scales, interpret=mode == "interpret")


# ---------------------------------------------------------------------------------------------
# Shipped configurations, for the compile report and the GPU bench

# Qwen3.5-27B (reference/jax_anchors.md §2): hidden 5120, MLP 17408, q_proj 24 heads x 256 x 2 (gate).
_PROJECTIONS_27B = (("mlp_gate_up", 17408, 5120), ("mlp_down", 5120, 17408), ("q_proj", 12288, 5120))


def report_cases() -> list[KernelCase]:
    """The 27B projections at M = 1 (decode), 16 (one verify block) and 32; bf16 activations."""
    sds, bf16, u8 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.uint8
    cases = []
    for name, N, K in _PROJECTIONS_27B:
        for M in (1, 16, 32):
            nbytes = N * K // 2 + N * K // BLOCK + (M * K + M * N) * 2
            cases.append(KernelCase(
                f"mxfp4_matmul/27b/{name}/m{M}", functools.partial(mxfp4_matmul_pallas, blocks=Mxfp4Blocks()),
                mxfp4_matmul_reference, (sds((M, K), bf16), sds((N, K // 2), u8), sds((N, K // BLOCK), u8)),
                nbytes))
    return cases
