"""Grouped (per-expert) matmul for the MoE layers: token rows sorted by expert times expert weights.

Where it sits: the Qwen3.5-35B-A3B sparse MoE block (transformers' Qwen3_5MoeSparseMoeBlock) sorts its M = tokens x 8
routed rows by expert and calls ``grouped_matmul`` twice per layer, gate_up ([E, 2I, H] =
[256, 1024, 2048]) then down ([E, H, I] = [256, 2048, 512]). Expert weights keep the checkpoint's
[E, out, in] layout (no transpose at load time).

The Pallas kernel targets decode and verify (M = 8..4096 rows over 256 experts, most of them idle),
where the op is bound by reading expert weights, so only the active experts' weights are read.
- A jnp prologue cuts the sorted rows into row tiles of ``block_rows`` that never straddle two
  experts (each group padded to the tile), plus tiles for the rows past sum(group_sizes), which the
  kernel zeroes. It emits a [3, T] int32 table (expert or -1, first row, end row per tile); the
  kernel reads it as an ordinary input (the Triton backend has no scalar prefetch). T is a static
  bound on the tile count; the surplus tiles are empty and exit at once.
- Grid (T, Dout / block_out). A program loads its tile's rows of x straight from the unpadded
  x (masked rows, no gathered copy), loops over Din in ``block_in`` steps loading the expert's
  [block_out, block_in] weight slab, and accumulates a [block_rows, block_out] f32 2-D dot. It then
  stores only its own rows, so every output row is written by exactly one program.
HBM traffic ~ active experts x Dout x Din x itemsize (each weight slab is read once per row tile of
its expert; an expert with more than ``block_rows`` rows re-reads it, mostly from L2) + x and out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from dflash_jax.kernels import dispatch
from dflash_jax.kernels.common import KernelCase, triton_params

_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_matmul_reference(x, w, group_sizes):
    """Rows of x grouped by expert, each group times its expert's weight.

    Args:
      x: [M, Din], rows sorted by expert; group_sizes: [E] int32 rows per expert (sum <= M; rows
        past the sum give zeros).
      w: [E, Dout, Din].
    Returns:
      [M, Dout] in x's dtype, accumulated in f32.
    """
    out = jax.lax.ragged_dot_general(x, w, group_sizes, _DIMS, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class GroupedBlocks:
    """Tile sizes (powers of two; each clamped to its dimension). 16 rows is the smallest MMA
    height; 32 output columns give 8 active experts x 32 = 256 programs for a 1-token decode."""

    block_rows: int = 16
    block_out: int = 32
    block_in: int = 256
    num_warps: int = 4
    num_stages: int = 1


def _max_tiles(M: int, E: int, block_rows: int) -> int:
    """Static bound on the row tiles: the E groups plus the tail make at most min(E + 1, M)
    non-empty segments of M rows in all, each wasting at most block_rows - 1 padding rows."""
    return max(1, (M + min(E + 1, M) * (block_rows - 1)) // block_rows)


def _tile_table(group_sizes, M: int, block_rows: int):
    """[3, T] int32: per row tile its expert (-1: rows past the groups, zeroed), first row, end row.

    Surplus tiles get first = end = 0 (no rows). Group ends are clipped to M, so a bad sum cannot
    address rows outside x.
    """
    E = group_sizes.shape[0]
    T = _max_tiles(M, E, block_rows)
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), M)              # [E]
    # Segment E + 1 is the tail [sum, M): its rows must come out zero.
    seg_end = jnp.concatenate([ends, jnp.full((1,), M, jnp.int32)])               # [E+1]
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_end[:-1]])       # [E+1]
    seg_expert = jnp.concatenate([jnp.arange(E, dtype=jnp.int32), jnp.full((1,), -1, jnp.int32)])
    seg_tiles = (seg_end - seg_start + block_rows - 1) // block_rows              # [E+1]
    tiles_end = jnp.cumsum(seg_tiles)                                             # [E+1]
    t = jnp.arange(T, dtype=jnp.int32)
    seg = jnp.sum(tiles_end[None, :] <= t[:, None], axis=1)                       # [T] in [0, E+1]
    used = seg <= E
    seg = jnp.minimum(seg, E)
    first = seg_start[seg] + (t - (tiles_end[seg] - seg_tiles[seg])) * block_rows
    end = jnp.minimum(first + block_rows, seg_end[seg])
    zero = jnp.zeros_like(t)
    return jnp.stack([jnp.where(used, seg_expert[seg], -1), jnp.where(used, first, zero),
                      jnp.where(used, end, zero)])


def _weight_tile(w_ref, expert, j, k, bo: int, bk: int):
    """The [bo, bk] tile of a dense expert weight [E, Dout, Din]: outputs j*bo.., inputs k*bk.."""
    return w_ref[expert, pl.ds(j * bo, bo), pl.ds(k * bk, bk)]


def _grouped_kernel(table_ref, x_ref, *refs, blocks: GroupedBlocks, num_k: int, dot_dtype, precision,
                    weight_tile, out_scale: float):
    # table_ref: [3, T] int32; x_ref: [M, Din]; refs: the weight operands (``weight_tile`` reads one
    # [block_out, block_in] tile from them), then o_ref: [M, Dout]
    *w_refs, o_ref = refs
    tm, bo, bk = blocks.block_rows, blocks.block_out, blocks.block_in
    t, j = pl.program_id(0), pl.program_id(1)
    expert, first, end = table_ref[0, t], table_ref[1, t], table_ref[2, t]

    def rows_mask(width):
        return first + lax.broadcasted_iota(jnp.int32, (tm, width), 0) < end

    def step(k, acc):
        # Rows of the next expert (or past M) are masked to zero; their results are never stored.
        xk = pltriton.load(x_ref.at[pl.ds(first, tm), pl.ds(k * bk, bk)], mask=rows_mask(bk), other=0)
        wk = weight_tile(*w_refs, expert, j, k, bo, bk)                             # [bo, bk]
        return acc + lax.dot_general(xk.astype(dot_dtype), wk.astype(dot_dtype), (((1,), (1,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)

    # Tail tiles (expert -1) store zeros; empty tiles have no rows to store. The cond keeps the Din
    # loop a static-trip scf.for, which Triton can software-pipeline (num_stages > 1).
    zeros = jnp.zeros((tm, bo), jnp.float32)
    acc = lax.cond(expert >= 0, lambda: lax.fori_loop(0, num_k, step, zeros), lambda: zeros)
    if out_scale != 1.0:
        acc = acc * out_scale
    pltriton.store(o_ref.at[pl.ds(first, tm), pl.ds(j * bo, bo)], acc.astype(o_ref.dtype), mask=rows_mask(bo))


def grouped_call(x, weights: tuple, group_sizes, *, blocks: GroupedBlocks, Dout: int, dot_dtype, interpret: bool,
                 weight_tile=_weight_tile, out_scale: float = 1.0):
    """The grouped matmul's pallas_call over x [M, Din] with ``blocks`` already resolved: one program per
    (row tile, block_out columns), each reading its expert's weight tiles through ``weight_tile``
    (dense here; ``mxfp4.py`` decodes packed ones) and scaling the f32 accumulator by ``out_scale``."""
    M, Din = x.shape
    table = _tile_table(group_sizes, M, blocks.block_rows)                        # [3, T]
    # The Triton default for f32 dots is TF32; the reference is exact f32.
    precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
    kernel = functools.partial(_grouped_kernel, blocks=blocks, num_k=Din // blocks.block_in, dot_dtype=dot_dtype,
                               precision=precision, weight_tile=weight_tile, out_scale=out_scale)
    return pl.pallas_call(
        kernel,
        grid=(table.shape[1], Dout // blocks.block_out),
        out_shape=jax.ShapeDtypeStruct((M, Dout), x.dtype),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
    )(table, x, *weights)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _resolve_blocks(blocks: GroupedBlocks, Dout: int, Din: int) -> GroupedBlocks:
    blocks = dataclasses.replace(blocks, block_out=min(blocks.block_out, Dout),
                                 block_in=min(blocks.block_in, Din))
    for name in ("block_rows", "block_out", "block_in"):
        if not _pow2(getattr(blocks, name)):
            raise ValueError(f"grouped_matmul: {name}={getattr(blocks, name)} must be a power of two "
                             f"(Dout={Dout}, Din={Din})")
    if Dout % blocks.block_out or Din % blocks.block_in:
        raise ValueError(f"grouped_matmul: w dims (Dout={Dout}, Din={Din}) must be multiples of "
                         f"block_out={blocks.block_out} and block_in={blocks.block_in}")
    return blocks


def _check_shapes(x, w, group_sizes):
    if x.ndim != 2:
        raise ValueError(f"grouped_matmul: x must be [M, Din], got shape {x.shape}")
    if w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"grouped_matmul: w must be [E, Dout, Din={x.shape[1]}], got shape {w.shape}")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul: group_sizes must be integer [E={w.shape[0]}], got "
                         f"{group_sizes.dtype} {group_sizes.shape}")


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def grouped_matmul_pallas(x, w, group_sizes, *, blocks: GroupedBlocks = GroupedBlocks(), interpret=False):
    """The Pallas kernel; same contract as ``grouped_matmul_reference``."""
    _check_shapes(x, w, group_sizes)
    _, Dout, Din = w.shape
    return grouped_call(x, (w,), group_sizes, blocks=_resolve_blocks(blocks, Dout, Din), Dout=Dout,
                        dot_dtype=jnp.promote_types(x.dtype, w.dtype), interpret=interpret)


def grouped_matmul(x, w, group_sizes, *, impl=None):
    """x [M, Din] rows sorted by expert, w [E, Dout, Din], group_sizes [E] int32 -> [M, Dout] in x's
    dtype; the contract of ``grouped_matmul_reference``."""
    mode = dispatch.resolve(impl)
    if mode == "reference":
        _check_shapes(x, w, group_sizes)
        return grouped_matmul_reference(x, w, group_sizes)
    return grouped_matmul_pallas(x, w, group_sizes, interpret=mode == "interpret")


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic): the same contract, reading only the experts that have rows

def _tpu_rows(dtype) -> int:
    """Rows per tile: a bf16 vreg tile holds 16 rows, an f32 one 8."""
    return 16 if jnp.dtype(dtype).itemsize == 2 else 8


def _tpu_block_out(Dout: int, Din: int, itemsize: int, budget: int = 4 * 2**20) -> int:
    """Output columns per weight block: the widest power-of-two divisor of Dout (>= 128 where Dout allows)
    whose [block, Din] slab fits ``budget`` bytes (double-buffered by the pipeline: 2 x budget of VMEM)."""
    bo = Dout
    while bo > 128 and bo % 2 == 0 and bo * Din * itemsize > budget:
        bo //= 2
    return bo


def tpu_visits(group_sizes, M: int, tm: int):
    """The TPU kernel's schedule: [4, V] int32, per visit the expert, its row tile, and the expert's rows
    [start, end). A visit is one (row tile, non-empty expert) pair that meet: experts in order, each over the
    tiles its rows touch, so tiles come in non-decreasing order (an output tile is revisited only by
    consecutive visits) and an expert whose rows straddle tiles is visited by consecutive visits too. V, a
    static bound, is tiles + min(M, E) - 1; the surplus visits repeat the last real one with no rows, so the
    pipeline finds its blocks already in VMEM and fetches nothing. Experts without rows get no visit."""
    E = group_sizes.shape[0]
    tiles = -(-M // tm)
    V = tiles + min(M, E) - 1
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes), M)                                        # [E]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])               # [E]
    count = jnp.where(ends > starts, (jnp.maximum(ends, 1) - 1) // tm - starts // tm + 1, 0)  # tiles per expert
    last = jnp.cumsum(count)                                                        # [E]
    v = jnp.arange(V, dtype=jnp.int32)
    real = v < last[-1]
    v = jnp.minimum(v, jnp.maximum(last[-1] - 1, 0))                                # surplus: the last real visit
    g = jnp.searchsorted(last, v, side="right").astype(jnp.int32)                  # [V] expert of each visit
    g = jnp.minimum(g, E - 1)
    tile = starts[g] // tm + v - (last[g] - count[g])
    start, end = starts[g], jnp.where(real, ends[g], starts[g])                      # surplus visits: no rows
    return jnp.stack([g, tile, start, end])


def _tpu_kernel(visits_ref, x_ref, w_ref, o_ref, *, tm: int):
    # visits_ref [4, V] (SMEM); x_ref [tm, Din] the visit's row tile; w_ref [bo, Din] its expert's columns;
    # o_ref [tm, bo] f32, resident over the tile's consecutive visits.
    v = pl.program_id(1)
    tile, start, end = visits_ref[1, v], visits_ref[2, v], visits_ref[3, v]
    prev = visits_ref[1, jnp.maximum(v - 1, 0)]

    @pl.when((v == 0) | (tile != prev))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(end > start)
    def _():
        y = lax.dot_general(x_ref[...], w_ref[...], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)                     # [tm, bo]
        row = tile * tm + lax.broadcasted_iota(jnp.int32, y.shape, 0)
        o_ref[...] += jnp.where((row >= start) & (row < end), y, 0.0)


def tpu_cost(M: int, E: int, Dout: int, Din: int, x_itemsize: int, w_itemsize: int, *, active=None) -> dict:
    """HBM traffic of ``grouped_matmul_tpu`` from its grid and block specs: each visited expert's [Dout, Din]
    once (``active`` experts with rows; default the static bound min(M, E)), the row tiles once per column
    block, the f32 output once. Also the cost estimate handed to the compiler (with the static bound)."""
    tm = _tpu_rows(jnp.float32 if x_itemsize == 4 else jnp.bfloat16)
    rows = -(-M // tm) * tm
    col_blocks = Dout // _tpu_block_out(Dout, Din, w_itemsize)
    active = min(M, E) if active is None else active
    weights = active * Dout * Din * w_itemsize
    return dict(bytes=weights + col_blocks * rows * Din * x_itemsize + rows * Dout * 4, weight_bytes=weights,
                flops=2 * M * Dout * Din)


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_matmul_tpu(x, w, group_sizes, *, interpret=False):
    """``grouped_matmul_reference``'s contract as a Pallas TPU (Mosaic) kernel that reads only the experts with
    rows (``tpu_visits``): grid (column blocks, visits); a visit multiplies its row tile by its expert's
    [block_out, Din] weight block, keeping the rows of that expert. Made for decode and verify (M = tokens x
    top-k rows, most experts idle): one decode token reads its 8 experts, a 16-token verify the union of the
    experts its tokens pick. The compiler is given ``tpu_cost``'s static bound (min(M, E) experts) as the
    call's cost, since it cannot see inside a Mosaic call."""
    _check_shapes(x, w, group_sizes)
    M, Din = x.shape
    E, Dout, _ = w.shape
    tm = _tpu_rows(x.dtype)
    rows = -(-M // tm) * tm
    xp = jnp.pad(x, ((0, rows - M), (0, 0)))                                        # [rows, Din]
    visits = tpu_visits(group_sizes, M, tm)                                         # [4, V]
    bo = _tpu_block_out(Dout, Din, w.dtype.itemsize)
    cost = tpu_cost(M, E, Dout, Din, x.dtype.itemsize, w.dtype.itemsize)
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, tm=tm),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(Dout // bo, visits.shape[1]),
            in_specs=[pl.BlockSpec((tm, Din), lambda j, v, s: (s[1, v], 0)),
                      pl.BlockSpec((None, bo, Din), lambda j, v, s: (s[0, v], j, 0))],
            out_specs=pl.BlockSpec((tm, bo), lambda j, v, s: (s[1, v], j))),
        out_shape=jax.ShapeDtypeStruct((rows, Dout), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=cost["flops"], transcendentals=0, bytes_accessed=cost["bytes"]),
        interpret=interpret, name="grouped_matmul_tpu",
    )(visits, xp, w)
    total = jnp.sum(group_sizes.astype(jnp.int32))
    out = jnp.where(jnp.arange(M)[:, None] < total, out[:M], 0.0)                   # rows past the groups: zeros
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# Shipped configurations, for the compile report and the GPU bench

# Qwen3.5-35B-A3B (its config.json): E=256 experts, top-8, hidden 2048, expert width I=512.
_E, _TOP_K, _HIDDEN, _INTER = 256, 8, 2048, 512


def report_cases() -> list[KernelCase]:
    """gate_up and down at 35B-A3B shapes for 1 token, 16 tokens (one verify block) and 32 x 16
    tokens (verify at batch 32); bf16. ``bytes_moved`` assumes the rows spread over
    min(M, 256) distinct experts (the bench should route them so), i.e. that many weight slabs."""
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    cases = []
    for tokens in (1, 16, 32 * 16):
        M = tokens * _TOP_K
        active = min(M, _E)
        for name, Dout, Din in (("gate_up", 2 * _INTER, _HIDDEN), ("down", _HIDDEN, _INTER)):
            nbytes = active * Dout * Din * 2 + M * (Din + Dout) * 2 + _E * 4
            cases.append(KernelCase(
                f"grouped_matmul/35b_a3b/{name}/t{tokens}",
                functools.partial(grouped_matmul_pallas, blocks=GroupedBlocks()), grouped_matmul_reference,
                (sds((M, Din), bf16), sds((_E, Dout, Din), bf16), sds((_E,), jnp.int32)), nbytes))
    return cases
