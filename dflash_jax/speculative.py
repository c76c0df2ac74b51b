"""The speculative decoding loop: prefill, then propose -> verify -> accept -> commit, all on device.

This is the top of the library's data flow: it drives ``target.py`` (prefill, verify, commit),
a proposer from ``proposers.py`` and the rules in ``sampling.py``. ``make_generate`` returns a pure
function ``(params, prompts, prompt_lens, rng) -> GenerateOutput`` that runs the whole generation in
one ``lax.while_loop`` (no host round trip per step), which users may ``jax.jit``, ``jax.export``
or shard. ``stream`` runs the same jitted step from Python and yields tokens as they are committed.

Per row the invariant is: tokens processed by the target = prompt + emitted - 1; the last emitted
token (the anchor) is processed by the next verify, as the first token of the block
``[anchor, d_1 .. d_k]``. A step emits the a accepted drafts and the bonus token, and commits the
anchor plus the a drafts (n = a + 1) in the target and the proposer. Block size 1 (no drafts) is
plain autoregressive decoding through the same code: the baseline every speed-up is measured against.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.cache import TargetCache, commit
from dflash_jax.proposers import DFlashProposer, NoProposer
from dflash_jax.sampling import SamplingConfig, accept, choose
from dflash_jax.target import Target, prefill, verify

RUNNING, STOPPED, LENGTH = 0, 1, 2
FINISH_REASONS = {RUNNING: "running", STOPPED: "stop", LENGTH: "length"}


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """One generate call's static settings.

    block_size: tokens verified per target step (anchor + block_size - 1 drafts); 1 = no drafts.
    max_new_tokens: most tokens emitted per row (never exceeded).
    stop_ids: tokens that end a row (emitted, then the row stops); default: the target's EOS ids.
    capacity: target cache length; None sizes it to prompt bucket + max_new_tokens + block_size.
    """

    block_size: int = 16
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    stop_ids: tuple[int, ...] | None = None
    capacity: int | None = None

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    cache: TargetCache
    proposer: object  # the proposer's state pytree
    anchor: jax.Array  # [B] last emitted token, not yet processed by the target
    out: jax.Array  # [B, max_new_tokens + block] emitted tokens (valid up to n_out)
    n_out: jax.Array  # [B]
    finish: jax.Array  # [B] RUNNING / STOPPED / LENGTH
    keys: jax.Array  # [B] per-row PRNG keys
    step: jax.Array  # [] loop iteration
    steps: jax.Array  # [B] target steps each row took part in
    accepted: jax.Array  # [B, block] histogram of accepted drafts per step


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 past each row's length
    lengths: jax.Array  # [B] tokens emitted per row
    finish_reason: jax.Array  # [B] STOPPED (a stop id) or LENGTH (max_new_tokens); see FINISH_REASONS
    steps: jax.Array  # [B] target verify steps per row (the first token comes from prefill)
    accepted: jax.Array  # [B, block] how often 0..block-1 drafts were accepted

    @property
    def tau(self) -> jax.Array:
        """Mean tokens committed per target step (accepted drafts + the bonus), per row [B]."""
        counts = jnp.arange(1, self.accepted.shape[1] + 1)
        return (self.accepted * counts).sum(-1) / jnp.maximum(self.steps, 1)

    def texts(self) -> list[list[int]]:
        """Per-row token lists, cut at each row's length."""
        tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
        return [tokens[b, :lengths[b]].tolist() for b in range(tokens.shape[0])]


def _row_keys(rng, batch: int) -> jax.Array:
    """Per-row keys from an int seed, a key, or a [B] batch of keys (used as is, so a row can be rerun alone)."""
    rng = jnp.asarray(rng)
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        key = rng
    elif rng.ndim == 0:
        key = jax.random.key(rng)
    else:  # raw uint32 key data: [2] or [B, 2]
        key = jax.random.wrap_key_data(rng)
    return key if key.ndim == 1 else jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))


def _write(out, n_out, tokens):
    return jax.vmap(lambda o, s, t: jax.lax.dynamic_update_slice_in_dim(o, t, s, axis=0))(out, n_out, tokens)


class _Loop:
    """init / step / finish of one configuration; shared by make_generate and stream."""

    def __init__(self, target: Target, proposer, spec: SpecConfig):
        if spec.block_size > 1 and isinstance(proposer, NoProposer):
            raise ValueError(f"block_size {spec.block_size} needs a drafter (no proposer was given)")
        if spec.block_size > proposer.max_block:
            raise ValueError(f"block_size {spec.block_size} exceeds the proposer's block size {proposer.max_block}")
        self.cfg, self.graphdef, self.proposer, self.spec = target.cfg, target.graphdef, proposer, spec
        stop = target.cfg.eos_token_ids if spec.stop_ids is None else spec.stop_ids
        self.stop_ids = jnp.asarray(stop if stop else (-1,), jnp.int32)

    def capacity(self, bucket: int) -> int:
        need = bucket + self.spec.max_new_tokens + self.spec.block_size
        if self.spec.capacity is None:
            return need
        if self.spec.capacity < need:
            raise ValueError(f"cache capacity {self.spec.capacity} is too small: prompt bucket {bucket} + "
                             f"max_new_tokens {self.spec.max_new_tokens} + block_size {self.spec.block_size} = {need}")
        return self.spec.capacity

    def init(self, params, prompts, prompt_lens, rng) -> LoopState:
        tparams, pparams = params
        B, P = prompts.shape
        capacity = self.capacity(P)
        keys = _row_keys(rng, B)
        out, cache = prefill(self.graphdef, tparams, prompts, prompt_lens, capacity=capacity,
                             taps=self.proposer.taps)
        first = choose(out.logits, jax.vmap(lambda k: jax.random.fold_in(k, 1 << 30))(keys), self.spec.sampling)
        target = nnx.merge(self.graphdef, tparams)
        state = self.proposer.init(target, pparams, out, prompt_lens, capacity, prompts)
        max_new, block = self.spec.max_new_tokens, self.spec.block_size
        finish = jnp.where(jnp.isin(first, self.stop_ids), STOPPED, jnp.where(max_new == 1, LENGTH, RUNNING))
        return LoopState(
            cache=cache, proposer=state, anchor=first,
            out=jnp.zeros((B, max_new + block), jnp.int32).at[:, 0].set(first),
            n_out=jnp.ones((B,), jnp.int32), finish=finish.astype(jnp.int32), keys=keys,
            step=jnp.zeros((), jnp.int32), steps=jnp.zeros((B,), jnp.int32),
            accepted=jnp.zeros((B, block), jnp.int32))

    def draft(self, params, s: LoopState):
        """Phase 1: the proposer's k drafts after each row's anchor -> (drafts, q, proposer state, keys)."""
        tparams, pparams = params
        keys = jax.vmap(lambda key: jax.random.split(jax.random.fold_in(key, s.step)))(s.keys)  # [B, 2]
        target = nnx.merge(self.graphdef, tparams)
        drafts, q, pstate = self.proposer.propose(target, pparams, s.proposer, s.anchor, self.spec.block_size - 1,
                                                  keys[:, 0], self.spec.sampling)
        return drafts, q, pstate, keys

    def check(self, params, s: LoopState, drafts):
        """Phase 2: the target verifies [anchor, d_1 .. d_k] -> (TargetOutput, cache with pending rows)."""
        block = jnp.concatenate([s.anchor[:, None], drafts], axis=1)  # [B, k+1]
        return verify(self.graphdef, params[0], block, s.cache, taps=self.proposer.taps)

    def settle(self, params, s: LoopState, drafts, q, pstate, keys, verified, vcache) -> LoopState:
        """Phase 3: accept, emit (cut at stop ids and max_new_tokens), commit target and proposer."""
        tparams, pparams = params
        k = self.spec.block_size - 1
        active = s.finish == RUNNING
        a, bonus = accept(drafts, q, verified.logits, keys[:, 1], self.spec.sampling)
        # Emitted this step: d_1 .. d_a, then the bonus at index a; cut after a stop id and at max_new_tokens.
        j = jnp.arange(k + 1)[None, :]
        emitted = jnp.where(j < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
        is_stop = jnp.isin(emitted, self.stop_ids) & (j <= a[:, None])
        first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), k + 1)
        room = self.spec.max_new_tokens - s.n_out
        count = jnp.where(active, jnp.minimum(jnp.minimum(a + 1, first_stop + 1), room), 0)
        n_out = s.n_out + count
        stopped = active & (first_stop < count)
        finish = jnp.where(stopped, STOPPED, jnp.where(active & (n_out >= self.spec.max_new_tokens), LENGTH,
                                                        s.finish))
        n = jnp.where(active, a + 1, 0)
        target = nnx.merge(self.graphdef, tparams)
        return LoopState(
            cache=commit(vcache, n),
            proposer=self.proposer.commit(target, pparams, pstate, verified, n),
            anchor=jnp.where(active, bonus, s.anchor),
            out=_write(s.out, s.n_out, emitted), n_out=n_out, finish=finish.astype(jnp.int32),
            keys=s.keys, step=s.step + 1, steps=s.steps + active,
            accepted=s.accepted + (active[:, None] & (j == a[:, None])))

    def step(self, params, s: LoopState) -> LoopState:
        drafts, q, pstate, keys = self.draft(params, s)
        verified, vcache = self.check(params, s, drafts)
        return self.settle(params, s, drafts, q, pstate, keys, verified, vcache)

    def decode(self, params, s: LoopState) -> GenerateOutput:
        """Steps until every row has finished, on device, then the output."""
        s = jax.lax.while_loop(lambda s: jnp.any(s.finish == RUNNING), functools.partial(self.step, params), s)
        return self.finish(s)

    def finish(self, s: LoopState) -> GenerateOutput:
        max_new = self.spec.max_new_tokens
        valid = jnp.arange(max_new)[None, :] < s.n_out[:, None]
        return GenerateOutput(tokens=jnp.where(valid, s.out[:, :max_new], -1), lengths=s.n_out,
                              finish_reason=s.finish, steps=s.steps, accepted=s.accepted)


def make_generate(target: Target, proposer=NoProposer(), spec: SpecConfig = SpecConfig()):
    """A pure generate function for one (target, proposer, spec) configuration.

    Args:
      target: the loaded target (its config and graph are used; its params are passed at call time).
      proposer: ``NoProposer()`` (plain decoding), ``DFlashProposer`` or ``OracleProposer``.
      spec: block size, max_new_tokens, sampling, stop ids, capacity.
    Returns:
      ``fn(params, prompts [B, P] int32 right-padded, prompt_lens [B], rng) -> GenerateOutput`` where
      params = (target params, proposer params) and rng is a key, a [B] batch of keys, or an int seed.
    """
    loop = _Loop(target, proposer, spec)

    def generate_fn(params, prompts, prompt_lens, rng):
        state = loop.init(params, jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lens, jnp.int32), rng)
        return loop.decode(params, state)

    return generate_fn


def pad_prompts(prompts, bucket: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into [B, P] (P = bucket, default the longest prompt) and returns lengths."""
    prompts = [list(p) for p in prompts]
    lengths = np.array([len(p) for p in prompts], np.int32)
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    if (lengths == 0).any():
        raise ValueError(f"empty prompt at row {int(np.argmin(lengths))}: every prompt needs at least one token")
    bucket = int(lengths.max()) if bucket is None else bucket
    if lengths.max() > bucket:
        raise ValueError(f"prompt of {lengths.max()} tokens does not fit the bucket of {bucket}")
    out = np.zeros((len(prompts), bucket), np.int32)
    for b, p in enumerate(prompts):
        out[b, :len(p)] = p
    return out, lengths


def bucket_for(length: int, minimum: int = 16) -> int:
    """Prompt bucket: the next power of two, so new prompt lengths rarely recompile."""
    return max(minimum, 1 << (int(length) - 1).bit_length())


def _setup(target: Target, drafter, block_size: int | None, max_new_tokens, sampling, stop_ids):
    """(proposer, params, spec) for a target and an optional drafter; block size 1 drops the drafter.

    ``drafter`` is a ``Drafter`` (DFlash) or a ``(proposer, proposer params)`` pair (e.g. the MTP head).
    """
    if drafter is None:
        proposer, pparams = NoProposer(), ()
    elif isinstance(drafter, tuple):
        proposer, pparams = drafter
    else:
        proposer, pparams = DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params
    block = (proposer.max_block if drafter is not None else 1) if block_size is None else block_size
    spec = SpecConfig(block_size=block, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids)
    if block == 1:
        return NoProposer(), (target.params, ()), spec
    return proposer, (target.params, pparams), spec


@functools.lru_cache(maxsize=64)
def _compiled(cfg, graphdef, proposer, spec):
    return jax.jit(make_generate(Target(cfg, graphdef, None), proposer, spec))


def generate(target: Target, prompts, *, drafter=None, block_size: int | None = None, max_new_tokens: int = 128,
             sampling: SamplingConfig = SamplingConfig(), stop_ids: tuple[int, ...] | None = None,
             rng=0) -> GenerateOutput:
    """Generates for a list of token-id prompts (the jitted convenience around ``make_generate``).

    Prompts are right-padded to a power-of-two bucket, so prompts of similar length share one
    compiled program. Without a drafter (or with block_size=1) this is plain decoding; block_size
    defaults to the drafter's.
    """
    proposer, params, spec = _setup(target, drafter, block_size, max_new_tokens, sampling, stop_ids)
    tokens, lengths = pad_prompts(prompts, bucket_for(max(len(p) for p in prompts)))
    return _compiled(target.cfg, target.graphdef, proposer, spec)(params, tokens, lengths, rng)


def stream(target: Target, prompts, *, drafter=None, block_size: int | None = None, max_new_tokens: int = 128,
           sampling: SamplingConfig = SamplingConfig(), stop_ids: tuple[int, ...] | None = None,
           rng=0) -> Iterator[list[list[int]]]:
    """Like ``generate`` but yields, after prefill and after every target step, the new tokens per row.

    The host drives the same jitted step the on-device loop runs, so the tokens are identical.
    The generator's return value (``StopIteration.value``) is the final ``GenerateOutput``.
    """
    proposer, params, spec = _setup(target, drafter, block_size, max_new_tokens, sampling, stop_ids)
    tokens, lengths = pad_prompts(prompts, bucket_for(max(len(p) for p in prompts)))
    loop = _Loop(target, proposer, spec)
    init, step = jax.jit(loop.init), jax.jit(loop.step)
    state = init(params, tokens, lengths, rng)
    shown = np.zeros(len(lengths), np.int32)
    while True:
        n_out, out = np.asarray(state.n_out), np.asarray(state.out)
        yield [out[b, shown[b]:n_out[b]].tolist() for b in range(len(n_out))]
        shown = n_out
        if not (np.asarray(state.finish) == RUNNING).any():
            return loop.finish(state)
        state = step(params, state)
