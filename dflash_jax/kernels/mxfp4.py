"""MXFP4 (OCP microscaling, e2m1 elements with an e8m0 scale per 32): the format and the weight-only matmuls.

Where it sits: below ``layers.py``. A quantised target (``quant.py`` swaps a ``Linear``'s weight
for packed codes + scales, and the MoE experts' fused weights likewise) calls ``mxfp4_linear`` in
place of ``x @ w.T`` and ``mxfp4_grouped_matmul`` in place of ``moe.grouped_matmul``; at 27B the
dense ones are the MLP (5120 <-> 17408) and attention q_proj (5120 -> 12288).

Storage of a weight w [..., N, K] (N outputs, K inputs; blocks of 32 run along K):
- ``w_packed`` [..., N, K/2] uint8: e2m1 codes (sign, 2 exponent bits, 1 mantissa bit), element 2i
  in the low nibble and 2i+1 in the high nibble of byte i (``pack_e2m1``).
- ``scales`` [..., N, K/32] uint8: e8m0 exponents, block scale 2^(s - 127).
``quantize_mxfp4`` is the OCP rule (``scale_mode="floor"``) or AMD Quark's default (``"even"``);
``qdq_mxfp4`` is dynamic activation quantisation, emulated.

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
HBM traffic ~ N * K * (1/2 + 1/32) bytes + x and out. The grouped kernel tiles like
``moe.grouped_matmul`` (one expert per row tile, only active experts read) with the same decode.

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

from dflash_jax.kernels import dispatch, moe
from dflash_jax.kernels.common import KernelCase, triton_params
from dflash_jax.kernels.moe import GroupedBlocks

BLOCK = 32  # elements per scale (OCP MX block size)
_E2M1_EMAX = 2  # exponent of e2m1's largest normal, 6 = 1.5 * 2^2
_E2M1_MAX = 6.0
_F16_SHIFT = 2.0**14  # the f16 decode yields e2m1 value * 2^-14
_TARGET_PROGRAMS = 256  # gfx950 CUs: split K until every CU has a program


# ---------------------------------------------------------------------------------------------
# Format: pack, quantise, dequantise, reference

SCALE_MODES = ("floor", "even")


def pack_e2m1(codes):
    """codes [..., K] uint8 e2m1 codes (0..15) -> [..., K/2] uint8, element 2i in the low nibble."""
    pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed):
    """[..., K/2] uint8 -> codes [..., K] uint8 (low nibble first): the inverse of ``pack_e2m1``."""
    return jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@functools.partial(jax.jit, static_argnames=("scale_mode",))
def quantize_mxfp4(w, scale_mode: str = "floor"):
    """w [..., K] float (finite; K a multiple of 32) -> (w_packed [..., K/2] uint8, scales [..., K/32] uint8).

    Blocks of 32 run along the last axis. ``scale_mode="floor"`` is the OCP MX rule: the block's
    shared exponent is floor(log2(amax)) - 2 (e2m1's emax), clamped to e8m0's range (an all-zero
    block gets scale byte 0). ``"even"`` is AMD Quark's default: amax is first rounded to 2
    significant bits, so a block whose amax is >= 1.75 * 2^e takes exponent e + 1 - 2 (its amax
    rounds to 4 instead of saturating to 6). Elements are divided by 2^shared, rounded to
    nearest-even on the e2m1 grid and saturated at +-6.
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"quantize_mxfp4: scale_mode={scale_mode!r}; expected one of {SCALE_MODES}")
    _check_weight_dims(w.shape, "quantize_mxfp4")
    K = w.shape[-1]
    blocks = w.astype(jnp.float32).reshape(*w.shape[:-1], K // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)                                       # [..., K/32]
    bits = lax.bitcast_convert_type(amax, jnp.uint32)
    if scale_mode == "even":
        bits = bits + 0x200000  # carries into the exponent iff the significand is >= 1.75
    # Scale byte s = shared + 127 = biased exponent of amax - 2 (zero and subnormal amax clamp to 0).
    scale = jnp.maximum((bits >> 23).astype(jnp.int32) - _E2M1_EMAX, 0)
    # 2^-shared = 2^(127 - s) from its f32 bits: exact and normal for every s (0..253).
    inv = lax.bitcast_convert_type((254 - scale) << 23, jnp.float32)
    q = jnp.clip(blocks * inv[..., None], -_E2M1_MAX, _E2M1_MAX).astype(jnp.float4_e2m1fn)
    codes = lax.bitcast_convert_type(q, jnp.uint4).astype(jnp.uint8).reshape(w.shape)
    return pack_e2m1(codes), scale.astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp4(w_packed, scales, dtype=jnp.float32):
    """(w_packed [..., K/2] uint8, scales [..., K/32] uint8) -> w [..., K] in ``dtype``.

    Scale byte 0 (2^-127, an f32 subnormal) reads as 0 where XLA flushes subnormals (CPU, GPU).
    """
    shape = _check_packed(w_packed, scales, "dequantize_mxfp4", ndim=None)
    codes = unpack_e2m1(w_packed)
    values = lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn).astype(jnp.float32)
    scale = lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu).astype(jnp.float32)
    blocks = values.reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK) * scale[..., None]
    return blocks.reshape(shape).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale_mode",))
def qdq_mxfp4(x, scale_mode: str = "floor"):
    """x [..., K] -> dequant(quant(x)) in x's dtype: dynamic MXFP4 activation quantisation, emulated."""
    return dequantize_mxfp4(*quantize_mxfp4(x, scale_mode), x.dtype)


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
    if len(shape) < 1 or shape[-1] % BLOCK:
        raise ValueError(f"{fn}: w must be [..., K] with K a multiple of {BLOCK}, got shape {shape}")
    return shape


def _check_packed(w_packed, scales, fn, ndim: int | None = 2):
    """Returns the unpacked shape [..., K]; ``ndim`` None accepts any number of leading axes."""
    lead = "N" if ndim == 2 else ("E, N" if ndim == 3 else "...")
    if (w_packed.ndim < 1 or (ndim is not None and w_packed.ndim != ndim) or w_packed.dtype != jnp.uint8
            or w_packed.shape[-1] % (BLOCK // 2)):
        raise ValueError(f"{fn}: w_packed must be uint8 [{lead}, K/2] with K a multiple of {BLOCK}, got "
                         f"{w_packed.dtype} {w_packed.shape}")
    shape = (*w_packed.shape[:-1], 2 * w_packed.shape[-1])
    want = (*shape[:-1], shape[-1] // BLOCK)
    if scales.shape != want or scales.dtype != jnp.uint8:
        raise ValueError(f"{fn}: scales must be uint8 {list(want)} ([{lead}, K/32]) for w_packed "
                         f"{w_packed.shape}, got {scales.dtype} {scales.shape}")
    return shape


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
    ``mxfp4_matmul_reference``. On a device mesh callers pass ``impl="reference"``: XLA's partitioner
    splits the reference like any matmul, while the kernel is a custom call it would gather."""
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return mxfp4_matmul_reference(x, w_packed, scales)
    return mxfp4_matmul_pallas(x, w_packed, scales, interpret=mode == "interpret")


def mxfp4_linear(x, w_packed, scales, *, input_scale_mode: str | None = None, impl=None):
    """``y = x W^T`` for x [..., K] and an MXFP4 weight W [N, K] -> [..., N] in x's dtype.

    ``input_scale_mode`` ("floor"/"even", None = off) first quantises-dequantises x in blocks of 32
    along K: dynamic MXFP4 activations (Quark's ``input_tensors``) emulated, so the product equals
    what an FP4 x FP4 matrix core computes from the same operands.
    """
    if input_scale_mode is not None:
        x = qdq_mxfp4(x, input_scale_mode)
    y = mxfp4_matmul(x.reshape(-1, x.shape[-1]), w_packed, scales, impl=impl)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------------------------------
# Grouped (per-expert) MXFP4 matmul: the MoE experts with packed weights.
# Same tiling as ``moe.grouped_matmul`` (its tile table, one expert per row tile); each program
# decodes its expert's [block_out, block_in] slab from nibbles + scales as ``_decode`` above.

_GROUPED_BLOCKS = GroupedBlocks()  # the MoE kernel's shipped tiles


def _check_grouped(x, w_packed, scales, group_sizes, fn="mxfp4_grouped_matmul"):
    E, Dout, Din = _check_packed(w_packed, scales, fn, ndim=3)
    if x.ndim != 2 or x.shape[1] != Din:
        raise ValueError(f"{fn}: x must be [M, Din={Din}] for w_packed {w_packed.shape}, got shape {x.shape}")
    if group_sizes.shape != (E,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{fn}: group_sizes must be integer [E={E}], got {group_sizes.dtype} {group_sizes.shape}")
    return E, Dout, Din


@jax.jit
def mxfp4_grouped_matmul_reference(x, w_packed, scales, group_sizes):
    """x [M, Din] rows sorted by expert, an MXFP4 expert weight w [E, Dout, Din] (w_packed
    [E, Dout, Din/2], scales [E, Dout, Din/32]), group_sizes [E] -> [M, Dout] in x's dtype; the
    contract of ``moe.grouped_matmul_reference`` on dequant(w)."""
    _check_grouped(x, w_packed, scales, group_sizes)
    return moe.grouped_matmul_reference(x, dequantize_mxfp4(w_packed, scales, x.dtype), group_sizes)


def _expert_tile(p_ref, s_ref, expert, j, k, bo: int, bk: int):
    """``moe.grouped_call``'s weight tile from packed expert weights: p_ref [E, Dout, Din/2] uint8,
    s_ref [E, Dout, Din/32] uint8 -> [bo, bk] f32 weights * 2^-14 (``_decode``)."""
    packed = p_ref[expert, pl.ds(j * bo, bo), pl.ds(k * (bk // 2), bk // 2)]          # [bo, bk/2]
    scales = s_ref[expert, pl.ds(j * bo, bo), pl.ds(k * (bk // BLOCK), bk // BLOCK)]   # [bo, bk/32]
    return _decode(packed, scales, bo, bk)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def mxfp4_grouped_matmul_pallas(x, w_packed, scales, group_sizes, *,
                                blocks: GroupedBlocks = _GROUPED_BLOCKS, interpret=False):
    """The Pallas kernel; same contract as ``mxfp4_grouped_matmul_reference``."""
    _, Dout, Din = _check_grouped(x, w_packed, scales, group_sizes)
    blocks = moe._resolve_blocks(blocks, Dout, Din)
    if blocks.block_in < BLOCK:
        raise ValueError(f"mxfp4_grouped_matmul: block_in={blocks.block_in} must be >= {BLOCK} (Din={Din})")
    return moe.grouped_call(x, (w_packed, scales), group_sizes, blocks=blocks, Dout=Dout,
                            dot_dtype=jnp.promote_types(x.dtype, jnp.bfloat16), interpret=interpret,
                            weight_tile=_expert_tile, out_scale=_F16_SHIFT)


def mxfp4_grouped_matmul(x, w_packed, scales, group_sizes, *, impl=None):
    """The MoE expert matmul on MXFP4 expert weights; the contract of ``mxfp4_grouped_matmul_reference``."""
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return mxfp4_grouped_matmul_reference(x, w_packed, scales, group_sizes)
    return mxfp4_grouped_matmul_pallas(x, w_packed, scales, group_sizes, interpret=mode == "interpret")


# ---------------------------------------------------------------------------------------------
# Shipped configurations, for the compile report and the GPU bench

# Qwen3.5-27B (its config.json): hidden 5120, MLP 17408, q_proj 24 heads x 256 x 2 (gate).
_PROJECTIONS_27B = (("mlp_gate_up", 17408, 5120), ("mlp_down", 5120, 17408), ("q_proj", 12288, 5120))


def report_cases() -> list[KernelCase]:
    """The 27B projections at M = 1 (decode), 16 (one verify block) and 32; the 35B-A3B experts
    (``moe.report_cases`` shapes) for 1 and 16 tokens; bf16 activations."""
    sds, bf16, u8 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.uint8
    cases = []
    for name, N, K in _PROJECTIONS_27B:
        for M in (1, 16, 32):
            nbytes = N * K // 2 + N * K // BLOCK + (M * K + M * N) * 2
            cases.append(KernelCase(
                f"mxfp4_matmul/27b/{name}/m{M}", functools.partial(mxfp4_matmul_pallas, blocks=Mxfp4Blocks()),
                mxfp4_matmul_reference, (sds((M, K), bf16), sds((N, K // 2), u8), sds((N, K // BLOCK), u8)),
                nbytes))
    E = moe._E
    for tokens in (1, 16):
        M = tokens * moe._TOP_K
        active = min(M, E)
        for name, Dout, Din in (("gate_up", 2 * moe._INTER, moe._HIDDEN), ("down", moe._HIDDEN, moe._INTER)):
            nbytes = active * Dout * (Din // 2 + Din // BLOCK) + M * (Din + Dout) * 2 + E * 4
            cases.append(KernelCase(
                f"mxfp4_grouped_matmul/35b_a3b/{name}/t{tokens}",
                functools.partial(mxfp4_grouped_matmul_pallas, blocks=GroupedBlocks()),
                mxfp4_grouped_matmul_reference,
                (sds((M, Din), bf16), sds((E, Dout, Din // 2), u8), sds((E, Dout, Din // BLOCK), u8),
                 sds((E,), jnp.int32)), nbytes))
    return cases
