"""DFlash2's two additions to the DFlash drafter: grouped dynamic causal convolutions and the candidate selector.

Used by ``drafter.py`` (the convolutions sit in each ``DrafterLayer``, the selector in the ``DFlashDrafter``
tree, so z-lab's ``DFlash2DraftModel`` checkpoint keys load one for one) and by ``proposers.py`` (the
selector's walk chooses the drafts). Facts from z-lab's ``dflash`` 0.1.0 (``dflash/model.py``):

- ``GroupedDynamicCausalConv`` (per layer, ``attention_conv`` and ``mlp_conv``): a base kernel
  ``base_kernel`` [2, K, D] plus a per-token kernel ``kernel_projection(h)`` -> [T, 2, K, G], one value per
  group of ``conv_group_size`` channels (G = D / group). ``prepare(h)`` convolves the normed input with
  kernel 0 and keeps kernel 1 (computed from the same input) for ``finish(y)``, which convolves the
  sub-layer's output: out[t, c] = sum_o (base[o, c] + dyn[t, o, g(c)]) * x[t - o, c], over the block
  only (taps before the block's first position read zeros).
- ``CandidateSelector``: the drafter's top-k tokens per position (from its logits, after
  ``output_multiplier`` / softcap), rescored as score = logit + <A[predecessor] * P h, B[candidate]>
  (codebooks A, B [V, r], P [r, D]) and walked from the anchor: each position's choice is the next
  position's predecessor. Greedy takes the argmax of the score; sampling draws from softmax(score / T)
  over the candidates and returns those probabilities, which acceptance reads scattered onto the vocabulary.
  A draft tree (``decoding/tree.py``) branches on the same conditionals (``children``): each node's
  candidates scored given the node's own token.

Neither has a kernel: in a kernel mode other than "reference" (a Pallas or TPU mode, which the drafter's
attention uses) both run this XLA form, and the log says so once per process (``_reference_fallback``, as the
draft tree's attention does in ``dflash_jax/kernels/attention.py``).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import parallel
from dflash_jax.config import DrafterConfig
from dflash_jax.models.layers import Embedding, Linear


@functools.cache
def _reference_fallback() -> None:
    """Says once per process why DFlash2's convolutions and selector run XLA ops in a kernel mode."""
    logging.getLogger(__name__).warning("DFlash2: the grouped dynamic convolutions and the candidate selector have "
                                        "no kernel; they run their XLA reference form in every kernel mode")


def _in_mode(kernels: str) -> None:
    """Called as the ops are traced: the log line above, once, when a kernel mode was asked for."""
    if kernels != "reference":
        _reference_fallback()


def causal_conv(x: jax.Array, dynamic: jax.Array, base: jax.Array, group_size: int) -> jax.Array:
    """The grouped dynamic causal convolution over the block axis.

    Args:
      x: [B, T, D] inputs at the block's positions 0..T-1.
      dynamic: [B, T, K, G] per-token kernels, one per group of ``group_size`` channels (G = D / group_size).
      base: [K, D] the static kernel.
    Returns:
      [B, T, D]: out[t, c] = sum_{o < K} (base[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c], reading
      zeros before position 0. Left-padding by K - 1 rows makes it exact for any T, also T < K.
    """
    B, T, D = x.shape
    K = base.shape[0]
    padded = jnp.pad(x, ((0, 0), (K - 1, 0), (0, 0)))  # [B, K-1+T, D]; row K-1+t holds x[t]
    dyn = jnp.repeat(dynamic.astype(x.dtype), group_size, axis=-1)  # [B, T, K, D]
    out = jnp.zeros_like(x)
    for o in range(K):
        shifted = padded[:, K - 1 - o:K - 1 - o + T]  # x[t - o]
        out = out + (base[o].astype(x.dtype) + dyn[:, :, o]) * shifted
    return out


class GroupedDynamicCausalConv(nnx.Module):
    """z-lab's ``GroupedDynamicCausalConv``: ``base_kernel`` [2, K, D] and ``kernel_projection`` D -> 2*K*G.

    Initialised as the identity (base tap 0 = 1, the other taps 0, a small random projection), so a fresh
    DFlash2 drafter starts as its DFlash counterpart.
    """

    def __init__(self, cfg: DrafterConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        D, K = cfg.hidden_size, cfg.conv_kernel_size
        self.kernel_size, self.group_size, self.kernels = K, cfg.conv_group_size, kernels
        self.groups = D // cfg.conv_group_size
        self.base_kernel = parallel.param(jnp.zeros((2, K, D), dtype).at[:, 0].set(1))
        self.kernel_projection = Linear(D, 2 * K * self.groups, dtype=dtype, kernels=kernels, rngs=rngs)

    def prepare(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D] (the normed sub-layer input) -> (its convolution with kernel 0 [B, T, D], kernel 1's
        dynamic part [B, T, K, G] for ``finish``)."""
        _in_mode(self.kernels)
        B, T, _ = h.shape
        dynamic = self.kernel_projection(h).reshape(B, T, 2, self.kernel_size, self.groups)
        base = self.base_kernel.get_value()
        return causal_conv(h, dynamic[:, :, 0], base[0], self.group_size), dynamic[:, :, 1]

    def finish(self, y: jax.Array, dynamic: jax.Array) -> jax.Array:
        """The sub-layer's output y [B, T, D] convolved with kernel 1 (``prepare``'s dynamic part)."""
        return causal_conv(y, dynamic, self.base_kernel.get_value()[1], self.group_size)


class CandidateSelector(nnx.Module):
    """z-lab's ``CandidateSelector``: ``predecessor_codebook`` / ``successor_codebook`` [V, r] (an
    ``nn.Embedding`` each: keys with ``.weight``; ``drafter.load_drafter`` also reads z-lab's released
    layout without it) and ``hidden_projection`` [r, D]."""

    def __init__(self, cfg: DrafterConfig, *, dtype, kernels: str, rngs: nnx.Rngs):
        V, r = cfg.vocab_size, cfg.selector_rank
        self.top_k, self.kernels = cfg.selector_top_k, kernels
        self.predecessor_codebook = Embedding(V, r, dtype=dtype, rngs=rngs)
        self.successor_codebook = Embedding(V, r, dtype=dtype, rngs=rngs)
        self.hidden_projection = Linear(cfg.hidden_size, r, dtype=dtype, kernels=kernels, rngs=rngs)

    def candidates(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Draft logits [B, T, V] -> (their top-k values [B, T, k] f32, the candidate tokens [B, T, k] int32)."""
        unary, cand = jax.lax.top_k(logits.astype(jnp.float32), self.top_k)
        return unary, cand.astype(jnp.int32)

    def pair_term(self, hidden: jax.Array, predecessors: jax.Array, successors: jax.Array) -> jax.Array:
        """<A[pred] * P h, B[succ]>: hidden [B, T, D], predecessors [B, T], successors [B, T, n] -> [B, T, n] f32."""
        left = self.predecessor_codebook(predecessors) * self.hidden_projection(hidden)  # [B, T, r]
        right = self.successor_codebook(successors)  # [B, T, n, r]
        return jnp.einsum("btr,btnr->btn", left.astype(jnp.float32), right.astype(jnp.float32))

    def full_scores(self, hidden: jax.Array, logits: jax.Array, predecessors: jax.Array) -> jax.Array:
        """The score of every token (training, teacher-forced predecessors [B, ..., T]): logits [B, ..., T, V]
        f32 + (A[pred] * P h) B^T. hidden [B, ..., T, D] -> [B, ..., T, V] f32."""
        _in_mode(self.kernels)
        left = self.predecessor_codebook(predecessors) * self.hidden_projection(hidden)  # [..., r]
        table = self.successor_codebook.weight.get_value()  # [V, r]
        return logits.astype(jnp.float32) + jnp.einsum("...r,vr->...v", left.astype(jnp.float32),
                                                       table.astype(jnp.float32))

    def scorer(self, hidden: jax.Array, logits: jax.Array):
        """The selector's scores of a block's candidates given their predecessors.

        Args:
          hidden: [B, k, D] the drafter's final-normed states at the draft positions.
          logits: [B, k, V] their draft logits (``drafter.draft_logits``).
        Returns:
          (score(t, predecessors [B, W]) -> [B, W, top_k] f32: position t's candidates scored after each of W
          predecessor tokens (t may be traced), candidates [B, k, top_k] int32).
        """
        _in_mode(self.kernels)
        unary, cand = self.candidates(logits)
        left = self.hidden_projection(hidden).astype(jnp.float32)  # [B, k, r]
        right = self.successor_codebook(cand).astype(jnp.float32)  # [B, k, top_k, r]
        codebook = self.predecessor_codebook.weight.get_value()

        def score(t, predecessors):
            a = jnp.take(codebook, predecessors, axis=0).astype(jnp.float32)  # [B, W, r]
            return unary[:, t, None] + jnp.einsum("bwr,br,bnr->bwn", a, left[:, t], right[:, t])

        return score, cand

    def walk(self, hidden: jax.Array, logits: jax.Array, anchor: jax.Array, keys: jax.Array | None,
             temperature: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """The selector's walk over a block's draft positions, from the anchor, on device.

        Args:
          hidden: [B, k, D] the drafter's final-normed states at the draft positions.
          logits: [B, k, V] their draft logits (``drafter.draft_logits``).
          anchor: [B] the block's first token (the first predecessor).
          keys: [B] per-row PRNG keys (sampling), None for greedy.
          temperature: 0: greedy (argmax of the score); > 0: a sample of softmax(score / temperature); or [B]
            per row (with keys), a row at 0 taking the argmax with q one-hot over its candidates.
        Returns:
          (drafts [B, k] int32, candidates [B, k, top_k] int32, the sampling probabilities over the
          candidates [B, k, top_k] f32 or None when greedy).
        """
        scorer, cand = self.scorer(hidden, logits)
        k = hidden.shape[1]
        step_keys = None if keys is None else jax.vmap(lambda key: jax.random.split(key, k))(keys)  # [B, k]

        def step(pred, t):  # pred [B] -> (choice [B], (choice, q [B, top_k]))
            score = scorer(t, pred[:, None])[:, 0]  # [B, top_k]
            if step_keys is None:
                index, q = jnp.argmax(score, axis=-1), jnp.zeros_like(score)
            elif jnp.ndim(temperature):  # per row [B]
                temp = temperature[:, None]
                logq = jax.nn.log_softmax(score / jnp.where(temp > 0, temp, 1.0), axis=-1)
                index = jnp.where(temperature > 0, jax.vmap(jax.random.categorical)(step_keys[:, t], logq),
                                  jnp.argmax(score, axis=-1))
                q = jnp.where(temp > 0, jnp.exp(logq), jax.nn.one_hot(index, score.shape[-1], dtype=score.dtype))
            else:
                logq = jax.nn.log_softmax(score / temperature, axis=-1)
                index, q = jax.vmap(jax.random.categorical)(step_keys[:, t], logq), jnp.exp(logq)
            choice = jnp.take_along_axis(cand[:, t], index[:, None], axis=1)[:, 0]
            return choice, (choice, q)

        _, (drafts, q) = jax.lax.scan(step, anchor.astype(jnp.int32), jnp.arange(k))
        q = None if step_keys is None else jnp.moveaxis(q, 0, 1)
        return jnp.moveaxis(drafts, 0, 1), cand, q

    def children(self, hidden: jax.Array, logits: jax.Array):
        """The selector's conditionals as a draft tree's ``decoding.tree.Children``: after a node at depth t with
        token x, position t's candidates with log-probabilities log softmax(score(x)) (the distribution the walk
        samples from at temperature 1). hidden [B, k, D], logits [B, k, V]."""
        scorer, cand = self.scorer(hidden, logits)

        def children(t, tokens):  # tokens [B, W] -> ([B, W, top_k], [B, W, top_k])
            lq = jax.nn.log_softmax(scorer(t, tokens), axis=-1)
            return lq, jnp.broadcast_to(cand[:, t, None], lq.shape)

        return children


def scatter_probs(q: jax.Array, candidates: jax.Array, vocab: int) -> jax.Array:
    """Probabilities over the candidates q [B, k, n] onto the vocabulary [B, k, V] (zero elsewhere); the
    candidates of a position are distinct tokens (a top-k), so each holds its own probability."""
    B, k, n = q.shape
    rows = jnp.zeros((B, k, vocab), q.dtype)
    return rows.at[jnp.arange(B)[:, None, None], jnp.arange(k)[None, :, None], candidates].set(q)
