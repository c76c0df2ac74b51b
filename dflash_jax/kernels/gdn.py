"""Gated DeltaNet (gated delta rule) kernels: chunked prefill, verify without state writes, commit replay.

Where it sits: the GDN layers of the Qwen3.5 target call these after their projections, causal conv,
q/k L2-norm and gate math; the state lives in the target cache. Prefill runs ``gdn_chunked``; each
speculative step runs ``gdn_verify`` on the T <= 16 block tokens (cache untouched) and, once the
acceptance length is known, ``gdn_replay`` applies the first n[b] of them (``target.commit``).

Per (row, value head) the state S is a [Dk, Dv] f32 matrix and each token applies
``S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q`` (transformers' torch_recurrent_gated_delta_rule).
Inputs arrive already prepared by the layer: q and k L2-normalised (q also scaled by Dk^-0.5),
``g`` the f32 log-decay and ``beta`` the f32 write strength. q and k have Hk heads; value head j
reads key head j // (Hv // Hk). A token with ``g = beta = 0`` leaves the state exactly unchanged,
which is how padding and "not committed" are expressed.

Given the writes u_t, the state is linear in them: S_t = e^(g_t) S_(t-1) + k_t u_t^T, so the state
after the first n tokens is, with G_t = g_0 + .. + g_t (the cumulative log-decay),
``S_n = e^(G_(n-1)) S_0 + sum_(t<n) e^(G_(n-1) - G_t) k_t u_t^T``: no token depends on the next.

Three entry points share these semantics:
- ``gdn_chunked``: whole prompts, chunk 64 (WY/UT form), returns outputs and the final state.
- ``gdn_verify``: T <= 16 speculative tokens, outputs and the writes u; the cached state is read, never written.
- ``gdn_replay``: the first n[b] of those tokens applied to the state from their k, u and g (the commit
  step), by the closed form above: one weighted sum, not a second pass of the recurrence.

On TPU (kernel modes "tpu", "tpu-interpret") ``gdn_verify`` runs a Mosaic kernel of the closed form, chain or
tree (``gdn_tpu.py``); replay and prefill run their XLA references there.

Pallas kernels (Triton backend; all math in f32, f32 dots at ``Precision.HIGHEST`` because the
Triton default for f32 is TF32). Each program owns one (row b, value head h, Dv tile of
``block_v``); the key head is picked by the index map, so GQA costs no copies.
- verify, grid (B, Hv, Dv/BV): the [Dk, BV] state tile is loaded once into registers and the T
  tokens are applied in a fori_loop with elementwise products and reductions (the products are
  rank-1 / matrix-vector, too thin for MMA). o_t and u_t are stored per token; the state is never
  stored. HBM traffic = state read + q, k, v, g, beta read + o, u written: ~B*Hv*Dk*Dv*4 bytes dominate.
- replay, grid (B, Hv, Dv/BV): the closed form in two loops of n[b] trips: the kept tokens' total
  log-decay (scalars), then the scaled tile plus one rank-1 term per token (no reduction: nothing
  in the loop reads the state), then one store into the aliased state. The loops do not depend on
  T, so a replay of n tokens is bit-identical whatever T the inputs were padded to, and n = 0 stores
  back exactly what was loaded. Traffic = state read + written once, plus k, u, g.
- chunked, grid (B, Hv, Dv/BV): the program walks the chunks of 64 sequentially with the state
  tile as the loop carry (FLA ``chunk_delta_h`` + ``chunk_o`` fused, no per-chunk states in HBM),
  held as Dk/BK row slices [BK, BV] so that no dot operand spans all of Dk (f32 operands of a
  [64, 128] dot alone fill the register file). Per chunk: cumulative log-decay,
  A = strictly-lower(beta k k^T * Gamma), the unit-lower inverse (I + A)^-1 by a 63-step forward
  substitution on the [64, 64] tile (rows picked with one-hot vectors and reductions: no
  solve_triangular or value slicing in Pallas-Triton), the WY factors, then
  V' = U - W S, O = (e^g Q) S + (Q K^T * Gamma) V', S <- e^g_C S + (e^(g_C - g) K)^T V'.
  Cost per chunk and program: the key side (k k^T, q k^T, W = inv (beta e^g K): 3 x 64*64*Dk MACs,
  plus the serial substitution, ~5 [64, 64] elementwise passes and 2 reductions per step) is
  recomputed by each of the Dv/BV programs of a head; the value side is ~5 dots of width BV. HBM
  traffic is the minimum per program (q, k, v, g, beta read once, o written once, the state read
  and written once); the duplicated key-side compute is the price of one program per state tile
  without scratch memory. T that is not a multiple of 64 is zero-padded by the wrapper (g = beta
  = 0 keeps the state), which costs a copy of the inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dflash_jax.kernels import dispatch
from dflash_jax.kernels.common import KernelCase, triton_params
from dflash_jax.kernels.gdn_tpu import gdn_verify_tpu

HIGHEST = jax.lax.Precision.HIGHEST


def _expand_heads(x, num_value_heads):
    """[B, T, Hk, D] -> [B, T, Hv, D] f32, consecutive value heads sharing a key head."""
    return jnp.repeat(x.astype(jnp.float32), num_value_heads // x.shape[2], axis=2)


def _scan_tokens(q, k, v, g, beta, state, *, want_outputs):
    """Token-by-token recurrence; the oracle for every GDN kernel: (o, u, final state), o and u
    [B, T, Hv, Dv] f32 (None unless ``want_outputs``)."""
    Hv = v.shape[2]
    k = _expand_heads(k, Hv)
    xs = [k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)]
    if want_outputs:
        xs.append(_expand_heads(q, Hv))
    xs = [jnp.moveaxis(x, 1, 0) for x in xs]  # time first

    def step(S, x):  # S [B, Hv, Dk, Dv]
        k_t, v_t, g_t, b_t = x[:4]
        S = S * jnp.exp(g_t)[..., None, None]
        u = b_t[..., None] * (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=HIGHEST))
        S = S + k_t[..., :, None] * u[..., None, :]
        o = jnp.einsum("bhk,bhkv->bhv", x[4], S, precision=HIGHEST) if want_outputs else None
        return S, (o, u if want_outputs else None)

    state, (o, u) = jax.lax.scan(step, state.astype(jnp.float32), xs)
    if not want_outputs:
        return None, None, state
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(u, 0, 1), state


def gdn_verify_reference(q, k, v, g, beta, state):
    """Outputs of T tokens from ``state`` and the values they write, without producing a new state.

    Args:
      q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv] f32.
    Returns:
      (o, u): [B, T, Hv, Dv] f32 each; u_t = beta_t (v_t - (e^(g_t) S_(t-1))^T k_t), what ``gdn_replay`` adds.
    """
    return _scan_tokens(q, k, v, g, beta, state, want_outputs=True)[:2]


def gdn_replay_reference(k, u, g, state, n):
    """The state after the first n[b] ([B] int32 in 0..T) of the tokens a verify returned the writes u of.

    Args:
      k: [B, T, Hk, Dk]; u: [B, T, Hv, Dv] (``gdn_verify``'s); g: [B, T, Hv]; state: [B, Hv, Dk, Dv] f32.
    Returns:
      [B, Hv, Dk, Dv] f32, by the closed form (module docstring): tokens t >= n[b] get weight 0 and their
      decay is masked before ``exp``, so n = 0 returns the state unchanged.
    """
    keep = jnp.arange(g.shape[1])[None, :] < n[:, None]  # [B, T]
    G = jnp.cumsum(jnp.where(keep[..., None], g.astype(jnp.float32), 0.0), axis=1)  # [B, T, Hv]
    total = G[:, -1]  # [B, Hv]: the kept tokens' log-decay
    weight = jnp.where(keep[..., None], jnp.exp(total[:, None] - G), 0.0)  # [B, T, Hv]
    k = _expand_heads(k, u.shape[2]) * weight[..., None]  # [B, T, Hv, Dk]
    u = u.astype(jnp.float32)
    if k.shape[1] == 1:  # a zero second token: XLA turns a 1-long contraction into a fused outer product
        k, u = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (k, u))
    update = jnp.einsum("bthk,bthv->bhkv", k, u, precision=HIGHEST)
    return jnp.exp(total)[..., None, None] * state.astype(jnp.float32) + update


def gdn_recurrent_reference(q, k, v, g, beta, state):
    """Token-by-token outputs and final state; (o [B,T,Hv,Dv] f32, state [B,Hv,Dk,Dv] f32)."""
    o, _, state = _scan_tokens(q, k, v, g, beta, state, want_outputs=True)
    return o, state


def _unit_lower_inverse_xla(a):
    """(I + a)^-1 for strictly lower a [..., C, C], in batched XLA matmuls: no LAPACK call.

    Doubling the inverted diagonal blocks: if X11, X22 invert the diagonal blocks T11, T22 of size b
    of I + a, the block of size 2b is inverted by [[X11, 0], [-X22 T21 X11, X22]]. Held as one [P, P]
    matrix D (block diagonal, blocks of size b) and L (the T21 blocks under it, a masked copy of a),
    that is D <- D - D L D: two full-size matmuls per level, log2(P) - 1 levels (the first is I - L).
    Every intermediate is a block of the final inverse, so the rounding stays at forward substitution's
    level (the Neumann product (I - a)(I + a^2)(I + a^4)... is exact only in exact arithmetic: its powers
    grow like binomials and cancel, ~1e9 relative error in f32 on a chunk of repeated tokens). C is
    padded to a power of two P.

    Why not ``jax.scipy.linalg.solve_triangular``: jaxlib 0.10.2's CPU kernel (lapack_strsm_ffi)
    fans the batch out onto the intra-op thread pool and blocks on it, so several simulated CPU
    devices (--xla_force_host_platform_device_count) reaching it together hang the process, and
    on a busy CPU it was 30-200x slower than this.
    """
    *lead, C, _ = a.shape
    P = 1 << max(C - 1, 0).bit_length()
    a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, P - C)] * 2)  # I + 0 beyond C: the inverse is unchanged
    row, col = jnp.arange(P)[:, None], jnp.arange(P)[None, :]
    mm = functools.partial(jnp.matmul, precision=HIGHEST)
    inv, b = jnp.broadcast_to(jnp.eye(P, dtype=a.dtype), a.shape), 1
    while b < P:
        low = jnp.where((row // b == col // b + 1) & (row // b % 2 == 1), a, 0.0)  # the T21 blocks of size b
        inv = inv - low if b == 1 else inv - mm(inv, mm(low, inv))
        b *= 2
    return inv[..., :C, :C]


def _verify_block(q, k, v, g, beta, state, tree=None, tree_depth=None):
    """``gdn_verify``'s XLA path: the T tokens as one chunk of the WY form, outputs and writes only.

    With G the cumulative log-decay and Gamma_ij = e^(G_i - G_j) (j <= i), the writes solve
    (I + A) u = beta (v - e^G K S_0), A = strictly-lower(beta K K^T * Gamma), and o = e^G Q S_0 +
    (Q K^T * Gamma) u: four batched matmuls (the queries and keys stacked against K and against S_0),
    the inverse, two more. No state is formed (the commit's replay does that from u).

    A tree (``tree`` [B, T, T] bool, row i the ancestors of token i and i itself; parents precede
    children) is the same system with the ancestor mask where the chain has the lower triangle and
    path-cumulative log-decays G_i = sum of g over the root -> i path where it has prefix sums: token i
    gets exactly the output and write of the recurrence run along its own path (the WY form on a tree, as
    in TreeWY, arXiv 2608.20961; checked in float64 against the per-path recurrence in the tests).
    The chain is the tree whose mask is the lower triangle. With ``tree_depth`` D (static; no token deeper
    than D below the root) the solve is forward substitution by depth instead of the inverse: D rounds of
    u <- rhs - A u, after which every token of depth <= D holds its final write (a token's only depends on
    its ancestors', all shallower; A is nilpotent of index D + 1): D T^2 Dv multiply-adds per head where the
    doubling inverse takes ~2 log2(T) T^3 (T = 65, D = 15: ~8x fewer), in the same rounding as substitution.
    """
    T, Hv = g.shape[1], v.shape[2]
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 2)  # noqa: E731  [B, T, H, ...] -> [B, H, T, ...]
    qk = f32(jnp.concatenate([_expand_heads(q, Hv), _expand_heads(k, Hv)], axis=1))  # [B, Hv, 2T, Dk]
    v, g, beta = f32(v), f32(g)[..., None], f32(beta)[..., None]  # [B, Hv, T, Dv], [B, Hv, T, 1] x2
    i = jnp.arange(T)
    if tree is None:
        on_path, G = i[:, None] >= i[None, :], jnp.cumsum(g, axis=2)  # [T, T]; [B, Hv, T, 1]
    else:
        on_path = tree[:, None]  # [B, 1, T, T]
        G = jnp.einsum("bij,bhjx->bhix", on_path[:, 0].astype(jnp.float32), g, precision=HIGHEST)
    strict = on_path & (i[:, None] != i[None, :])  # ancestors only (strictly lower: parents first)
    decay = jnp.exp(jnp.where(on_path, G - jnp.swapaxes(G, 2, 3), -jnp.inf))  # [B, Hv, T, T]
    dots = jnp.einsum("bhid,bhjd->bhij", qk, qk[:, :, T:], precision=HIGHEST)  # [B, Hv, 2T, T]: Q K^T; K K^T
    read = jnp.einsum("bhid,bhdv->bhiv", qk, state.astype(jnp.float32), precision=HIGHEST)  # [B, Hv, 2T, Dv]
    a = jnp.where(strict, beta * dots[:, :, T:] * decay, 0.0)
    rhs = beta * (v - jnp.exp(G) * read[:, :, T:])
    if tree is not None and tree_depth is not None:
        u = rhs
        for _ in range(tree_depth):  # after round d every token of depth <= d is final
            u = rhs - jnp.einsum("bhij,bhjv->bhiv", a, u, precision=HIGHEST)
    else:
        u = jnp.einsum("bhij,bhjv->bhiv", _unit_lower_inverse_xla(a), rhs, precision=HIGHEST)
    o = jnp.exp(G) * read[:, :, :T] + jnp.einsum("bhij,bhjv->bhiv", dots[:, :, :T] * decay, u, precision=HIGHEST)
    return jnp.moveaxis(o, 1, 2), jnp.moveaxis(u, 1, 2)


def gdn_chunked_reference(q, k, v, g, beta, state, *, chunk=64):
    """Chunked (WY/UT) form of the same recurrence, for long inputs; same contract as the recurrence."""
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    pad = -T % chunk
    nc = (T + pad) // chunk

    def prep(x, expand):  # [B, T, H, ...] -> [B, H, Nc, C, ...] f32, zero padded
        x = _expand_heads(x, Hv) if expand else x.astype(jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, nc, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v = prep(q, True), prep(k, True), prep(v, False)
    g, beta = prep(g, False), prep(beta, False)  # [B, H, Nc, C]
    gc = jnp.cumsum(g, axis=-1)
    i = jnp.arange(chunk)
    lower_incl = i[:, None] >= i[None, :]
    # Gamma_ij = exp(gc_i - gc_j) for j <= i, else 0 (masked before exp so it cannot overflow).
    gamma = jnp.exp(jnp.where(lower_incl, gc[..., :, None] - gc[..., None, :], -jnp.inf))
    kk = jnp.einsum("bhnid,bhnjd->bhnij", k, k, precision=HIGHEST)
    strict = beta[..., :, None] * kk * gamma * (i[:, None] > i[None, :])
    tri = _unit_lower_inverse_xla(strict)  # (I + A)^-1 [B, H, Nc, C, C]
    u = jnp.einsum("bhnij,bhnjd->bhnid", tri, beta[..., None] * v, precision=HIGHEST)
    w = jnp.einsum("bhnij,bhnjd->bhnid", tri, (beta * jnp.exp(gc))[..., None] * k, precision=HIGHEST)
    qk = jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=HIGHEST) * gamma

    def step(S, x):  # S [B, H, Dk, Dv]
        q_c, k_c, u_c, w_c, qk_c, gc_c = x
        v_new = u_c - jnp.einsum("bhik,bhkv->bhiv", w_c, S, precision=HIGHEST)
        o = jnp.einsum("bhik,bhkv->bhiv", q_c * jnp.exp(gc_c)[..., None], S, precision=HIGHEST)
        o = o + jnp.einsum("bhij,bhjv->bhiv", qk_c, v_new, precision=HIGHEST)
        last = gc_c[..., -1:]
        S = jnp.exp(last)[..., None] * S + jnp.einsum(
            "bhik,bhiv->bhkv", k_c * jnp.exp(last - gc_c)[..., None], v_new, precision=HIGHEST)
        return S, o

    xs = [jnp.moveaxis(x, 2, 0) for x in (q, k, u, w, qk, gc)]
    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)  # o [Nc, B, H, C, Dv]
    return jnp.moveaxis(jnp.moveaxis(o, 0, 2).reshape(B, Hv, nc * chunk, Dv)[:, :, :T], 1, 2), state


# ---------------------------------------------------------------------------------------------
# Pallas kernels


def _check_powers_of_two(blocks, *names):
    """Tiles must divide the power-of-two head dims and load as power-of-two blocks."""
    for name in names:
        size = getattr(blocks, name)
        if size < 1 or size & (size - 1):
            raise ValueError(f"{type(blocks).__name__}.{name} = {size} must be a power of two")


@dataclasses.dataclass(frozen=True)
class RecurrentBlocks:
    """Tiling of the token-recurrent kernels (verify and replay): one program per [Dk, block_v] tile.

    The default holds a [128, 32] f32 tile in 4 wavefronts: ~50 VGPRs, no spills, 512 B LDS on
    gfx950; 192 programs per layer for the 27B at batch 1 (48 heads x 4 tiles).
    """

    block_v: int = 32
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        _check_powers_of_two(self, "block_v")


@dataclasses.dataclass(frozen=True)
class ChunkedBlocks:
    """Tiling of the chunked prefill kernel: one program per [Dk, block_v] state tile, chunks of ``chunk``,
    the Dk contractions split into block_k slices.

    Chosen from the gfx950 compile report (dflash_jax/perf/kernel_report.py) at Dk = 128 under both triton 3.7.1 and
    3.8.0: (16, 32, 4 warps) compiles without spills in both (392 / 382 VGPR, ~60 SGPR, 36 KiB LDS);
    2 warps spill 9 VGPRs under 3.8.0, (32, 32, 4 warps) one VGPR under 3.7.1; whole-Dk (block_k =
    128) operands spill VGPRs.
    """

    block_v: int = 16
    block_k: int = 32
    chunk: int = 64
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        _check_powers_of_two(self, "block_v", "block_k", "chunk")


def _dot(a, b, contract=(1, 0)):
    """2-D f32 dot contracting a's axis contract[0] with b's axis contract[1], IEEE f32 (not TF32)."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def _gdn_verify_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, u_ref):
    # q_ref, k_ref [T, Dk]; v_ref, o_ref, u_ref [T, BV]; g_ref, beta_ref [T]; state_ref [Dk, BV]
    f32 = jnp.float32

    def body(t, S):  # one token of the gated delta rule on the state tile S [Dk, BV]
        k = k_ref[t, :].astype(f32)
        S = S * jnp.exp(g_ref[t])
        u = beta_ref[t] * (v_ref[t, :].astype(f32) - jnp.sum(k[:, None] * S, axis=0))  # [BV]
        S = S + k[:, None] * u[None, :]
        o_ref[t, :] = jnp.sum(q_ref[t, :].astype(f32)[:, None] * S, axis=0)
        u_ref[t, :] = u
        return S

    jax.lax.fori_loop(0, v_ref.shape[0], body, state_ref[...])


def _gdn_replay_kernel(k_ref, u_ref, g_ref, n_ref, state_ref, state_out_ref):
    # k_ref [T, Dk]; u_ref [T, BV]; g_ref [T]; n_ref [] int32; state refs [Dk, BV]
    f32 = jnp.float32
    n = n_ref[()]
    # Trip counts are n, not T: tokens past n are never touched, so the result cannot depend on T.
    total = jax.lax.fori_loop(0, n, lambda t, acc: acc + g_ref[t], jnp.zeros((), f32))

    def body(t, carry):  # carry: (S, G_(t-1)); adds e^(total - G_t) k_t u_t^T
        S, G = carry
        G = G + g_ref[t]
        k = k_ref[t, :].astype(f32) * jnp.exp(total - G)
        return S + k[:, None] * u_ref[t, :].astype(f32)[None, :], G

    S, _ = jax.lax.fori_loop(0, n, body, (state_ref[...] * jnp.exp(total), jnp.zeros((), f32)))
    state_out_ref[...] = S


def _unit_lower_inverse(a_t):
    """(I + a)^-1 for a strictly lower [C, C] a, given as its transpose a_t, by forward substitution.

    Row i of the inverse is e_i + d_i with d_i = -sum_{j<i} a_ij row_j. Rows are finished in order
    and a_ij = 0 for j >= i, so the not-yet-finished (identity) rows never contribute; d_i is 0 in
    column i (earlier rows are lower triangular), so adding it to the identity row is exact. Rows and
    columns are picked by multiplying with one-hot f32 vectors rather than selecting with [C, C]
    masks, whose per-element lane masks would fill the scalar registers. Taking a transposed puts
    a's row i along the rows of the tile, where it multiplies the rows of the inverse: neither
    reduction then needs a layout change.
    """
    C = a_t.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)

    def body(i, inv):
        a_i = jnp.sum(a_t * (col == i).astype(jnp.float32), axis=1)  # [C]: a_i[j] = a[i, j]
        d_i = -jnp.sum(a_i[:, None] * inv, axis=0)  # [C]
        return inv + (row == i).astype(jnp.float32) * d_i[None, :]

    return jax.lax.fori_loop(1, C, body, (row == col).astype(jnp.float32))


_MASKED = 1e30  # exp(x - _MASKED * n) = 0 for n >= 1 and any log-decay difference x below 1e29


def _gdn_chunked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, state_ref, o_ref, state_out_ref, *, chunk,
                        block_k):
    # q_ref, k_ref [Tp, Dk]; v_ref, o_ref [Tp, BV]; g_ref, beta_ref [Tp]; state refs [Dk, BV]
    f32 = jnp.float32
    C, BK = chunk, block_k
    slices = [pl.ds(s * BK, BK) for s in range(k_ref.shape[1] // BK)]
    row = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)

    def body(c, S):  # S: the state as Dk/BK row slices [BK, BV] (dot operands then span BK, not Dk)
        rows = pl.ds(c * C, C)
        key = lambda ks: k_ref[rows, ks].astype(f32)  # [C, BK]
        beta = beta_ref[rows]  # [C]
        gc = jnp.cumsum(g_ref[rows])  # [C] log-decay from the chunk start, inclusive
        kk = sum(_dot(key(ks), key(ks), (1, 1)) for ks in slices)  # [C, C]
        # a_t[j, i] = a[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) for i > j, else 0 (k k^T is
        # symmetric). Masked before exp, so exp(gc_i - gc_j) for j > i (which can be huge) never
        # exists: the masked exponents get -1e30 * (j - i + 1) (exactly + 0 where kept) and exp
        # gives exactly 0. Integer max and a multiply, no compare: the compiler hoists loop-invariant
        # masks out of the chunk loop, and a compare's per-element lane masks (an SGPR pair each)
        # then spill the scalar registers (triton 3.7.1: 76 SGPR spills with jnp.where masks).
        above = jnp.maximum(row - col + 1, 0).astype(f32)  # [C, C]: j - i + 1 where j >= i, else 0
        a_t = beta[None, :] * kk * jnp.exp(gc[None, :] - gc[:, None] - _MASKED * above)
        inv = _unit_lower_inverse(a_t)  # [C, C]
        v_new = _dot(inv, beta[:, None] * v_ref[rows, :].astype(f32))  # [C, BV], becomes U - W S
        o = jnp.zeros_like(v_new)  # [C, BV]
        qk = jnp.zeros_like(inv)  # [C, C]
        for ks, S_s in zip(slices, S, strict=True):
            q_s = q_ref[rows, ks].astype(f32)  # [C, BK]
            w_s = _dot(inv, (beta * jnp.exp(gc))[:, None] * key(ks))  # [C, BK]
            v_new = v_new - _dot(w_s, S_s)
            o = o + _dot(q_s * jnp.exp(gc)[:, None], S_s)
            qk = qk + _dot(q_s, key(ks), (1, 1))
        gamma = jnp.exp(gc[:, None] - gc[None, :] - _MASKED * jnp.maximum(col - row, 0).astype(f32))  # [C, C]
        o_ref[rows, :] = o + _dot(qk * gamma, v_new)
        last = jnp.sum(jnp.where(col[0] == C - 1, gc, 0.0))  # gc[C-1] without value slicing
        decay = jnp.exp(last - gc)[:, None]
        return tuple(jnp.exp(last) * S_s + _dot(key(ks) * decay, v_new, (0, 0))
                     for ks, S_s in zip(slices, S, strict=True))

    S = tuple(state_ref[ks, :] for ks in slices)
    S = jax.lax.fori_loop(0, v_ref.shape[0] // C, body, S)
    for ks, S_s in zip(slices, S, strict=True):
        state_out_ref[ks, :] = S_s


def _check_shapes(name, q, k, v, g, beta, state, n=None, v_name="v"):
    """Validates the shared GDN contract (q, beta may be None: not an argument); returns (B, T, Hk, Hv, Dk, Dv)."""
    if k.ndim != 4:
        raise ValueError(f"{name}: k must be [B, T, Hk, Dk], got shape {k.shape}")
    B, T, Hk, Dk = k.shape
    if q is not None and q.shape != k.shape:
        raise ValueError(f"{name}: q must have k's shape {k.shape} [B, T, Hk, Dk], got shape {q.shape}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"{name}: {v_name} must be [B={B}, T={T}, Hv, Dv], got shape {v.shape}")
    Hv, Dv = v.shape[2], v.shape[3]
    if Hv % Hk:
        raise ValueError(f"{name}: value heads {Hv} ({v_name} shape {v.shape}) must be a multiple of key heads "
                         f"{Hk} (k shape {k.shape})")
    for arg, x in (("g", g), ("beta", beta)):
        if x is not None and x.shape != (B, T, Hv):
            raise ValueError(f"{name}: {arg} must be [B, T, Hv] = {(B, T, Hv)}, got shape {x.shape}")
    if state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"{name}: state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}, "
                         f"got shape {state.shape}")
    if n is not None and n.shape != (B,):
        raise ValueError(f"{name}: n must be [B] = {(B,)}, got shape {n.shape}")
    for arg, d in (("Dk", Dk), ("Dv", Dv)):
        if d & (d - 1):
            raise ValueError(f"{name}: {arg} = {d} must be a power of two (Triton block sizes)")
    return B, T, Hk, Hv, Dk, Dv


def _recurrent_specs(T, Dk, BV, group):
    """BlockSpecs over grid (b, h, j): k [B,T,Hk,Dk], v [B,T,Hv,Dv], g/beta [B,T,Hv], state [B,Hv,Dk,Dv]."""
    key = pl.BlockSpec((None, T, None, Dk), lambda b, h, j: (b, 0, h // group, 0))
    value = pl.BlockSpec((None, T, None, BV), lambda b, h, j: (b, 0, h, j))
    gate = pl.BlockSpec((None, T, None), lambda b, h, j: (b, 0, h))
    state = pl.BlockSpec((None, None, Dk, BV), lambda b, h, j: (b, h, 0, j))
    return key, value, gate, state


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def gdn_verify_pallas(q, k, v, g, beta, state, *, blocks=RecurrentBlocks(), interpret=False):
    """Pallas kernel for ``gdn_verify_reference`` (same arguments and results)."""
    B, T, Hk, Hv, Dk, Dv = _check_shapes("gdn_verify", q, k, v, g, beta, state)
    BV = min(blocks.block_v, Dv)
    key, value, gate, st = _recurrent_specs(T, Dk, BV, Hv // Hk)
    out = jax.ShapeDtypeStruct((B, T, Hv, Dv), jnp.float32)
    return pl.pallas_call(
        _gdn_verify_kernel,
        out_shape=(out, out),
        grid=(B, Hv, Dv // BV),
        in_specs=[key, key, value, gate, gate, st],
        out_specs=(value, value),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="gdn_verify",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def gdn_replay_pallas(k, u, g, state, n, *, blocks=RecurrentBlocks(), interpret=False):
    """Pallas kernel for ``gdn_replay_reference``; the new state aliases the old one."""
    B, T, Hk, Hv, Dk, Dv = _check_shapes("gdn_replay", None, k, u, g, None, state, n, v_name="u")
    BV = min(blocks.block_v, Dv)
    key, value, gate, st = _recurrent_specs(T, Dk, BV, Hv // Hk)
    count = pl.BlockSpec((None,), lambda b, h, j: (b,))
    n = jnp.clip(n.astype(jnp.int32), 0, T)  # the kernel's trip count: never past the T tokens given
    return pl.pallas_call(
        _gdn_replay_kernel,
        out_shape=jax.ShapeDtypeStruct((B, Hv, Dk, Dv), jnp.float32),
        grid=(B, Hv, Dv // BV),
        in_specs=[key, value, gate, count, st],
        out_specs=st,
        input_output_aliases={4: 0},
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="gdn_replay",
    )(k, u, g.astype(jnp.float32), n, state.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def gdn_chunked_pallas(q, k, v, g, beta, state, *, blocks=ChunkedBlocks(), interpret=False):
    """Pallas kernel for ``gdn_chunked_reference`` (same arguments and results)."""
    B, T, Hk, Hv, Dk, Dv = _check_shapes("gdn_chunked", q, k, v, g, beta, state)
    BV, C = min(blocks.block_v, Dv), blocks.chunk
    pad = -T % C
    if pad:  # zero tokens with g = beta = 0 leave the state unchanged; their outputs are dropped
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        q, k, v, g, beta = (jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
    Tp = T + pad
    key, value, gate, st = _recurrent_specs(Tp, Dk, BV, Hv // Hk)
    o, state = pl.pallas_call(
        functools.partial(_gdn_chunked_kernel, chunk=C, block_k=min(blocks.block_k, Dk)),
        out_shape=(jax.ShapeDtypeStruct((B, Tp, Hv, Dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hv, Dk, Dv), jnp.float32)),
        grid=(B, Hv, Dv // BV),
        in_specs=[key, key, value, gate, gate, st],
        out_specs=(value, st),
        compiler_params=triton_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="gdn_chunked",
    )(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32))
    return (o[:, :T] if pad else o), state


# ---------------------------------------------------------------------------------------------
# Dispatching entry points


def gdn_chunked(q, k, v, g, beta, state, *, impl=None):
    """Whole-prompt GDN; same contract as ``gdn_chunked_reference``: (o [B,T,Hv,Dv] f32, state). The TPU
    modes run the reference (no TPU form)."""
    mode = dispatch.resolve(impl)
    if mode in ("reference", *dispatch.TPU_MODES):
        return gdn_chunked_reference(q, k, v, g, beta, state)
    run = functools.partial(gdn_chunked_pallas, interpret=mode == "interpret")
    return run(q, k, v, g, beta, state)


@functools.cache
def _tree_fallback() -> None:
    """Says once per process why a draft tree's verify leaves the Pallas kernel."""
    logging.getLogger(__name__).warning("gdn_verify: the Pallas kernel walks a chain of tokens; draft trees run "
                                        "the XLA closed form (_verify_block) instead")


def _partitioned() -> bool:
    """Whether this trace runs under a mesh with an axis of several devices that is not manual (a ``shard_map``
    body's axes are): there a Mosaic call cannot be partitioned by XLA (JAX refuses to compile it)."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(size > 1 and kind != jax.sharding.AxisType.Manual
               for size, kind in zip(mesh.axis_sizes, mesh.axis_types, strict=True))


@functools.cache
def _mesh_fallback() -> None:
    """Says once per process why a verify traced on a mesh leaves the Mosaic kernel."""
    logging.getLogger(__name__).warning("gdn_verify: traced on a device mesh outside shard_map, where a Mosaic call "
                                        "cannot be partitioned; it runs the XLA closed form (_verify_block) instead")


def gdn_verify(q, k, v, g, beta, state, *, impl=None, tree=None, tree_depth=None):
    """Verify outputs and writes without a state write; same contract as ``gdn_verify_reference``.

    The XLA path runs the T tokens as one chunk of the WY form (``_verify_block``: a few batched matmuls)
    instead of the token scan, whose 16 trips cost more dispatch than their FLOPs in the fused CPU loop.
    ``tree`` [B, T, T] bool (each token's ancestors and itself; parents before children): every token
    along its own root -> token path, a draft tree's verify. The Triton kernel walks a chain only, so a
    tree runs the XLA path in modes "pallas" and "interpret" (said once in the log). ``tree_depth`` (static): the
    deepest token's depth, when known (a draft tree's: block - 1), for the cheaper solve of ``_verify_block``.
    The TPU modes run the Mosaic kernel (``gdn_tpu.py``), chain and tree alike, except when traced on a
    device mesh outside ``shard_map`` (the layer's ``parallel.per_head``): there the XLA path (said once).
    """
    mode = dispatch.resolve(impl)
    if mode in dispatch.TPU_MODES and _partitioned():
        _mesh_fallback()
        mode = "reference"
    if mode in dispatch.TPU_MODES:
        _check_shapes("gdn_verify", q, k, v, g, beta, state)
        if tree is not None and tree.shape != (k.shape[0], k.shape[1], k.shape[1]):
            raise ValueError(f"gdn_verify: tree must be [B, T, T] = {k.shape[:2] + k.shape[1:2]}, got shape "
                             f"{tree.shape}")
        return gdn_verify_tpu(q, k, v, g, beta, state, tree, tree_depth=tree_depth,
                              interpret=mode == "tpu-interpret")
    if tree is not None and mode != "reference":
        _tree_fallback()
    if mode == "reference" or tree is not None:
        return _verify_block(q, k, v, g, beta, state, tree, tree_depth)
    run = functools.partial(gdn_verify_pallas, interpret=mode == "interpret")
    return run(q, k, v, g, beta, state)


def gdn_replay(k, u, g, state, n, *, impl=None):
    """Commit: the state after the first n[b] tokens; same contract as ``gdn_replay_reference``. The TPU modes
    run the reference (no TPU form: it reads and writes the state once as it is)."""
    mode = dispatch.resolve(impl)
    if mode in ("reference", *dispatch.TPU_MODES):
        return gdn_replay_reference(k, u, g, state, n)
    run = functools.partial(gdn_replay_pallas, interpret=mode == "interpret")
    return run(k, u, g, state, n)


# ---------------------------------------------------------------------------------------------
# Shipped configurations, for the compile report and the GPU bench

# (name, Hk, Hv); Dk = Dv = 128 for both (their config.json files)
_MODELS = (("27b", 16, 48), ("35b_a3b", 16, 32))


def report_cases() -> list[KernelCase]:
    """The three GDN kernels at the real Qwen3.5 shapes: batch 1 and 32, T = 16 (verify, replay), and
    a 4096-token prefill (chunked); bf16 q/k/v, f32 gates and state."""
    sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    D = 128
    cases = []
    for model, Hk, Hv in _MODELS:
        for B, T, kind in ((1, 16, "step"), (32, 16, "step"), (1, 4096, "prefill")):
            qk = sds((B, T, Hk, D), bf16)
            v = sds((B, T, Hv, D), bf16)
            gate = sds((B, T, Hv), f32)
            state = sds((B, Hv, D, D), f32)
            inputs = 2 * qk.size * 2 + v.size * 2 + 2 * gate.size * 4  # q, k, v, g, beta
            state_bytes, o_bytes = state.size * 4, v.size * 4  # o (and u): f32
            tag = f"{model}/b{B}/t{T}"
            if kind == "prefill":
                cases.append(KernelCase(
                    f"gdn_chunked/{tag}", functools.partial(gdn_chunked_pallas, blocks=ChunkedBlocks()),
                    gdn_chunked_reference, (qk, qk, v, gate, gate, state),
                    inputs + o_bytes + 2 * state_bytes))
                continue
            cases.append(KernelCase(
                f"gdn_verify/{tag}", functools.partial(gdn_verify_pallas, blocks=RecurrentBlocks()),
                gdn_verify_reference, (qk, qk, v, gate, gate, state), inputs + 2 * o_bytes + state_bytes))
            u = sds(v.shape, f32)
            cases.append(KernelCase(
                f"gdn_replay/{tag}", functools.partial(gdn_replay_pallas, blocks=RecurrentBlocks()),
                gdn_replay_reference, (qk, u, gate, state, sds((B,), jnp.int32)),
                qk.size * 2 + u.size * 4 + gate.size * 4 + B * 4 + 2 * state_bytes))
    return cases
