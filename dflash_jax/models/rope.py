"""Rotary position embeddings: the frequency schedules of transformers' rope types, and the rotation.

Sits between ``config.py`` (which parses ``rope_parameters`` into a ``RopeScaling``) and the attention
layers (``layers.GatedAttention``, the drafter's attention), which ``rotate`` q and k by the cos/sin rows of
their positions (``rows`` of the cache's ``table``). The frequencies are a function of the static config,
computed once on the host in float32 exactly as transformers' ``ROPE_INIT_FUNCTIONS`` do, and enter the
trace as constants.

Supported ``rope_type``: ``default``, ``linear`` (positions divided by ``factor``), ``yarn`` (NTK-by-parts
interpolation plus an attention scaling of cos/sin) and ``llama3`` (wavelength-banded scaling).
Sequence-length dependent types (``dynamic``, ``longrope``) and ``proportional`` are refused in config.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import RopeScaling


def frequencies(theta: float, rotary_dim: int, s: RopeScaling = RopeScaling()) -> tuple[np.ndarray, float]:
    """(inv_freq [rotary_dim // 2] float32, attention scaling of cos/sin), as transformers computes them."""
    dim = rotary_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(theta) ** exponents  # [dim/2] float32, like torch's base ** tensor
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if s.rope_type == "default":
        return inv_freq, 1.0
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32), 1.0
    if s.rope_type == "llama3":
        return _llama3(inv_freq, s), 1.0
    return _yarn(theta, dim, pos_freqs, inv_freq, s)


def _yarn(theta, dim, pos_freqs, inv_freq, s: RopeScaling) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies by ``factor``, keep high ones, ramp between."""
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    else:
        attention = mscale(s.factor)

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in the context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(s.factor) * pos_freqs)).astype(np.float32)
    out = interpolation * (np.float32(1.0) - extrapolation) + inv_freq * extrapolation
    return out.astype(np.float32), attention


def _llama3(inv_freq, s: RopeScaling) -> np.ndarray:
    """Llama 3.1: wavelengths above the low band divided by factor, below the high band kept, smooth between."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(s.factor), inv_freq).astype(np.float32)
    smooth = ((old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotation(positions: jax.Array, *, theta: float, rotary_dim: int,
             scaling: RopeScaling = RopeScaling()) -> jax.Array:
    """[..., 2, rotary_dim // 2] f32: the cos and sin (times the attention scaling) of the positions' angles."""
    inv_freq, attention = frequencies(theta, rotary_dim, scaling)  # [half]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., half]
    return jnp.stack([jnp.cos(freqs), jnp.sin(freqs)], axis=-2) * attention


def table(capacity: int, *, theta: float, rotary_dim: int, scaling: RopeScaling = RopeScaling()) -> jax.Array:
    """[capacity, 2, rotary_dim // 2] f32: ``rotation`` of every cache position, built once with the cache.

    The caches carry it so that a step gathers its rows (``rows``) instead of evaluating cos and sin:
    XLA fuses those into each consumer and evaluates them per element of q and k (every head, both
    halves), which cost a CPU decode loop more than the rotations themselves.
    """
    return rotation(jnp.arange(capacity), theta=theta, rotary_dim=rotary_dim, scaling=scaling)


def rows(table: jax.Array, start: jax.Array, T: int) -> jax.Array:
    """[B, T, 2, R/2]: the table's rows of positions start[b] + t."""
    return table[start[:, None] + jnp.arange(T)[None, :]]


def rotate(x: jax.Array, rot: jax.Array) -> jax.Array:
    """NeoX ("rotate half") RoPE on the first R channels of each head.

    Args:
      x: [B, T, N, H]; rot: [B, T, 2, R/2] (``rotation`` of the tokens' positions, or ``rows`` of a table).
    """
    half = rot.shape[-1]
    # transformers builds cos/sin in f32 (times the attention scaling) and casts them to x's dtype.
    cos, sin = (rot[:, :, None, i].astype(x.dtype) for i in range(2))  # [B, T, 1, half]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
