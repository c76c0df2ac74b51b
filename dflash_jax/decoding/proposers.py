"""Draft proposers behind one typed interface, so the loop in ``speculative.py`` does not care who drafts.

A proposer is a frozen, hashable description (static under jit) implementing ``Proposer``: pure,
keyword-only methods, ``init`` after the target's prefill, ``propose`` of k drafts after the anchor
and ``commit`` of the n tokens the target kept; ``start`` and ``extend`` follow a prompt prefilled in
chunks, or resumed from a stored prefix (``loop.Prefix``), instead of ``init``. Its parameters travel
separately as a pytree (``params``), like the target's. What a proposer may use of the target is a ``TargetView``: the
embedding and the LM head, nothing else; ``taps`` names the target layers whose outputs it consumes
(the target returns them from prefill and verify, in ``TargetOutput.taps``).

- ``NoProposer``: no drafts; the loop becomes plain autoregressive decoding (the baseline).
- ``DFlashProposer``: the block-diffusion drafter, one pass per block, fed by KV injection; a DFlash2
  drafter's candidate selector then walks the block to choose the drafts.
- ``OracleProposer``: replays a known continuation with an error at a chosen offset per step, so
  that every acceptance count occurs (tests, and benchmarks that isolate loop cost from drafter quality).
- ``MTPProposer`` (in ``mtp.py``): Qwen3.5's own multi-token-prediction head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.config import DrafterConfig
from dflash_jax.decoding import tree as draft_tree
from dflash_jax.decoding.sampling import RowSampling, SamplingConfig, draft_tokens
from dflash_jax.models import dflash2
from dflash_jax.models import drafter as dr
from dflash_jax.models.target import TargetOutput, lm_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetView:
    """The part of the target a proposer reads: its token embedding and LM head (arrays, no module).

    Built by the loop from the target's params (``TargetView.of``), without merging the target module.
    """

    embedding: jax.Array  # [V, D]
    lm_head: jax.Array | None  # [V, D]; None: tied to the embedding

    @classmethod
    def of(cls, params) -> TargetView:
        """The view of a target's params (the ``nnx.State`` of a ``Qwen35ForCausalLM``)."""
        head = params["lm_head"]["weight"].get_value() if "lm_head" in params else None
        return cls(embedding=params["model"]["embed_tokens"]["weight"].get_value(), lm_head=head)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token ids [...] -> embeddings [..., D]."""
        return jnp.take(self.embedding, tokens, axis=0)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., D] -> logits [..., V]: the target's own head (``target.lm_logits``)."""
        return lm_logits(h, self.embedding, self.lm_head)


@runtime_checkable
class Proposer(Protocol):
    """What the loop calls. Shapes: B rows, k drafts, V vocab; ``state`` is the proposer's own pytree.

    - ``init(params, view, prefill, prompts [B, P], prompt_lens [B], capacity S) -> state``, after the
      target's prefill (``prefill``: its ``TargetOutput``).
    - ``propose(params, view, state, anchor [B], k, keys [B], sampling) -> (drafts [B, k], q, state)``:
      q [B, k, V] is the drafts' distribution, or None when the drafts are the argmax (q one-hot);
      ``sampling`` a ``SamplingConfig`` or per-row ``RowSampling`` (each row drafts as its
      ``sampled_drafts`` says; q then per row, one-hot for argmax rows).
    - ``commit(params, view, state, verified, n [B]) -> state``: the target kept the first n of
      ``[anchor, d_1 .. d_k]`` (``verified``: the verify's ``TargetOutput``).
    - ``start(params, view, batch, capacity) -> state``: the state of no tokens yet, which ``extend`` continues.
    - ``extend(params, view, state, chunk, tokens [B, T], n [B]) -> state``: the target prefilled the next
      n[b] >= 1 prompt tokens ``tokens[b, :n[b]]`` (``chunk``: its ``target.extend`` output). ``start`` then
      ``extend`` over a prompt's chunks gives ``init``'s state of the whole prompt.
    """

    taps: tuple[int, ...]  # target layers whose outputs the proposer consumes
    max_block: int  # the largest block (anchor + drafts) it can draft

    def init(self, *, params, view: TargetView, prefill: TargetOutput, prompts: jax.Array,
             prompt_lens: jax.Array, capacity: int) -> Any: ...

    def propose(self, *, params, view: TargetView, state, anchor: jax.Array, k: int, keys: jax.Array,
                sampling: SamplingConfig | RowSampling) -> tuple[jax.Array, jax.Array | None, Any]: ...

    def commit(self, *, params, view: TargetView, state, verified: TargetOutput, n: jax.Array) -> Any: ...

    def start(self, *, params, view: TargetView, batch: int, capacity: int) -> Any: ...

    def extend(self, *, params, view: TargetView, state, chunk: TargetOutput, tokens: jax.Array,
               n: jax.Array) -> Any: ...


@dataclasses.dataclass(frozen=True)
class NoProposer:
    """Autoregressive decoding: block size 1."""

    taps: tuple[int, ...] = ()
    max_block: int = 1

    def init(self, *, params, view, prefill, prompts, prompt_lens, capacity):
        return ()

    def propose(self, *, params, view, state, anchor, k, keys, sampling):
        return jnp.zeros((anchor.shape[0], k), jnp.int32), None, state

    def commit(self, *, params, view, state, verified, n):
        return state

    def start(self, *, params, view, batch, capacity):
        return ()

    def extend(self, *, params, view, state, chunk, tokens, n):
        return state


@dataclasses.dataclass(frozen=True)
class DFlashProposer:
    """The DFlash drafter; its params are the drafter's, its embedding and LM head are the target's.

    A DFlash2 drafter (``cfg.dflash2``) chooses its drafts with the candidate selector's walk: greedy
    (temperature 0, or ``draft_mode="greedy"``) its argmax path, q one-hot (None); sampled drafts a
    sample of softmax(score / T) over the candidates at each position, q those probabilities scattered
    onto the vocabulary [B, k, V] for the acceptance rule. Per-row rules walk every row at once, each at
    its own temperature (0: the argmax path, q one-hot).
    """

    cfg: DrafterConfig
    graphdef: nnx.GraphDef

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @property
    def max_block(self) -> int:
        return self.cfg.block_size

    def init(self, *, params, view, prefill: TargetOutput, prompts, prompt_lens, capacity):
        state = self.start(params=params, view=view, batch=prompt_lens.shape[0], capacity=capacity)
        return self.extend(params=params, view=view, state=state, chunk=prefill, tokens=prompts, n=prompt_lens)

    def _block(self, model, view: TargetView, state, anchor, k):
        """One block pass after the anchor: (final-normed states [B, k, D] and draft logits [B, k, V] at the k
        draft positions, the state after proposing)."""
        block = jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], k), self.cfg.mask_token_id,
                                                           jnp.int32)], axis=1)  # [B, k+1]
        hidden, cache = dr.draft_block(model, state, view.embed(block))
        return hidden[:, 1:], dr.draft_logits(self.cfg, view.logits(hidden[:, 1:])), cache

    def propose(self, *, params, view: TargetView, state, anchor, k, keys, sampling):
        model = nnx.merge(self.graphdef, params)
        hidden, logits, cache = self._block(model, view, state, anchor, k)
        if not self.cfg.dflash2:
            drafts, q = draft_tokens(logits, keys, sampling)
            return drafts, q, cache
        selector = model.candidate_selector
        if isinstance(sampling, RowSampling):  # each row's walk: sampled at its temperature, else the argmax
            temperature = jnp.where(sampling.sampled_drafts, sampling.temperature, 0.0)  # [B]
            drafts, cand, q = selector.walk(hidden, logits, anchor, keys, temperature)
        else:
            greedy = not sampling.sampled_drafts
            drafts, cand, q = selector.walk(hidden, logits, anchor, None if greedy else keys,
                                            sampling.temperature)
        return drafts, None if q is None else dflash2.scatter_probs(q, cand, logits.shape[-1]), cache

    def commit(self, *, params, view, state, verified: TargetOutput, n):
        model = nnx.merge(self.graphdef, params)
        return dr.advance(dr.write_context(model, state, verified.taps), n)

    def start(self, *, params, view: TargetView, batch, capacity):
        return dr.init_draft_cache(self.cfg, batch, capacity, view.embedding.dtype)

    def extend(self, *, params, view, state, chunk: TargetOutput, tokens, n):
        """The chunk's injected context K/V, as ``init`` writes the prompt's."""
        return self.commit(params=params, view=view, state=state, verified=chunk, n=n)

    def tree(self, *, params, view: TargetView, state, anchor, depth, budget):
        """A draft tree of ``budget`` nodes of depth <= ``depth`` after the anchor, from one block pass:
        (``decoding.tree.DraftTree``, the state after proposing). A DFlash drafter's tree holds the likeliest
        paths of its per-position marginals (``tree.build``), a DFlash2 drafter's those of its candidate
        selector's conditionals (``CandidateSelector.children``): each node's children are the next position's
        candidates scored given the node's token. The same tree under every sampling setting (``decoding.tree``)."""
        model = nnx.merge(self.graphdef, params)
        hidden, logits, cache = self._block(model, view, state, anchor, depth)
        if self.cfg.dflash2:
            return draft_tree.grow(anchor, model.candidate_selector.children(hidden, logits), depth, budget), cache
        return draft_tree.build(anchor, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), budget), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OracleParams:
    continuation: jax.Array  # [B, L] the tokens plain decoding emits (first generated token at 0)
    errors: jax.Array  # [E] int32 draft offset corrupted at step t (row b uses errors[(t + b) % E])


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    """Drafts the known continuation, corrupting offset errors[...] of each block (offset >= k: none).

    With errors cycling through 0..k every acceptance count 0..k occurs; a wrong commit or acceptance
    rule then shows up as output that differs from plain decoding.
    """

    vocab_size: int
    taps: tuple[int, ...] = ()
    max_block: int = 1 << 30

    def init(self, *, params: OracleParams, view, prefill, prompts, prompt_lens, capacity):
        return self.start(params=params, view=view, batch=prompt_lens.shape[0], capacity=capacity)

    def propose(self, *, params: OracleParams, view, state, anchor, k, keys, sampling):
        pos, step = state
        B, L = params.continuation.shape
        idx = jnp.minimum(pos[:, None] + 1 + jnp.arange(k)[None, :], L - 1)
        drafts = jnp.take_along_axis(params.continuation, idx, axis=1)
        offset = params.errors[(step + jnp.arange(B)) % params.errors.shape[0]]
        wrong = jnp.arange(k)[None, :] == offset[:, None]
        return jnp.where(wrong, (drafts + 1) % self.vocab_size, drafts).astype(jnp.int32), None, state

    def commit(self, *, params, view, state, verified, n):
        pos, step = state
        return pos + n, step + 1

    def start(self, *, params: OracleParams, view, batch, capacity):
        return jnp.zeros((batch,), jnp.int32), jnp.zeros((), jnp.int32)  # anchor index, step; a prompt moves neither

    def extend(self, *, params, view, state, chunk, tokens, n):
        return state
