"""The Gated DeltaNet verify as a Pallas TPU (Mosaic) kernel; its oracle is ``gdn.gdn_verify_reference`` (same
arguments, same results: the T outputs o and the writes u the commit replays), and for a draft tree
``gdn._verify_block``'s tree form.

Why: on TPU the XLA closed form (``gdn._verify_block``) keeps its intra-block products ([2T, T] dots, the
decays, the inverse, all f32 and per value head) and their transposes in HBM: compiled alone at Qwen3.5-35B-A3B
shapes it accesses 30.1 MB at T = 16 where the state and the inputs are ~2.6 MB. Here one grid step owns one
row and a block of ``KB`` key heads (their ``KB * group`` value heads): it reads those heads' q, k, v and
states once, keeps every [T, T] and [T, Dv] intermediate in VMEM, and writes o and u once.

Per value head (T tokens, f32, everything as 2-D tiles: tokens along sublanes):
  G = on_path @ g (the cumulative log-decay; on a tree the sum along the root -> token path), as a masked
  lane reduction, then its transpose by a masked sublane reduction (no cumsum or vector transpose);
  decay_ij = e^(G_i - G_j) on the path (j an ancestor of i, or i), else 0;
  read = [Q; K] S_0 (two MXU dots at HIGHEST precision); QK^T and KK^T (once per key head);
  A = strictly-lower(beta_i (k_i . k_j) decay_ij), rhs = beta (v - e^G (K S_0));
  u = (I + A)^-1 rhs (the blocked doubling inverse, as ``gdn._unit_lower_inverse_xla``; with a static tree
  depth D instead D rounds of u <- rhs - A u, as the XLA tree form);
  o = e^G (Q S_0) + (QK^T * decay) u.

Layout: the operands keep the layer's shapes (q, k [B, T, Hk, Dk]; v, o, u [B, T, Hv, Dv]). On a TPU the last
two dimensions are tiled (8 sublanes x 128 lanes), so a [B, T, H*D] view would be a relayout copy in HBM (the
first version of this kernel: 1.8 MB of copies at 35B-A3B shapes), not a free reshape; instead a block is KB
key heads (a multiple of 8, or all of them) of all T tokens, [T, KB, Dk], and the kernel loads one head's
[T, Dk] by a strided load (``ref[:, h, :]``). g and beta [B, T, Hv] come whole per row (their block index does
not change along the head axis, so the pipeline fetches them once per row); a head's column is picked by a
lane mask. The state [B, Hv, Dk, Dv] is read as [KB * group, Dk, Dv] blocks and never written. ``traffic``
walks the same block specs over the grid and counts the bytes the pipeline moves (the compiler cannot see
inside a Mosaic call; the call hands it that count as its cost): each input and output exactly once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

HIGHEST = jax.lax.Precision.HIGHEST


def key_heads_per_block(Hk: int) -> int:
    """Key heads per grid step: the smallest multiple of 8 that divides Hk (a Mosaic block's second-minor
    dimension, here the heads, is a multiple of 8 or the whole axis), else all Hk."""
    return next((kb for kb in range(8, Hk, 8) if Hk % kb == 0), Hk)


def _dot(a, b, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def _inverse(a, row, col):
    """(I + a)^-1 for strictly lower a [T, T]: blocks of size b doubled, D <- D - D L D (L: a's sub-diagonal
    blocks of size b), as ``gdn._unit_lower_inverse_xla``; on [T, T] directly (padding to a power of two
    changes nothing inside [T, T]: the inverse is lower triangular)."""
    T, f32 = a.shape[0], jnp.float32
    inv, b, s = (row == col).astype(f32), 1, 0
    while b < T:
        rb, cb = jax.lax.shift_right_logical(row, s), jax.lax.shift_right_logical(col, s)
        low = jnp.where((rb == cb + 1) & ((rb & 1) == 1), a, 0.0)
        inv = inv - low if b == 1 else inv - _dot(inv, _dot(low, inv))
        b, s = 2 * b, s + 1
    return inv


def _kernel(*refs, group: int, KB: int, Dk: int, Dv: int, tree: bool, depth: int | None):
    # q_ref, k_ref [T, KB, Dk]; v_ref, o_ref, u_ref [T, HB, Dv]; g_ref, beta_ref [T, Hv] (whole row);
    # mask_ref [T, T] f32 (trees only); state_ref [HB, Dk, Dv]
    if tree:
        q_ref, k_ref, v_ref, g_ref, beta_ref, mask_ref, state_ref, o_ref, u_ref = refs
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, u_ref = refs
    f32 = jnp.float32
    T, Hv = g_ref.shape
    HB = KB * group
    row = jax.lax.broadcasted_iota(jnp.int32, (T, T), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (T, T), 1)
    eye = (row == col).astype(f32)
    on_path = mask_ref[...] > 0.5 if tree else row >= col  # [T, T]: j is i's ancestor or i
    strict = on_path & (row != col)
    lane = jax.lax.broadcasted_iota(jnp.int32, (T, Hv), 1)
    g_all, beta_all = g_ref[...], beta_ref[...]  # [T, Hv]
    first = pl.program_id(1) * HB  # the block's first value head

    def column(x, h):  # [T, Hv] -> [T, 1]: value head h's column
        return jnp.sum(jnp.where(lane == first + h, x, 0.0), axis=1, keepdims=True)

    def transpose(x):  # [T, 1] -> [1, T]
        return jnp.sum(eye * x, axis=0, keepdims=True)

    for kh in range(KB):
        q, k = q_ref[:, kh, :].astype(f32), k_ref[:, kh, :].astype(f32)  # [T, Dk]: strided loads
        qk, kk = _dot(q, k, ((1,), (1,))), _dot(k, k, ((1,), (1,)))  # [T, T]: Q K^T, K K^T
        for h in range(kh * group, (kh + 1) * group):
            S = state_ref[h]  # [Dk, Dv] f32
            g, beta = column(g_all, h), column(beta_all, h)  # [T, 1]
            G = jnp.sum(jnp.where(on_path, transpose(g), 0.0), axis=1, keepdims=True)  # [T, 1]
            decay = jnp.where(on_path, jnp.exp(jnp.where(on_path, G - transpose(G), 0.0)), 0.0)  # [T, T]
            eG = jnp.exp(G)
            a = jnp.where(strict, beta * kk * decay, 0.0)
            rhs = beta * (v_ref[:, h, :].astype(f32) - eG * _dot(k, S))  # [T, Dv]
            if depth is not None:  # after round d every token of depth <= d holds its final write
                u = rhs
                for _ in range(depth):
                    u = rhs - _dot(a, u)
            else:
                u = _dot(_inverse(a, row, col), rhs)
            o_ref[:, h, :] = eG * _dot(q, S) + _dot(qk * decay, u)
            u_ref[:, h, :] = u


def _layout(B, T, Hk, Hv, Dk, Dv, KB, tree):
    """(grid, in_specs, out_specs) over grid (row b, key-head block j); one place for the kernel and ``traffic``."""
    HB = KB * (Hv // Hk)
    key = pl.BlockSpec((None, T, KB, Dk), lambda b, j: (b, 0, j, 0))  # q, k [B, T, Hk, Dk]
    value = pl.BlockSpec((None, T, HB, Dv), lambda b, j: (b, 0, j, 0))  # v, o, u [B, T, Hv, Dv]
    gate = pl.BlockSpec((None, T, Hv), lambda b, j: (b, 0, 0))  # g, beta [B, T, Hv]: once per row
    state = pl.BlockSpec((None, HB, Dk, Dv), lambda b, j: (b, j, 0, 0))  # [B, Hv, Dk, Dv]
    mask = [pl.BlockSpec((None, T, T), lambda b, j: (b, 0, 0))] if tree else []  # [B, T, T]
    return (B, Hk // KB), [key, key, value, gate, gate, *mask, state], [value, value]


def traffic(q, k, v, g, beta, state, tree=None, *, key_heads=None) -> int:
    """HBM bytes ``gdn_verify_tpu`` moves for these operands (arrays or ``jax.ShapeDtypeStruct``s): its grid
    walked in order, each input block counted when its index differs from the previous step's (the pipeline's
    rule for fetching inputs; outputs are written back by the same rule)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    KB = key_heads or key_heads_per_block(Hk)
    grid, in_specs, out_specs = _layout(B, T, Hk, Hv, Dk, Dv, KB, tree is not None)
    f32 = np.float32
    dtypes = [q.dtype, k.dtype, v.dtype, f32, f32, *([f32] if tree is not None else []), f32, f32, f32]
    moved = 0
    for spec, dtype in zip(in_specs + out_specs, dtypes, strict=True):
        nbytes = int(np.prod([1 if d is None else d for d in spec.block_shape])) * np.dtype(dtype).itemsize
        indices = [spec.index_map(b, j) for b in range(grid[0]) for j in range(grid[1])]
        moved += nbytes * sum(1 for i, index in enumerate(indices) if i == 0 or index != indices[i - 1])
    return moved


@functools.partial(jax.jit, static_argnames=("tree_depth", "key_heads", "interpret"))
def gdn_verify_tpu(q, k, v, g, beta, state, tree=None, *, tree_depth=None, key_heads=None, interpret=False):
    """``gdn_verify_reference``'s contract (``tree`` [B, T, T] bool and ``tree_depth``: ``gdn.gdn_verify``'s tree
    form) as a Mosaic kernel: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv]
    -> (o, u) [B, T, Hv, Dv] f32 each. ``key_heads``: key heads per grid step (None: ``key_heads_per_block``).
    Shapes are checked by the caller, ``gdn.gdn_verify`` (this module imports nothing from it)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    group = Hv // Hk
    KB = key_heads or key_heads_per_block(Hk)
    if Hk % KB:
        raise ValueError(f"gdn_verify_tpu: key_heads={KB} must divide the {Hk} key heads (k shape {k.shape})")
    is_tree = tree is not None
    operands = [q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32)]
    if is_tree:
        operands.append(tree.astype(jnp.float32))
    operands.append(state.astype(jnp.float32))
    grid, in_specs, out_specs = _layout(B, T, Hk, Hv, Dk, Dv, KB, is_tree)
    moved = traffic(q, k, v, g, beta, state, tree, key_heads=KB)
    levels = max(T - 1, 0).bit_length()
    flops = B * Hv * (4 * T * Dk * Dv + 4 * T * T * Dv + 4 * levels * T**3) + B * Hk * 4 * T * T * Dk
    out = jax.ShapeDtypeStruct((B, T, Hv, Dv), jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, group=group, KB=KB, Dk=Dk, Dv=Dv, tree=is_tree,
                          depth=tree_depth if is_tree else None),
        grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=(out, out),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=B * Hv * (T * T + T), bytes_accessed=moved),
        interpret=interpret, name="gdn_verify_tpu",
    )(*operands)
