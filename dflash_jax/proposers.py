"""Draft proposers behind one interface, so the loop in ``speculative.py`` does not care who drafts.

A proposer is a frozen, hashable description (static under jit) with three pure methods:
``init`` after the target's prefill (it also gets the prompt tokens [B, P]), ``propose`` of k
drafts after the anchor, and ``commit`` of the n tokens the target kept. Its parameters travel
separately as a pytree. ``taps`` names the target layers whose outputs it consumes (the target
returns them from prefill and verify).

- ``NoProposer``: no drafts; the loop becomes plain autoregressive decoding (the baseline).
- ``DFlashProposer``: the block-diffusion drafter, one pass per block, fed by KV injection.
- ``OracleProposer``: replays a known continuation with an error at a chosen offset per step, so
  that every acceptance count occurs (tests, and benchmarks that isolate loop cost from drafter quality).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import drafter as dr
from dflash_jax.sampling import SamplingConfig, draft_tokens
from dflash_jax.target import Qwen35ForCausalLM, TargetOutput


@dataclasses.dataclass(frozen=True)
class NoProposer:
    """Autoregressive decoding: block size 1."""

    taps: tuple[int, ...] = ()
    max_block: int = 1

    def init(self, target, params, prefill: TargetOutput, prompt_lens, capacity, prompts):
        return ()

    def propose(self, target, params, state, anchor, k: int, keys, sampling: SamplingConfig):
        return jnp.zeros((anchor.shape[0], k), jnp.int32), None, state

    def commit(self, target, params, state, verified: TargetOutput, n):
        return state


@dataclasses.dataclass(frozen=True)
class DFlashProposer:
    """The DFlash drafter; its params are the drafter's, its embedding and LM head are the target's."""

    cfg: dr.DrafterConfig
    graphdef: nnx.GraphDef

    @property
    def taps(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @property
    def max_block(self) -> int:
        return self.cfg.block_size

    def init(self, target: Qwen35ForCausalLM, params, prefill: TargetOutput, prompt_lens, capacity, prompts):
        model = nnx.merge(self.graphdef, params)
        cache = dr.init_draft_cache(self.cfg, prompt_lens.shape[0], capacity, prefill.taps.dtype)
        return dr.advance(dr.write_context(model, cache, prefill.taps), prompt_lens)

    def propose(self, target: Qwen35ForCausalLM, params, cache, anchor, k: int, keys, sampling):
        model = nnx.merge(self.graphdef, params)
        block = jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], k), self.cfg.mask_token_id,
                                                           jnp.int32)], axis=1)  # [B, k+1]
        hidden, cache = dr.draft_block(model, cache, target.model.embed_tokens(block))
        drafts, q = draft_tokens(target.logits(hidden[:, 1:]), keys, sampling)
        return drafts, q, cache

    def commit(self, target, params, cache, verified: TargetOutput, n):
        model = nnx.merge(self.graphdef, params)
        return dr.advance(dr.write_context(model, cache, verified.taps), n)


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

    def init(self, target, params: OracleParams, prefill, prompt_lens, capacity, prompts):
        B = prompt_lens.shape[0]
        return jnp.zeros((B,), jnp.int32), jnp.zeros((), jnp.int32)  # anchor index, step

    def propose(self, target, params: OracleParams, state, anchor, k: int, keys, sampling):
        pos, step = state
        B, L = params.continuation.shape
        idx = jnp.minimum(pos[:, None] + 1 + jnp.arange(k)[None, :], L - 1)
        drafts = jnp.take_along_axis(params.continuation, idx, axis=1)
        offset = params.errors[(step + jnp.arange(B)) % params.errors.shape[0]]
        wrong = jnp.arange(k)[None, :] == offset[:, None]
        return jnp.where(wrong, (drafts + 1) % self.vocab_size, drafts).astype(jnp.int32), None, state

    def commit(self, target, params, state, verified, n):
        pos, step = state
        return pos + n, step + 1
