"""Qwen3.5's own multi-token-prediction head (``mtp.*``) as a proposer: the baseline DFlash is measured against.

Sits beside ``proposers.py`` behind the same interface, on top of the ``MTP`` module of ``target.py``:
its params are the target's ``mtp`` subtree (``target.params["mtp"]``), its embedding and LM head
the target's (the ``TargetView``). The head is one full-attention decoder layer with its own
KV cache: the entry at position t reads (token x_{t+1}, the target's final-normed hidden h_t) and
predicts x_{t+2}. Drafting is autoregressive, as in vLLM (``qwen3_5_mtp.py``, ``llm_base_proposer.py``):
one wide pass writes the entries the last verify made known and drafts d_1, then each deeper draft is
one narrow pass that feeds back the head's own post-norm output with the previous draft, one position
further. Its cost therefore grows linearly with the number of drafts, where DFlash drafts a block in
one pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import parallel
from dflash_jax.config import TargetConfig
from dflash_jax.decoding.proposers import TargetView
from dflash_jax.decoding.sampling import SamplingConfig, draft_tokens
from dflash_jax.kernels import dispatch as kernel_modes
from dflash_jax.kernels.attention import empty_cache
from dflash_jax.models import rope
from dflash_jax.models.cache import AttentionCache, position_table
from dflash_jax.models.target import MTP, Target, TargetOutput


def mtp_step(mtp: MTP, view: TargetView, tokens, hidden, k_cache, v_cache, start, table):
    """Runs the MTP head on T entries at positions start[b] + t, writing their K/V first.

    Teacher-forced training uses it directly: tokens = x_{t+1}, hidden = h_t (``TargetOutput.hidden``),
    and ``view.logits(out)`` at t is trained to predict x_{t+2}.

    Args:
      mtp: the target's ``MTP`` head; view: the target's embedding and LM head.
      tokens: [B, T] int32, the token after each hidden state's position.
      hidden: [B, T, D] target final-normed hidden states (or the head's own output, when drafting).
      k_cache, v_cache: the head's cache ([B, K, S, H] / [B, K, H, S]: ``kernels.cache_shapes``); start: [B]
        int32 entries already cached; table: [S, 2, R/2] the cos/sin of every position (``rope.table``).
    Returns:
      (out [B, T, D] after ``mtp.norm``, k_cache, v_cache) with rows [start, start + T) written.
    """
    e = mtp.pre_fc_norm_embedding(view.embed(tokens))
    h = mtp.pre_fc_norm_hidden(hidden.astype(e.dtype))
    x = mtp.fc(jnp.concatenate([e, h], axis=-1))  # [B, T, D]; the order [embedding, hidden] is the checkpoint's
    x, kv = mtp.layers[0].attend(x, AttentionCache(k_cache, v_cache), start, rope.rows(table, start, x.shape[1]))
    # On a mesh the cache keeps the target's KV-head layout inside propose's scan too (parallel.py).
    kv = parallel.constrain_cache(kv, mtp.layers[0].self_attn.cfg)
    return mtp.norm(x), kv.k, kv.v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    """The head's cache and the verified entries still waiting for their token.

    An entry needs the token after its position; for the last verified position that token is the
    bonus, which the loop only hands over as the next anchor. So commit parks the verified hidden
    states (``hidden``, ``count`` of them) and the drafts they pair with (``tokens``), and the next
    propose writes them with the anchor in place of the token at ``count - 1``.
    """

    k: jax.Array  # [B, K, S, H]
    v: jax.Array  # [B, K, H, S] (``kernels.cache_shapes``)
    rope: jax.Array  # [S, 2, R/2] f32 cos/sin of every position (``rope.table``)
    length: jax.Array  # [B] int32 entries written (positions 0 .. length - 1)
    tokens: jax.Array  # [B, W] int32: pending entry j pairs with tokens[j] (the drafts of the last propose)
    hidden: jax.Array  # [B, W, D] pending target hidden states at positions length .. length + count - 1
    count: jax.Array  # [B] int32 pending entries (1 after prefill, n after a commit)


@dataclasses.dataclass(frozen=True)
class MTPProposer:
    """Drafts with the target's MTP head; ``num_steps`` (vLLM's num_speculative_tokens) is k at most.

    Its params are the head's weights, the target's ``mtp`` subtree: pass
    ``(MTPProposer.of(target, k), mtp_params(target))`` where a drafter goes (``mtp_params`` says why
    a target has none). ``of`` takes the head's graph from the target, so its kernel mode (``with_kernels``)
    and layout follow the target's; built from a bare cfg the head runs in ``kernels`` (None: the default
    mode). ``init`` needs the prompt tokens, which the entries pair with.
    """

    cfg: TargetConfig
    num_steps: int
    taps: tuple[int, ...] = ()
    kernels: str | None = None  # the head's attention kernel mode when graphdef is not given
    # The head's graph (hashable: equal heads give equal proposers); None: built from cfg and kernels.
    graphdef: nnx.GraphDef | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        if self.cfg.mtp_num_hidden_layers != 1:
            raise ValueError(f"MTPProposer needs a target with one MTP layer (Qwen3.5), got "
                             f"mtp_num_hidden_layers={self.cfg.mtp_num_hidden_layers}")
        if not 1 <= self.num_steps <= 15:
            raise ValueError(f"num_steps must be in 1..15, got {self.num_steps}")
        object.__setattr__(self, "kernels", kernel_modes.resolve(self.kernels))
        if self.graphdef is None:
            head = nnx.eval_shape(lambda: MTP(self.cfg, dtype=jnp.float32, kernels=self.kernels, rngs=nnx.Rngs(0)))
            object.__setattr__(self, "graphdef", nnx.graphdef(head))

    @classmethod
    def of(cls, target: Target, num_steps: int, taps: tuple[int, ...] = ()) -> MTPProposer:
        """The proposer of a target's own MTP head: its graph (kernel mode, dtype, quantized layout) is the target's."""
        mtp_params(target)  # a clear error when the target has no head
        return cls(target.cfg, num_steps, taps, kernels=target.kernels,
                   graphdef=nnx.graphdef(target.module().mtp))

    @property
    def max_block(self) -> int:
        return self.num_steps + 1

    def head(self, params) -> MTP:
        """The head module from its params (the target's ``mtp`` subtree)."""
        if not isinstance(params, nnx.State) or "fc" not in params:
            raise ValueError("MTPProposer's params are the target's MTP head: pass mtp_params(target) "
                             f"(target.params['mtp']), got {type(params).__name__}")
        return nnx.merge(self.graphdef, params)

    def init(self, *, params, view: TargetView, prefill: TargetOutput, prompts, prompt_lens, capacity):
        """Writes the prompt's entries 0 .. P-2 and parks h_{P-1}, which waits for the first token.

        Args:
          prefill: the target's prefill output (``hidden`` [B, P, D]); prompt_lens: [B];
          capacity: cache length S (the target's); prompts: [B, P] int32, right-padded.
        """
        state = self.start(params=params, view=view, batch=prompt_lens.shape[0], capacity=capacity)
        return self.extend(params=params, view=view, state=state, chunk=prefill, tokens=prompts, n=prompt_lens)

    def start(self, *, params, view: TargetView, batch: int, capacity: int) -> MTPState:
        """No entries and nothing parked (count 0): the first ``extend`` writes as ``init`` does."""
        cfg, W, dtype = self.cfg, self.max_block, view.embedding.dtype
        kc, vc = empty_cache(batch, capacity, cfg.num_key_value_heads, cfg.head_dim, dtype)
        return MTPState(k=kc, v=vc, rope=position_table(cfg, capacity), length=jnp.zeros((batch,), jnp.int32),
                        tokens=jnp.zeros((batch, W), jnp.int32), hidden=jnp.zeros((batch, W, cfg.hidden_size), dtype),
                        count=jnp.zeros((batch,), jnp.int32))

    def extend(self, *, params, view: TargetView, state: MTPState, chunk: TargetOutput, tokens, n):
        """Writes the entries the chunk's tokens complete and parks its last hidden state (count 1).

        Entry t pairs h_t with x_{t+1}: after a parked h_{L-1} (count 1, ``length`` L - 1) the chunk's
        x_L .. x_{L+n-1} complete h_{L-1} .. h_{L+n-2}; from nothing (count 0) its x_1 .. x_{n-1} complete
        h_0 .. h_{n-2}. Entries past them are dead and get overwritten.

        Args:
          chunk: the target's ``extend`` (or ``prefill``) output (``hidden`` [B, T, D]); tokens: [B, T] int32,
            right-padded, real up to n [B] (>= 1). ``state``: from ``start`` or ``extend`` (count 0 or 1).
        """
        mtp = self.head(params)
        fresh = (state.count == 0)[:, None]  # [B, 1]
        tokens = jnp.asarray(tokens, jnp.int32)
        written = jnp.where(fresh, jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))), tokens)  # [B, T]
        hidden = chunk.hidden.astype(state.hidden.dtype)
        after = jnp.concatenate([state.hidden[:, :1], hidden[:, :-1]], axis=1)  # [B, T, D]: the parked one first
        _, k, v = mtp_step(mtp, view, written, jnp.where(fresh[..., None], hidden, after), state.k, state.v,
                           state.length, state.rope)
        last = jnp.take_along_axis(hidden, (n - 1)[:, None, None], axis=1)  # [B, 1, D]
        W = state.hidden.shape[1]
        return dataclasses.replace(state, k=k, v=v, length=(state.length + state.count + n - 1).astype(jnp.int32),
                                   hidden=jnp.pad(last, ((0, 0), (0, W - 1), (0, 0))),
                                   count=jnp.ones_like(state.count))

    def propose(self, *, params, view: TargetView, state: MTPState, anchor, k: int, keys,
                sampling: SamplingConfig):
        """One wide pass over the pending entries (width k + 1, the block size), then k - 1 narrow ones.

        Returns (drafts [B, k], q [B, k, V] or None, state); ``keys`` [B] seed the sampled drafts.
        """
        mtp, B = self.head(params), anchor.shape[0]
        j = jnp.arange(k + 1)[None, :]
        last = state.count - 1  # [B] the newest pending entry: its token is the anchor
        tokens = jnp.where(j == last[:, None], anchor[:, None], state.tokens[:, :k + 1])
        out, kc, vc = mtp_step(mtp, view, tokens, state.hidden[:, :k + 1], state.k, state.v, state.length,
                               state.rope)
        length = state.length + state.count
        # Rows with count 0 (finished) index entry 0: their drafts are ignored by the loop.
        h = jnp.take_along_axis(out, jnp.maximum(last, 0)[:, None, None], axis=1)  # [B, 1, D]
        step_keys = jax.vmap(lambda key: jax.random.split(key, max(k, 1)))(keys)  # [B, k]

        def draft(h, key):
            d, q = draft_tokens(view.logits(h), key, sampling)
            return d[:, 0], q

        def deeper(carry, key):
            # The head's post-norm output stands in for the target's hidden one position further on.
            kc, vc, h, d, pos = carry
            h, kc, vc = mtp_step(mtp, view, d[:, None], h, kc, vc, pos, state.rope)
            d_next, q = draft(h, key)
            return (kc, vc, h, d_next, pos + 1), (d_next, q)

        d1, q1 = draft(h, step_keys[:, 0])
        (kc, vc, *_), (ds, qs) = jax.lax.scan(deeper, (kc, vc, h, d1, length),
                                              jnp.moveaxis(step_keys[:, 1:k], 1, 0))
        drafts = jnp.concatenate([d1[:, None], jnp.moveaxis(ds, 0, 1)], axis=1)[:, :k]  # [B, k]
        q = None if q1 is None else jnp.concatenate([q1, jnp.moveaxis(qs[:, :, 0], 0, 1)], axis=1)[:, :k]
        W = state.tokens.shape[1]
        new = dataclasses.replace(state, k=kc, v=vc, length=length, tokens=jnp.pad(drafts, ((0, 0), (0, W - k))),
                                  count=jnp.zeros((B,), jnp.int32))
        return drafts, q, new

    def commit(self, *, params, view, state: MTPState, verified: TargetOutput, n):
        """Parks the hidden states of the n kept tokens [anchor, d_1 .. d_{n-1}]; see ``MTPState``."""
        W = state.hidden.shape[1]
        hidden = jnp.pad(verified.hidden, ((0, 0), (0, W - verified.hidden.shape[1]), (0, 0)))
        return dataclasses.replace(state, hidden=hidden.astype(state.hidden.dtype), count=n.astype(jnp.int32))


def mtp_params(target: Target) -> nnx.State:
    """The MTP proposer's params: the target's ``mtp`` subtree (a clear error when it has no head)."""
    if "mtp" not in target.params:
        raise ValueError("the target has no MTP head: load it with load_target(path, mtp=True) from a checkpoint "
                         "with mtp.* weights")
    return target.params["mtp"]
