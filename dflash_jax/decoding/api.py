"""The host API over the loop: ``make_generate``, ``generate``, ``stream``, ``prefill_prefix`` and prompt padding.

Sits on ``loop.py``: it checks and pads token-id prompts (buckets of powers of two, so a new prompt
length rarely recompiles), builds the ``SpeculativeLoop`` of one (target, proposer, spec)
configuration and runs it: whole on device (``generate``, or the pure function ``make_generate``
returns, which users may ``jax.jit``, ``jax.export`` or shard) or one jitted step at a time from
Python (``stream``, for front ends that print as they go). ``prefill_prefix`` prefills a prompt prefix once for
``generate(prefix=)`` calls, by the mechanism the server's prefix cache uses (``decoding.prefix``).
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import parallel
from dflash_jax.decoding import prefix as prefix_store
from dflash_jax.decoding.loop import FinishReason, GenerateOutput, SpecConfig, SpeculativeLoop, tile_capacity
from dflash_jax.decoding.proposers import DFlashProposer, NoProposer, Proposer
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target


class PositionWarning(UserWarning):
    """A prompt and its new tokens run past the target's max_position_embeddings (positions it was not trained on)."""


def position_warning(cfg, prompt_lens, max_new_tokens: int) -> str | None:
    """The warning for prompts of these real lengths (not their padded bucket) and ``max_new_tokens``, or None."""
    limit = getattr(cfg, "max_position_embeddings", None)
    longest = int(np.max(prompt_lens))
    if limit and longest + max_new_tokens > limit:
        return (f"the longest prompt ({longest} tokens) + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} "
                f"exceeds the target's max_position_embeddings {limit}: positions past it are untrained")
    return None


INT32_MAX = int(np.iinfo(np.int32).max)  # token ids run as int32: a larger one would wrap (2**32 + 5 -> 5)


def _check_token_ids(row, b: int, vocab_size: int | None) -> None:
    if row.ndim != 1 or (row.size and row.dtype.kind not in "iu"):
        big = row.dtype == object and all(isinstance(i, numbers.Integral) for i in row.reshape(-1))
        raise ValueError(f"prompt {b}: token ids must be a flat list of integers"
                         + (" in int32 (0 .. 2**31 - 1)" if big else f", got dtype {row.dtype}, shape {row.shape}"))
    if row.size:
        if vocab_size is not None:
            bad = row[(row < 0) | (row >= vocab_size)]
            if bad.size:
                raise ValueError(f"prompt {b}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
        bad = row[(row < 0) | (row > INT32_MAX)]
        if bad.size:
            raise ValueError(f"prompt {b}: token id {int(bad[0])} is outside int32 [0, 2**31 - 1] (token ids run as "
                             "int32 and would wrap)")


def _token_rows(prompts) -> list[np.ndarray]:
    """Each prompt as a 1-D array; a clear error for text, a flat list of ids, or a prompt that is not a list."""
    if isinstance(prompts, str | bytes | numbers.Number) or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    rows = []
    for b, p in enumerate(prompts):
        if isinstance(p, str | bytes):
            raise ValueError(f"prompt {b} is text ({p[:30]!r}): prompts are token ids; encode the text with the "
                             "target's tokenizer first")
        if isinstance(p, numbers.Number) or np.ndim(p) == 0:
            raise ValueError(f"prompts must be a list of token-id lists, but prompt {b} is the single value {p!r}: "
                             "for one prompt pass [ids], not ids")
        rows.append(np.asarray(list(p)))
    return rows


def _inputs(loop: SpeculativeLoop, params, prompts, prompt_lens):
    """(params, prompts [B, P], prompt_lens [B]) as ``loop.run`` / ``loop.init`` take them: concrete prompts
    checked (shapes, every length in 1..P, the token ids before each length in the target's vocabulary,
    the loop state against the memory of its device) and, with the loop's mesh, params and rows placed on
    it; traced ones (the caller's jit) as given,
    their shapes checked at trace time and their values not at all."""
    if any(isinstance(x, jax.core.Tracer) for x in (prompts, prompt_lens)):
        return params, prompts, prompt_lens
    prompts, lens = np.asarray(prompts), np.asarray(prompt_lens)
    if prompts.ndim != 2 or lens.shape != prompts.shape[:1]:
        raise ValueError(f"prompts must be [B, P] and prompt_lens [B], got {prompts.shape} and {lens.shape}")
    bad = np.flatnonzero((lens < 1) | (lens > prompts.shape[1]))
    if bad.size:
        raise ValueError(f"prompt_lens[{bad[0]}] = {lens[bad[0]]} is outside 1..{prompts.shape[1]} (the bucket)")
    for b in range(prompts.shape[0]):
        _check_token_ids(prompts[b, :lens[b]], b, loop.cfg.vocab_size)
    if (message := position_warning(loop.cfg, lens, loop.spec.max_new_tokens)) is not None:
        warnings.warn(message, PositionWarning, stacklevel=3)
    if loop.mesh is not None:
        params = parallel.shard_params(params, loop.mesh, loop.cfg, loop.proposer)
        prompts, lens = parallel.shard_rows(loop.mesh, prompts, lens)
    loop.check_memory(params, prompts, lens)  # before the state is allocated, against its device
    return params, prompts, lens


def make_generate(target: Target, proposer: Proposer = NoProposer(), spec: SpecConfig = SpecConfig(), *,
                  mesh: jax.sharding.Mesh | None = None):
    """A pure generate function for one (target, proposer, spec) configuration.

    Args:
      target: the loaded target (its config and graph are used; its params are passed at call time).
      proposer: ``NoProposer()`` (plain decoding), ``DFlashProposer``, ``MTPProposer`` or ``OracleProposer``.
      spec: block size, max_new_tokens, sampling, stop ids, capacity, tree budget (draft trees).
      mesh: a ``parallel.make_mesh`` mesh: concrete params and prompts are placed on it (``sharding``'s
        tables; already placed params stay) and the loop runs sharded. None: one device.
    Returns:
      ``fn(params, prompts [B, P] int32 right-padded, prompt_lens [B], rng) -> GenerateOutput`` where
      params = (target params, proposer params) and rng is a key, a [B] batch of keys, or an int seed.
      Concrete prompts are checked (token ids in the vocabulary, lengths in 1..P) before compiling.
    """
    loop = SpeculativeLoop.of(target, proposer, spec, mesh)

    def generate_fn(params, prompts, prompt_lens, rng):
        params, prompts, prompt_lens = _inputs(loop, params, prompts, prompt_lens)
        return loop.run(params, jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lens, jnp.int32), rng)

    return generate_fn


def pad_prompts(prompts, bucket: int | None = None, *,
                vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into [B, P] (P = bucket, default the longest prompt) and returns lengths.

    Token ids must be integers, in [0, vocab_size) when it is given.
    """
    rows = _token_rows(prompts)
    if len(rows) == 0:
        raise ValueError("no prompts given")
    for b, row in enumerate(rows):
        _check_token_ids(row, b, vocab_size)
    lengths = np.array([len(r) for r in rows], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"empty prompt at row {int(np.argmin(lengths))}: every prompt needs at least one token")
    bucket = int(lengths.max()) if bucket is None else bucket
    if lengths.max() > bucket:
        raise ValueError(f"prompt of {lengths.max()} tokens does not fit the bucket of {bucket}")
    out = np.zeros((len(rows), bucket), np.int32)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out, lengths


def bucket_for(length: int, minimum: int = 16) -> int:
    """Prompt bucket: the next power of two, so new prompt lengths rarely recompile."""
    return max(minimum, 1 << (int(length) - 1).bit_length())


def _proposer(drafter, block_size: int | None) -> tuple[Proposer, object, int]:
    """(proposer, its params, block) of ``drafter``: a ``Drafter`` (DFlash) or a ``(proposer, proposer params)``
    pair (e.g. ``(MTPProposer.of(target, k), mtp_params(target))``); block size 1 drops it."""
    if drafter is None:
        proposer, pparams = NoProposer(), ()
    elif isinstance(drafter, tuple):
        proposer, pparams = drafter
    else:
        proposer, pparams = DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params
    block = (proposer.max_block if drafter is not None else 1) if block_size is None else block_size
    return (NoProposer(), (), 1) if block == 1 else (proposer, pparams, block)


def _setup(target: Target, prompts, drafter, block_size: int | None, max_new_tokens, sampling, stop_ids, mesh,
           tree_budget: int | None = None):
    """(loop, params, tokens, lengths) for a target, an optional drafter (``_proposer``) and token-id prompts;
    ``tree_budget``: draft trees (``SpecConfig.tree_budget``).
    """
    proposer, pparams, block = _proposer(drafter, block_size)
    spec = SpecConfig(block_size=block, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      tree_budget=tree_budget)
    rows = _token_rows(prompts)
    tokens, lengths = pad_prompts(rows, bucket_for(max((len(p) for p in rows), default=1)),
                                  vocab_size=target.cfg.vocab_size)
    loop = SpeculativeLoop.of(target, proposer, spec, mesh)
    return loop, *_inputs(loop, (target.params, pparams), tokens, lengths)


def _check_call(target, drafter, block_size, max_new_tokens, sampling, rng, tree_budget=None) -> None:
    """The arguments of ``generate`` / ``stream``, checked before anything is traced: a clear ValueError naming the
    argument instead of an error from deep inside JAX."""
    if not isinstance(target, Target):
        raise ValueError(f"target must be a Target (models.target.load_target), got {type(target).__name__}")
    if isinstance(drafter, Target):
        raise ValueError("drafter= got a Target: pass a DFlash Drafter (models.drafter.load_drafter), or "
                         "(MTPProposer.of(target, k), mtp_params(target)) for MTP, or None for plain decoding")
    if drafter is not None and not isinstance(drafter, Drafter) and not (
            isinstance(drafter, tuple) and len(drafter) == 2 and hasattr(drafter[0], "max_block")):
        raise ValueError(f"drafter must be a Drafter, a (proposer, proposer params) pair or None, got "
                         f"{type(drafter).__name__}")
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig (e.g. SamplingConfig(temperature=0.7, top_p=0.9)), got "
                         f"{type(sampling).__name__} {sampling!r}"[:300])
    if tree_budget is not None and drafter is None:
        raise ValueError(f"tree_budget {tree_budget!r}: draft trees need a DFlash drafter (drafter=)")
    for name, value in (("max_new_tokens", max_new_tokens), ("block_size", block_size), ("tree_budget", tree_budget)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(rng, bool) or not (isinstance(rng, numbers.Integral) or hasattr(rng, "dtype")):
        raise ValueError(f"rng must be an int seed or a jax.random key (or a [B] batch of keys), got "
                         f"{type(rng).__name__} {rng!r}"[:200])
    if isinstance(rng, numbers.Integral) and not -(2**31) <= rng <= INT32_MAX:
        raise ValueError(f"rng seed {rng} is outside int32 (seeds become int32 keys)")


def generate(target: Target, prompts, *, drafter=None, block_size: int | None = None, max_new_tokens: int = 128,
             sampling: SamplingConfig = SamplingConfig(), stop_ids: tuple[int, ...] | None = None,
             rng=0, mesh: jax.sharding.Mesh | None = None, tree_budget: int | None = None,
             prefix: PromptPrefix | None = None) -> GenerateOutput:
    """Generates for a list of token-id prompts (the jitted convenience around ``SpeculativeLoop.run``).

    Prompts are right-padded to a power-of-two bucket, so prompts of similar length share one
    compiled program. Without a drafter (or with block_size=1) this is plain decoding; block_size
    defaults to the drafter's. With a ``mesh`` the run is sharded (see ``make_generate``); across
    processes the output's rows are spread over them (``parallel.host`` gathers them). ``tree_budget`` N
    drafts a tree of the N best prefixes of depth <= block_size - 1 per step (DDTree, ``decoding.tree``).
    ``prefix``: a ``prefill_prefix`` every prompt starts with (and continues past): its tokens are not prefilled
    again, and the output is the one without it (up to float rounding).
    """
    _check_call(target, drafter, block_size, max_new_tokens, sampling, rng, tree_budget)
    if prefix is not None:
        return _generate_after(prefix, target, prompts, drafter, block_size, max_new_tokens, sampling, stop_ids, rng,
                               mesh, tree_budget)
    loop, params, tokens, lengths = _setup(target, prompts, drafter, block_size, max_new_tokens, sampling, stop_ids,
                                           mesh, tree_budget)
    return loop.run(params, tokens, lengths, rng)


@dataclasses.dataclass(frozen=True, eq=False)
class PromptPrefix:
    """A prompt prefix prefilled once (``prefill_prefix``) for ``generate(prefix=)``: its tokens, and the target's and
    the proposer's state after them as ``decoding.prefix`` keeps it (pages of positions, the boundary state)."""

    tokens: tuple[int, ...]
    graphdef: object  # the target's graph and the proposer it was prefilled for: generate checks them
    proposer: Proposer
    layout: prefix_store.Layout
    page: tuple  # every per-position array's positions [0, len(tokens)), one row
    boundary: tuple  # every other per-row array after the last token

    def __len__(self) -> int:
        return len(self.tokens)


def prefill_prefix(target: Target, tokens, *, drafter=None, block_size: int | None = None) -> PromptPrefix:
    """Prefills ``tokens`` (token ids: a system prompt, a few-shot preamble, a document) once, for ``generate`` calls
    whose prompts start with them (``generate(..., prefix=)``): the target's cache (attention K/V, every Gated
    DeltaNet layer's state) and the drafter's (its injected context, or the MTP head's entries) are kept, so a
    call prefills only the rest. ``drafter`` and ``block_size`` as those calls pass them (block 1: no drafter)."""
    _check_call(target, drafter, block_size, 1, SamplingConfig(), 0)
    (row,), lengths = pad_prompts([tokens], vocab_size=target.cfg.vocab_size)
    proposer, pparams, block = _proposer(drafter, block_size)
    width = bucket_for(int(lengths[0]))
    loop = SpeculativeLoop.of(target, proposer, SpecConfig(block_size=block, max_new_tokens=1, capacity=width))
    params = (target.params, pparams)
    layout = prefix_store.Layout.of(loop, params)
    state = loop.extend(params, loop.empty(params, 1), jnp.asarray(np.pad(row, (0, width - row.size))[None]),
                        jnp.asarray(lengths))
    return PromptPrefix(tokens=tuple(row.tolist()), graphdef=target.graphdef, proposer=proposer, layout=layout,
                        page=prefix_store.cut(layout, state, 0, size=row.size),
                        boundary=prefix_store.snapshot(layout, state))


def _generate_after(prefix: PromptPrefix, target: Target, prompts, drafter, block_size, max_new_tokens, sampling,
                    stop_ids, rng, mesh, tree_budget) -> GenerateOutput:
    """``generate`` of prompts that start with ``prefix``: its state pasted into every row, the rest prefilled by
    ``extend``, then decoded as ``run`` decodes."""
    if not isinstance(prefix, PromptPrefix):
        raise ValueError(f"prefix must be a PromptPrefix (dflash_jax.prefill_prefix), got {type(prefix).__name__}")
    if mesh is not None:
        raise ValueError("prefix= runs on one device: drop mesh= (or the prefix)")
    proposer, pparams, block = _proposer(drafter, block_size)
    if (target.graphdef, proposer) != (prefix.graphdef, prefix.proposer):
        raise ValueError("prefix= was prefilled for another target or drafter: pass prefill_prefix the target, "
                         "drafter= and block_size= (1 or more) this call passes")
    n = len(prefix)
    rows = _token_rows(prompts)
    for b, row in enumerate(rows):
        if row.size <= n or tuple(row[:n].tolist()) != prefix.tokens:
            raise ValueError(f"prompt {b} ({row.size} tokens) does not start with the prefix's {n} tokens and "
                             f"continue past them")
    rest = [row[n:] for row in rows]
    tokens, lengths = pad_prompts(rest, bucket_for(max(len(r) for r in rest)), vocab_size=target.cfg.vocab_size)
    if (message := position_warning(target.cfg, lengths + n, max_new_tokens)) is not None:
        warnings.warn(message, PositionWarning, stacklevel=3)
    spec = SpecConfig(block_size=block, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                      tree_budget=tree_budget)
    capacity = tile_capacity(n + tokens.shape[1] + max_new_tokens + spec.width, jax.default_backend())
    loop = SpeculativeLoop.of(target, proposer, dataclasses.replace(spec, capacity=capacity))
    params = (target.params, pparams)
    state = prefix_store.paste(prefix.layout, loop.empty(params, len(rows)), prefix.page, 0)
    state = prefix_store.resume(prefix.layout, state, prefix.boundary)
    state = loop.extend(params, state, jnp.asarray(tokens), jnp.asarray(lengths))
    return loop.decode(params, loop.start(params, state, rng))[0]


def stream(target: Target, prompts, *, drafter=None, block_size: int | None = None, max_new_tokens: int = 128,
           sampling: SamplingConfig = SamplingConfig(), stop_ids: tuple[int, ...] | None = None,
           rng=0, mesh: jax.sharding.Mesh | None = None, tree_budget: int | None = None) -> Iterator[list[list[int]]]:
    """Like ``generate`` but yields, after prefill and after every target step, the new tokens per row.

    The host drives the same jitted step the on-device loop runs, so the tokens are identical.
    The generator's return value (``StopIteration.value``) is the final ``GenerateOutput``.
    """
    _check_call(target, drafter, block_size, max_new_tokens, sampling, rng, tree_budget)
    loop, params, tokens, lengths = _setup(target, prompts, drafter, block_size, max_new_tokens, sampling, stop_ids,
                                           mesh, tree_budget)
    state = loop.init(params, tokens, lengths, rng)
    shown = np.zeros(len(lengths), np.int32)
    while True:
        # A step emits at most block_size tokens per row: copy only the window that holds them (every
        # process's rows), before the next step donates the state's buffers.
        n_out, finish, window = parallel.host(loop.recent(state))
        start = np.maximum(n_out - loop.spec.block_size, 0)
        yield [window[b, shown[b] - start[b]:n_out[b] - start[b]].tolist() for b in range(len(n_out))]
        shown = n_out
        if not (finish == FinishReason.RUNNING).any():
            return loop.output(state)
        state = loop.step(params, state)
