"""Token sampling and the lossless acceptance rules of speculative decoding.

Sits between the models (which produce logits) and the loop in ``decoding/loop.py``. The same
temperature / top-k / top-p transform turns target logits into p and draft logits into q, so the
acceptance rule sees the distributions the user asked for. Greedy (temperature 0) accepts the
longest prefix of drafts that equal the target's argmax. Sampling accepts draft d with probability
min(1, p(d) / q(d)) and, at the first rejection, draws from the residual max(p - q, 0); with greedy
drafts q is one-hot, so d is accepted with probability p(d) and the residual is p without d. Either
way every emitted token has exactly the target's distribution. Sampled requests draft sampled by default
(``draft_mode="auto"``): on the shipped pair (HumanEval/0..15, block 16) sampled drafts accept more than greedy
ones at T 0.7 and 1 (MODEL_CARD.md, "Sampled decoding"). ``RowSampling`` carries these settings per row (a
server's requests each bring their own) as arrays in the loop's state, the draft mode included: one batch
mixes greedy rows, rows with greedy drafts and rows with sampled drafts.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

DRAFT_MODES = ("greedy", "sampled")  # what a proposal is; "auto" (the default) picks one per temperature
# The smallest sampling temperature: logits / T stays finite in float32 (max 3.4e38) for logits up to 3e8, far
# beyond any model's; below ~3e-39, 1/T alone overflows and every sampled row would end non-finite.
MIN_TEMPERATURE = 1e-30


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` is greedy decoding; top_k 0 and top_p 1 are off.

    ``draft_mode`` (sampling only): "greedy" drafts are the drafter's argmax (q one-hot);
    "sampled" drafts are drawn from q with the same transform as the target; "auto" (the default):
    sampled when temperature > 0 (``sampled_drafts``), the drafter's argmax at temperature 0.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    draft_mode: str = "auto"

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))  # numpy scalars too: equal settings hash alike
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow float32 to inf (NaN probabilities)
            raise ValueError(f"temperature {self.temperature} is too small: logits / temperature overflows float32; "
                             f"use 0 for greedy decoding or a temperature >= {MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.draft_mode not in ("auto",) + DRAFT_MODES:
            raise ValueError(f"draft_mode must be one of {('auto',) + DRAFT_MODES}, got {self.draft_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sampled_drafts(self) -> bool:
        """Whether drafts are drawn from the drafter's q (else its argmax, q one-hot)."""
        return not self.greedy and self.draft_mode != "greedy"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """``SamplingConfig``'s settings per row, as arrays (traced: any mix of rows runs one program)."""

    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] f32, 1 = off
    sampled_drafts: jax.Array  # [B] bool: drafts drawn from q (``SamplingConfig.sampled_drafts``), else the argmax

    @classmethod
    def of(cls, configs) -> RowSampling:
        """The rows of a sequence of ``SamplingConfig``."""
        return cls(temperature=jnp.asarray([c.temperature for c in configs], jnp.float32),
                   top_k=jnp.asarray([c.top_k for c in configs], jnp.int32),
                   top_p=jnp.asarray([c.top_p for c in configs], jnp.float32),
                   sampled_drafts=jnp.asarray([c.sampled_drafts for c in configs], bool))

    def rows(self, x: jax.Array, name: str) -> jax.Array:
        """Setting ``name`` [B] broadcast against x [B, ...]."""
        value = getattr(self, name)
        return value.reshape(value.shape + (1,) * (x.ndim - 1))


def argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (the first NaN's index if there is one, else the first
    peak's), from two plain reductions: XLA's CPU argmax is a serial (value, index) reduction, ~6x
    slower than a max and a min over the vocabulary (31 vs 5 us for [16, 512]).

    One int32 min ranks a NaN at its index, a peak at V + its index, the rest at 2V (peaks found with
    NaNs read as -inf, so a max that drops or keeps NaNs gives the same answer)."""
    V = x.shape[-1]
    nan = jnp.isnan(x)
    peak = jnp.max(jnp.where(nan, -jnp.inf, x), axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    rank = jnp.min(jnp.where(nan, iota, jnp.where(x == peak, V + iota, 2 * V)), axis=-1)
    return jnp.where(rank >= V, rank - V, rank)


def probs(logits: jax.Array, cfg: SamplingConfig | RowSampling) -> jax.Array:
    """Sampling distribution [..., V] (f32) after temperature, top-k and top-p."""
    if isinstance(cfg, RowSampling):
        return _row_probs(logits, cfg)
    x = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        kth = jax.lax.top_k(x, cfg.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if cfg.top_p < 1:
        order = jnp.argsort(-x, axis=-1)
        sorted_p = jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        keep_sorted = jnp.cumsum(sorted_p, axis=-1) - sorted_p < cfg.top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        x = jnp.where(keep, x, -jnp.inf)
    return jax.nn.softmax(x, axis=-1)


def _row_probs(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """``probs`` with per-row settings, logits [B, ..., V]: the cut-offs read from one descending sort
    (greedy rows divide by 1; their choice is the argmax, made elsewhere)."""
    t = rows.rows(logits, "temperature")
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
    desc = -jnp.sort(-x, axis=-1)
    k = rows.rows(logits, "top_k")
    kth = jnp.take_along_axis(desc, jnp.broadcast_to(jnp.maximum(k - 1, 0), x.shape[:-1] + (1,)), axis=-1)
    kth = jnp.where(k > 0, kth, -jnp.inf)
    desc = jnp.where(desc < kth, -jnp.inf, desc)
    sorted_p = jax.nn.softmax(desc, axis=-1)
    top_p = rows.rows(logits, "top_p")
    keep = (jnp.cumsum(sorted_p, axis=-1) - sorted_p < top_p) | (top_p >= 1)  # 1: off, as SamplingConfig's
    floor = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)  # the smallest kept value
    return jax.nn.softmax(jnp.where((x < kth) | (x < floor), -jnp.inf, x), axis=-1)


def _categorical(key, p):
    return jax.random.categorical(key, jnp.log(p), axis=-1)


def choose(logits: jax.Array, keys: jax.Array, cfg: SamplingConfig | RowSampling) -> jax.Array:
    """One token per row from logits [B, V] with per-row keys [B] -> [B] int32."""
    if isinstance(cfg, SamplingConfig) and cfg.greedy:
        return argmax(logits)
    sampled = jax.vmap(_categorical)(keys, probs(logits, cfg)).astype(jnp.int32)
    return jnp.where(cfg.temperature == 0, argmax(logits), sampled) if isinstance(cfg, RowSampling) else sampled


def draft_tokens(logits: jax.Array, keys: jax.Array, cfg: SamplingConfig | RowSampling):
    """Drafts from draft logits [B, k, V] with per-row keys [B]: (tokens [B, k], q [B, k, V] or None when q is
    one-hot). Per-row rules always give q: their sampled-draft rows' q, a one-hot of the argmax in the others
    (computed only when some row samples its drafts)."""
    if isinstance(cfg, RowSampling):
        def sampled():
            tokens, q = _sample_drafts(logits, keys, cfg)
            mine = cfg.rows(tokens, "sampled_drafts")  # [B, 1]
            tokens = jnp.where(mine, tokens, argmax(logits))
            return tokens, jnp.where(mine[..., None], q, jax.nn.one_hot(tokens, logits.shape[-1], dtype=q.dtype))

        def greedy():
            tokens = argmax(logits)
            return tokens, jax.nn.one_hot(tokens, logits.shape[-1], dtype=jnp.float32)

        return jax.lax.cond(jnp.any(cfg.sampled_drafts), sampled, greedy)
    if not cfg.sampled_drafts:
        return argmax(logits), None
    return _sample_drafts(logits, keys, cfg)


def _sample_drafts(logits, keys, cfg):
    """Drafts drawn from q = ``probs(logits, cfg)`` [B, k, V], one key per position split from keys [B]."""
    q = probs(logits, cfg)
    tokens = jax.vmap(lambda key, qb: jax.vmap(_categorical)(jax.random.split(key, qb.shape[0]), qb))(keys, q)
    return tokens.astype(jnp.int32), q


def accept(drafts: jax.Array, draft_probs: jax.Array | None, target_logits: jax.Array, keys: jax.Array,
           cfg: SamplingConfig | RowSampling):
    """Decides how many drafts to keep and the token that follows them.

    Args:
      drafts: [B, k] proposed tokens; draft_probs: [B, k, V] their distribution q, or None (one-hot).
      target_logits: [B, k + 1, V] target logits at [anchor, d_1 .. d_k].
      keys: [B] per-row PRNG keys for this step.
    Returns:
      (a [B] accepted drafts in 0..k, bonus [B]: the token at position a).
    """
    if isinstance(cfg, RowSampling):  # both rules, each row's chosen (q: each row's, one-hot for greedy drafts)
        greedy = _accept_greedy(drafts, target_logits)
        sampled = _accept_sampled(drafts, draft_probs, target_logits, keys, cfg)
        return tuple(jnp.where(cfg.temperature == 0, g, s) for g, s in zip(greedy, sampled, strict=True))
    if cfg.greedy:
        return _accept_greedy(drafts, target_logits)
    return _accept_sampled(drafts, draft_probs, target_logits, keys, cfg)


def _accept_greedy(drafts, target_logits):
    """``accept`` at temperature 0: the longest prefix of drafts equal to the target's argmax."""
    k = drafts.shape[1]
    best = argmax(target_logits)  # [B, k+1]
    a = jnp.sum(jnp.cumprod(drafts == best[:, :k], axis=1), axis=1).astype(jnp.int32)
    return a, jnp.take_along_axis(best, a[:, None], axis=1)[:, 0]


def _accept_sampled(drafts, draft_probs, target_logits, keys, cfg):
    """``accept`` when sampling: draft d kept with probability min(1, p(d) / q(d)), then the residual."""
    k = drafts.shape[1]
    p = probs(target_logits, cfg)  # [B, k+1, V]
    u_keys, r_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(u_keys)  # [B, k]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:  # one-hot q: q(d) = 1, and the row at a is the draft's one-hot (no [B, k, V] q built)
        q_d = jnp.ones_like(p_d)
    else:
        q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    a = jnp.sum(jnp.cumprod(u * q_d < p_d, axis=1), axis=1).astype(jnp.int32)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [B, V]
    at = jnp.minimum(a, k - 1)[:, None]  # q's row a, zero past the last draft (a == k): plain p there
    if draft_probs is None:
        q_a = jax.nn.one_hot(jnp.take_along_axis(drafts, at, axis=1)[:, 0], p.shape[-1], dtype=p.dtype)
    else:
        q_a = jnp.take_along_axis(draft_probs, at[:, :, None], axis=1)[:, 0]
    q_a = jnp.where((a < k)[:, None], q_a, 0.0)
    residual = jnp.maximum(p_a - q_a, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_a)
    return a, jax.vmap(_categorical)(r_keys, residual).astype(jnp.int32)
