"""Gated DeltaNet (gated delta rule) kernels: chunked prefill, verify without state writes, commit replay.

Per (row, value head) the state S is a [Dk, Dv] f32 matrix and each token applies
``S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q`` (reference/qwen35.md §3.3).
Inputs arrive already prepared by the layer: q and k L2-normalised (q also scaled by Dk^-0.5),
``g`` the f32 log-decay and ``beta`` the f32 write strength. q and k have Hk heads; value head j
reads key head j // (Hv // Hk). A token with ``g = beta = 0`` leaves the state exactly unchanged,
which is how padding and "not committed" are expressed.

Three entry points share these semantics:
- ``gdn_chunked``: whole prompts, chunk 64 (WY/UT form), returns outputs and the final state.
- ``gdn_verify``: T <= 16 speculative tokens, outputs only; the cached state is read, never written.
- ``gdn_replay``: the first n[b] of those tokens applied to the state (the commit step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from dflash_jax.kernels import dispatch

HIGHEST = jax.lax.Precision.HIGHEST


def _expand_heads(x, num_value_heads):
    """[B, T, Hk, D] -> [B, T, Hv, D] f32, consecutive value heads sharing a key head."""
    return jnp.repeat(x.astype(jnp.float32), num_value_heads // x.shape[2], axis=2)


def _scan_tokens(q, k, v, g, beta, state, *, want_outputs):
    """Token-by-token recurrence; the oracle for every GDN kernel."""
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
        return S, o

    state, o = jax.lax.scan(step, state.astype(jnp.float32), xs)
    return (jnp.moveaxis(o, 0, 1) if want_outputs else None), state


def gdn_verify_reference(q, k, v, g, beta, state):
    """Outputs of T tokens from ``state`` without producing a new state.

    Args:
      q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dk, Dv] f32.
    Returns:
      o: [B, T, Hv, Dv] f32.
    """
    return _scan_tokens(q, k, v, g, beta, state, want_outputs=True)[0]


def gdn_replay_reference(k, v, g, beta, state, n):
    """The state after applying the first n[b] tokens of each row ([B] int32)."""
    keep = jnp.arange(g.shape[1])[None, :, None] < n[:, None, None]  # [B, T, 1]
    g, beta = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
    return _scan_tokens(None, k, v, g, beta, state, want_outputs=False)[1]


def gdn_recurrent_reference(q, k, v, g, beta, state):
    """Token-by-token outputs and final state; (o [B,T,Hv,Dv] f32, state [B,Hv,Dk,Dv] f32)."""
    return _scan_tokens(q, k, v, g, beta, state, want_outputs=True)


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
    tri = solve_triangular(strict + jnp.eye(chunk), jnp.broadcast_to(jnp.eye(chunk), strict.shape),
                           lower=True, unit_diagonal=True)
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
    o = jnp.moveaxis(o, 0, 2).reshape(B, Hv, nc * chunk, Dv)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state


def gdn_chunked(q, k, v, g, beta, state, *, impl=None):
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return gdn_chunked_reference(q, k, v, g, beta, state)
    raise NotImplementedError(f"gdn_chunked: no Pallas kernel yet (mode {mode!r})")


def gdn_verify(q, k, v, g, beta, state, *, impl=None):
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return gdn_verify_reference(q, k, v, g, beta, state)
    raise NotImplementedError(f"gdn_verify: no Pallas kernel yet (mode {mode!r})")


def gdn_replay(k, v, g, beta, state, n, *, impl=None):
    mode = dispatch.resolve(impl)
    if mode == "reference":
        return gdn_replay_reference(k, v, g, beta, state, n)
    raise NotImplementedError(f"gdn_replay: no Pallas kernel yet (mode {mode!r})")
