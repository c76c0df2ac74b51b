"""The speculative decoding loop: prefill, then propose -> verify -> accept -> commit, all on device.

This is the top of the library's data flow: it drives ``target.py`` (prefill, verify, commit),
a proposer from ``proposers.py`` (or ``mtp.py``) and the rules in ``sampling.py``. One configuration
(target graph, proposer, ``SpecConfig``) is a ``SpeculativeLoop``: a frozen, hashable object whose
phases are jitted with the object itself static, so equal configurations share compiled programs
across calls. ``make_generate`` returns a pure function ``(params, prompts, prompt_lens, rng) ->
GenerateOutput`` that runs the whole generation in one ``lax.while_loop`` (no host round trip per
step), which users may ``jax.jit``, ``jax.export`` or shard. ``stream`` runs the same jitted step from
Python and yields tokens as they are committed.

Per row the invariant is: tokens processed by the target = prompt + emitted - 1; the last emitted
token (the anchor) is processed by the next verify, as the first token of the block
``[anchor, d_1 .. d_k]``. A step emits the a accepted drafts and the bonus token, and commits the
anchor plus the a drafts (n = a + 1) in the target and the proposer. Block size 1 (no drafts) is
plain autoregressive decoding through the same code: the baseline every speed-up is measured against.
A row whose target logits have no finite peak (a NaN, a +inf or all -inf after the temperature: NaN
weights, overflow) stops with ``FinishReason.NONFINITE`` and emits nothing from that step on.

With ``SpecConfig.tree_budget`` N the draft is a tree (``decoding/tree.py``: the N best paths of depth <=
block_size - 1 under the drafter's distributions, a DFlash2 drafter's conditioned by its selector), verified in
one pass of N + 1 tokens (``target.verify(parents=)``); the target's choices are walked down it, and the
accepted path is then handled as the chain it is: its drafts, its nodes' logits (emission, stop ids,
finiteness), its taps (the proposer's commit) and ``commit(cache, n, path)``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import numbers
import os

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import parallel
from dflash_jax.config import TargetConfig
from dflash_jax.decoding import tree as draft_tree
from dflash_jax.decoding.proposers import NoProposer, Proposer, TargetView
from dflash_jax.decoding.sampling import RowSampling, SamplingConfig, accept, choose
from dflash_jax.decoding.tree import DraftTree
from dflash_jax.models.cache import TargetCache, init_cache
from dflash_jax.models.target import Target, TargetOutput, commit, prefill, verify
from dflash_jax.models.target import extend as target_extend


class FinishReason(enum.IntEnum):
    """Why a row stopped (``GenerateOutput.finish_reason``); RUNNING only inside the loop."""

    RUNNING = 0
    STOP = 1  # emitted a stop id
    LENGTH = 2  # emitted max_new_tokens
    NONFINITE = 3  # the target's logits had no finite peak (NaN, +inf or all -inf after the temperature)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """One generate call's static settings.

    block_size: tokens verified per target step (anchor + block_size - 1 drafts); 1 = no drafts.
    max_new_tokens: most tokens emitted per row (never exceeded).
    stop_ids: tokens that end a row (emitted, then the row stops), any ints (kept as a tuple);
      default: the target's EOS ids.
    capacity: target cache length; None sizes it to prompt bucket + max_new_tokens + the verify width.
    tree_budget: None (a chain of block_size - 1 drafts) or N: a draft tree (DDTree, ``decoding.tree``) of the
      N best paths of depth <= block_size - 1 (a DFlash2 drafter's grown from its selector's conditionals),
      verified in one pass of N + 1 tokens.
    """

    block_size: int = 16
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    stop_ids: tuple[int, ...] | None = None
    capacity: int | None = None
    tree_budget: int | None = None

    def __post_init__(self):
        for name in ("block_size", "max_new_tokens") + (() if self.tree_budget is None else ("tree_budget",)):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tree_budget is not None and self.block_size < 2:
            raise ValueError(f"tree_budget {self.tree_budget} needs block_size >= 2 (the tree's depth is "
                             f"block_size - 1), got block_size {self.block_size}")
        if self.stop_ids is not None:  # any iterable of integers (numpy's too) -> a hashable tuple of ints
            stop = (self.stop_ids,) if isinstance(self.stop_ids, numbers.Integral) else self.stop_ids
            try:
                stop = tuple(stop)
            except TypeError:
                raise ValueError(f"stop_ids must be integer token ids, got {self.stop_ids!r}") from None
            bad = [t for t in stop if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 0]
            if bad:
                raise ValueError(f"stop_ids must be token ids (integers >= 0), got {bad[0]!r} in {self.stop_ids!r}")
            object.__setattr__(self, "stop_ids", tuple(int(t) for t in stop))

    @property
    def width(self) -> int:
        """Tokens per target verify: the block, or a tree's N + 1 nodes."""
        return self.block_size if self.tree_budget is None else self.tree_budget + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    cache: TargetCache
    proposer: object  # the proposer's state pytree
    anchor: jax.Array  # [B] last emitted token, not yet processed by the target
    out: jax.Array  # [B, max_new_tokens + block] emitted tokens (valid up to n_out)
    n_out: jax.Array  # [B]
    finish: jax.Array  # [B] FinishReason
    keys: jax.Array  # [B] per-row PRNG keys
    step: jax.Array  # [] loop iteration
    steps: jax.Array  # [B] target steps each row took part in
    accepted: jax.Array  # [B, block] histogram of accepted drafts per step
    rows: RowSampling | None = None  # per-row sampling settings (init's ``rows``); None: the spec's


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Draft:
    """The draft phase's result: k drafts per row after the anchor (a chain), or a tree's N nodes."""

    tokens: jax.Array  # [B, k] int32 (a tree: [B, N], its nodes 1..N)
    q: jax.Array | None  # [B, k, V] their distribution, None when they are the drafter's argmax (and for trees)
    proposer: object  # the proposer's state after proposing
    accept_keys: jax.Array  # [B] PRNG keys of this step's acceptance
    tree: DraftTree | None = None  # the draft tree (spec.tree_budget), its root the anchor


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
    """The check phase's result: the target's verdict on ``[anchor, d_1 .. d_k]``, nothing decided yet."""

    out: TargetOutput  # logits [B, k+1, V], taps, hidden
    cache: TargetCache  # K/V rows written, GDN inputs pending: commit(cache, n) keeps n of them


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Rows of prompt prefilled so far, not yet decoding (``SpeculativeLoop.empty`` / ``extend`` / ``start``): the
    target's cache after ``cache.lengths`` tokens, the proposer's state after the same tokens (``Proposer.extend``),
    and the target's logits at each row's last one. A prompt prefilled in chunks, or resumed from a stored prefix
    (``decoding.prefix``), is one of these until its first token is chosen."""

    cache: TargetCache
    proposer: object  # the proposer's state pytree
    logits: jax.Array  # [B, V] at each row's last token (meaningless before the first extend)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    tokens: jax.Array  # [B, max_new_tokens] int32, -1 past each row's length
    lengths: jax.Array  # [B] tokens emitted per row
    finish_reason: jax.Array  # [B] FinishReason (STOP, LENGTH or NONFINITE); names: finish_names()
    steps: jax.Array  # [B] target verify steps per row (the first token comes from prefill)
    accepted: jax.Array  # [B, block] how often 0..block-1 drafts were accepted

    @property
    def tau(self) -> jax.Array:
        """Mean tokens committed per target step (accepted drafts + the bonus), per row [B]."""
        counts = jnp.arange(1, self.accepted.shape[1] + 1)
        return (self.accepted * counts).sum(-1) / jnp.maximum(self.steps, 1)

    def token_lists(self) -> list[list[int]]:
        """Per-row token ids, cut at each row's length."""
        tokens, lengths = parallel.host((self.tokens, self.lengths))  # all rows, on every process
        return [tokens[b, :lengths[b]].tolist() for b in range(tokens.shape[0])]

    def finish_names(self) -> list[str]:
        """Per-row finish reason names: "stop", "length" or "nonfinite"."""
        return [FinishReason(int(r)).name.lower() for r in parallel.host(self.finish_reason)]


def _row_keys(rng, batch: int) -> jax.Array:
    """Per-row keys from an int seed, a key, or a [B] batch of keys (used as is, so a row can be rerun alone)."""
    rng = jnp.asarray(rng)
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        key = rng
    elif rng.ndim == 0 and jnp.issubdtype(rng.dtype, jnp.integer):
        key = jax.random.key(rng)
    elif rng.dtype == jnp.uint32 and rng.ndim in (1, 2) and rng.shape[-1] == 2:  # raw key data: [2] or [B, 2]
        key = jax.random.wrap_key_data(rng)
    else:
        raise ValueError(f"rng must be an int seed, a key, a [B] batch of keys or raw uint32 key data [2] / [B, 2], "
                         f"got dtype {rng.dtype}, shape {rng.shape}")
    if key.ndim > 1 or (key.ndim == 1 and key.shape[0] != batch):
        raise ValueError(f"rng: a batch of keys needs one key per row, got shape {key.shape} for {batch} rows")
    return key if key.ndim == 1 else jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))


def _write(out, n_out, tokens):
    return jax.vmap(lambda o, s, t: jax.lax.dynamic_update_slice_in_dim(o, t, s, axis=0))(out, n_out, tokens)


def _memory_bytes(device) -> int | None:
    """Bytes of memory ``device`` can hold: an accelerator's limit, a CPU device's host RAM; None where the
    device reports none (a compile-only device, which never allocates)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def tile_capacity(need: int, platform: str) -> int:
    """A cache length of at least ``need`` positions: on a TPU a multiple of 128, which tiles the V cache
    [.., H, S] by 128 along S; at another length the compiler copies the whole V cache into that layout before
    the attention kernel reads it (measured: a 268 MB temporary per 27B layer at 128K). Elsewhere ``need``."""
    return -(-need // 128) * 128 if platform == "tpu" else need


def _phase(static: tuple[str, ...] = (), **jit_options):
    """A loop phase: jitted with the loop (and the arguments named in ``static``) static, traced under its mesh
    (``parallel.mesh_context``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced(self, *args, **kwargs):
            with parallel.mesh_context(self.mesh):
                return fn(self, *args, **kwargs)
        return jax.jit(traced, static_argnames=("self", *static), **jit_options)
    return wrap


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeLoop:
    """One configuration of the loop: the target's config and graph, the proposer, the spec (all static).

    Every phase is a jitted method with the loop itself static: equal loops (equal fields) share
    their compiled programs, so a second call with the same shapes compiles nothing. ``params`` is
    always ``(target params, proposer params)``. The phases of one step, public so that benchmarks
    time and profile the programs the loop runs:

    - ``init(params, prompts, prompt_lens, rng) -> LoopState``: prefill, the first token, the proposer's init.
    - ``draft(params, state) -> Draft``; ``check(params, state, draft) -> Verified``;
      ``settle(params, state, draft, verified) -> LoopState`` (accept, emit, commit).
    - ``step(params, state)``: the three in one program, the state donated.
    - ``decode(params, state) -> (GenerateOutput, final LoopState)``: steps in a ``lax.while_loop``
      until every row has finished (state donated, aliased to the final state); ``output(state)``: the
      output of a state; ``run``: init + decode's output.
    """

    cfg: TargetConfig
    graphdef: nnx.GraphDef
    proposer: Proposer
    spec: SpecConfig
    mesh: jax.sharding.Mesh | None = None  # the state is pinned to ``parallel.state_shardings`` on it
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        block = self.spec.block_size
        if block > 1 and isinstance(self.proposer, NoProposer):
            raise ValueError(f"block_size {block} needs a drafter (no proposer was given)")
        if block > self.proposer.max_block:
            raise ValueError(f"block_size {block} exceeds the proposer's block size {self.proposer.max_block}")
        if self.spec.tree_budget is not None and not hasattr(self.proposer, "tree"):
            raise ValueError(f"tree_budget {self.spec.tree_budget}: draft trees need a drafter that grows them "
                             f"(a DFlash or DFlash2 drafter), not {type(self.proposer).__name__}")
        outside = [t for t in self.spec.stop_ids or () if t >= self.cfg.vocab_size]
        if outside:
            raise ValueError(f"stop_ids: token id {outside[0]} is outside the target's vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        if self.spec.sampling.top_k > self.cfg.vocab_size:
            raise ValueError(f"top_k {self.spec.sampling.top_k} exceeds the target's vocabulary of "
                             f"{self.cfg.vocab_size}")
        # Hashed on every jitted call: the graphs are large, so hash them once.
        object.__setattr__(self, "_hash", hash((self.cfg, self.graphdef, self.proposer, self.spec, self.mesh)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, target: Target, proposer: Proposer = NoProposer(), spec: SpecConfig = SpecConfig(),
           mesh: jax.sharding.Mesh | None = None):
        """The loop of a target; with a ``mesh`` its phases trace under it (MoE layers run expert-parallel)
        and the state keeps one layout across steps (params, prompts: ``parallel.shard_params``/``shard_rows``)."""
        return cls(cfg=target.cfg, graphdef=target.graphdef, proposer=proposer, spec=spec, mesh=mesh)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        stop = self.cfg.eos_token_ids if self.spec.stop_ids is None else self.spec.stop_ids
        return tuple(stop) if stop else (-1,)

    def capacity(self, batch: int, bucket: int, dtype) -> int:
        """The target cache length for a [batch, bucket] prompt batch; a clear error if it cannot be held."""
        max_new, width = self.spec.max_new_tokens, max(self.spec.block_size, self.spec.width)
        need = bucket + max_new + width
        platform = jax.default_backend() if self.mesh is None else self.mesh.devices.flat[0].platform
        capacity = tile_capacity(need, platform) if self.spec.capacity is None else self.spec.capacity
        if capacity < need:
            what = "block_size" if self.spec.tree_budget is None else "tree_budget + 1"
            raise ValueError(f"cache capacity {capacity} is too small: prompt bucket {bucket} + "
                             f"max_new_tokens {max_new} + {what} {width} = {need}")
        if capacity >= 2**31 - 1:  # positions are int32: refused for any device, before prefill is traced
            self._check_held(batch, capacity, jax.eval_shape(lambda: init_cache(self.cfg, batch, capacity, dtype)))
        return capacity

    def _check_held(self, batch: int, capacity: int, caches, device=None) -> None:
        """A clear error when ``caches`` (a pytree of arrays or shapes: the target's cache, the proposer's
        state) and the output of ``batch`` rows exceed the memory of ``device`` (the one the state is
        allocated on; None: only the int32 position limit is checked); a mesh's data axis splits the rows
        (when it divides them)."""
        max_new, block = self.spec.max_new_tokens, self.spec.block_size
        nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(caches)) + batch * (max_new + block) * 4
        data = 1 if self.mesh is None else dict(self.mesh.shape).get("data", 1)
        rows = data if batch % data == 0 else 1
        memory = None if device is None else _memory_bytes(device)
        if capacity >= 2**31 - 1 or (memory is not None and nbytes / rows > memory):
            held = "" if memory is None else f" ({memory / 2**30:.1f} GiB on {device})"
            split = f", {nbytes / rows / 2**30:.1f} GiB per device over the data axis of {rows}" if rows > 1 else ""
            raise ValueError(f"max_new_tokens {max_new} cannot be held: {batch} rows of {capacity} cache positions "
                             f"need {nbytes / 2**30:.1f} GiB for the caches and the output alone{split}, more "
                             f"than the memory{held}; lower max_new_tokens or the batch")

    def check_memory(self, params, prompts, prompt_lens) -> None:
        """Before a run allocates its state: a clear error when the loop state of these concrete inputs
        (params and prompts [B, P] as ``run`` / ``init`` take them) exceeds the memory of the device it is
        allocated on (this process's first of the mesh, else the params' device, else its first local one).
        Tracing, ``eval_shape`` and lowering for another device (a compile-only TPU, say) allocate nothing and
        check nothing."""
        state = jax.eval_shape(lambda: self.init(params, jnp.asarray(prompts), jnp.asarray(prompt_lens), 0))
        if self.mesh is not None:  # one of this process's devices: another process's reports no memory here
            device = next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        else:
            placed = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array)]
            device = next(iter(placed[0].devices())) if placed else jax.local_devices()[0]
        capacity = state.cache.rope.shape[0]  # the position table [S, 2, R/2]
        self._check_held(state.anchor.shape[0], capacity, (state.cache, state.proposer), device)

    def _rules(self, state: LoopState | None = None, rows: RowSampling | None = None):
        """The sampling rules of a state's rows: its ``RowSampling``, else the spec's ``SamplingConfig``."""
        rows = rows if state is None else state.rows
        return self.spec.sampling if rows is None else rows

    def _finite(self, logits, chosen, rules=None):
        """Logits [..., V] -> [...] True where their peak after the temperature is finite: the rules' choice
        from them is then well defined (a NaN anywhere, a +inf or all -inf is not; -inf beside a finite peak
        is a token of probability 0). ``chosen`` [...]: the tokens the rules chose from these logits.

        Greedy reads one logit per position: the chosen token is the argmax, and argmax returns a NaN's
        index, so its logit is the peak. Sampling takes the max over V (beside the several passes over V
        that its rules make)."""
        rules = self._rules() if rules is None else rules
        greedy = lambda: jnp.isfinite(jnp.take_along_axis(logits, chosen[..., None], axis=-1)[..., 0])
        if isinstance(rules, RowSampling):  # max(x) / t = max(x / t), t > 0; greedy rows as greedy
            t = rules.rows(chosen, "temperature")
            return jnp.where(t == 0, greedy(), jnp.isfinite(jnp.max(logits, axis=-1).astype(jnp.float32) / t))
        if rules.temperature == 0:
            return greedy()
        return jnp.isfinite(jnp.max(logits, axis=-1).astype(jnp.float32) / rules.temperature)

    @_phase()
    def init(self, params, prompts, prompt_lens, rng, rows: RowSampling | None = None) -> LoopState:
        """Prefill of prompts [B, P] int32 (right-padded, real up to prompt_lens [B]) and the first token;
        ``rows``: per-row sampling settings in place of the spec's (each row drafts by its own draft mode)."""
        tparams, pparams = params
        prompts, prompt_lens = prompts.astype(jnp.int32), prompt_lens.astype(jnp.int32)
        B, P = prompts.shape
        view = TargetView.of(tparams)
        capacity = self.capacity(B, P, view.embedding.dtype)
        out, cache = prefill(self.graphdef, tparams, prompts, prompt_lens, capacity=capacity,
                             taps=self.proposer.taps)
        state = self.proposer.init(params=pparams, view=view, prefill=out, prompts=prompts,
                                   prompt_lens=prompt_lens, capacity=capacity)
        return self._launch(Prefix(cache=cache, proposer=state, logits=out.logits), _row_keys(rng, B), rows)

    def _launch(self, prefix: Prefix, keys, rows: RowSampling | None) -> LoopState:
        """The decode state of prefilled rows (``init``'s and ``start``'s): the first token chosen from the prefix's
        logits with each row's key ``keys`` [B] and rules."""
        B = keys.shape[0]
        rules = self._rules(rows=rows)
        first = choose(prefix.logits, jax.vmap(lambda k: jax.random.fold_in(k, 1 << 30))(keys), rules)
        max_new, block = self.spec.max_new_tokens, self.spec.block_size
        finite = self._finite(prefix.logits, first, rules)
        finish = jnp.where(jnp.isin(first, jnp.asarray(self.stop_ids)), FinishReason.STOP,
                           jnp.where(max_new == 1, FinishReason.LENGTH, FinishReason.RUNNING))
        return self._pin(LoopState(
            cache=prefix.cache, proposer=prefix.proposer, anchor=first,
            out=jnp.zeros((B, max_new + block), jnp.int32).at[:, 0].set(first),
            n_out=finite.astype(jnp.int32),
            finish=jnp.where(finite, finish, FinishReason.NONFINITE).astype(jnp.int32), keys=keys,
            step=jnp.zeros((), jnp.int32), steps=jnp.zeros((B,), jnp.int32),
            accepted=jnp.zeros((B, block), jnp.int32), rows=rows))

    # -- a prompt in chunks, or resumed from a stored prefix: empty -> extend ... -> start (instead of init) --

    @_phase(static=("batch",))
    def empty(self, params, batch: int = 1) -> Prefix:
        """``batch`` rows of no tokens at the spec's ``capacity`` (which must be set): what ``extend`` continues."""
        tparams, pparams = params
        if self.spec.capacity is None:
            raise ValueError("SpeculativeLoop.empty: the spec needs a capacity (SpecConfig.capacity): a prompt "
                             "prefilled in chunks cannot size its cache from a bucket")
        view = TargetView.of(tparams)
        capacity = self.spec.capacity
        logits = jax.eval_shape(view.logits, jax.ShapeDtypeStruct((batch, self.cfg.hidden_size), view.embedding.dtype))
        return self._pin(Prefix(
            cache=init_cache(self.cfg, batch, capacity, view.embedding.dtype),
            proposer=self.proposer.start(params=pparams, view=view, batch=batch, capacity=capacity),
            logits=jnp.zeros(logits.shape, logits.dtype)), batch)

    @_phase(donate_argnames="prefix")
    def extend(self, params, prefix: Prefix, tokens, n) -> Prefix:
        """The next n[b] (>= 1) tokens of each row's prompt, ``tokens`` [B, T] right-padded, processed by the target
        (``target.extend``: as one prefill would, up to float rounding) and the proposer (``Proposer.extend``).
        The caller keeps ``cache.lengths + T <= capacity``. ``prefix`` is donated."""
        tparams, pparams = params
        tokens, n = tokens.astype(jnp.int32), n.astype(jnp.int32)
        out, cache = target_extend(self.graphdef, tparams, tokens, n, prefix.cache, taps=self.proposer.taps)
        state = self.proposer.extend(params=pparams, view=TargetView.of(tparams), state=prefix.proposer, chunk=out,
                                     tokens=tokens, n=n)
        return self._pin(Prefix(cache=cache, proposer=state, logits=out.logits), tokens.shape[0])

    def start(self, params, prefix: Prefix, rng, rows: RowSampling | None = None) -> LoopState:
        """The decode state of a prefilled ``prefix`` (its caches donated): its first token chosen as ``init`` chooses
        it (``rng`` and ``rows`` as ``init`` takes them), so a prompt prefilled in chunks decodes as ``init`` of it
        whole."""
        return self._start(params, (prefix.cache, prefix.proposer), prefix.logits, rng, rows)

    @_phase(donate_argnames="caches")
    def _start(self, params, caches, logits, rng, rows) -> LoopState:
        cache, proposer = caches
        return self._launch(Prefix(cache, proposer, logits), _row_keys(rng, logits.shape[0]), rows)

    def _pin(self, state, batch: int | None = None):
        """A loop state (or a proposer's state of ``batch`` rows) in its mesh layout (no-op without a mesh),
        so no step gathers a cache."""
        batch = state.anchor.shape[0] if batch is None else batch
        return parallel.pin_state(state, batch, self.mesh, self.cfg, self.proposer)

    @_phase()
    def draft(self, params, state: LoopState) -> Draft:
        """Phase 1: the proposer's k = block_size - 1 drafts after each row's anchor."""
        tparams, pparams = params
        # Each row's keys follow its own step count: its stream does not depend on when it joined a batch.
        keys = jax.vmap(lambda key, t: jax.random.split(jax.random.fold_in(key, t)))(state.keys, state.steps)
        if self.spec.block_size == 1:  # plain decoding: no draft pass (a drafter's state is kept up by its commit)
            return Draft(tokens=jnp.zeros((state.anchor.shape[0], 0), jnp.int32), q=None, proposer=state.proposer,
                         accept_keys=keys[:, 1])
        if self.spec.tree_budget is not None:
            tree, pstate = self.proposer.tree(
                params=pparams, view=TargetView.of(tparams), state=state.proposer, anchor=state.anchor,
                depth=self.spec.block_size - 1, budget=self.spec.tree_budget)
            return Draft(tokens=tree.tokens[:, 1:], q=None, proposer=self._pin(pstate, tree.tokens.shape[0]),
                         accept_keys=keys[:, 1], tree=tree)
        tokens, q, pstate = self.proposer.propose(
            params=pparams, view=TargetView.of(tparams), state=state.proposer, anchor=state.anchor,
            k=self.spec.block_size - 1, keys=keys[:, 0], sampling=self._rules(state))
        return Draft(tokens=tokens, q=q, proposer=self._pin(pstate, tokens.shape[0]), accept_keys=keys[:, 1])

    @_phase()
    def check(self, params, state: LoopState, draft: Draft) -> Verified:
        """Phase 2: the target verifies [anchor, d_1 .. d_k]."""
        block = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)  # [B, k+1] (a tree: [B, N+1])
        parents = None if draft.tree is None else draft.tree.parents
        out, cache = verify(self.graphdef, params[0], block, state.cache, taps=self.proposer.taps, parents=parents,
                            tree_depth=None if parents is None else self.spec.block_size - 1)
        return Verified(out=out, cache=self._pin(cache, block.shape[0]))

    @_phase()
    def settle(self, params, state: LoopState, draft: Draft, verified: Verified) -> LoopState:
        """Phase 3: accept, emit (cut at stop ids, max_new_tokens, non-finite logits), commit target and proposer."""
        tparams, pparams = params
        k, max_new = self.spec.block_size - 1, self.spec.max_new_tokens
        s, logits = state, verified.out.logits
        rules = self._rules(state)
        path, out = None, verified.out
        if draft.tree is None:
            a, bonus = accept(draft.tokens, draft.q, logits, draft.accept_keys, rules)
            drafts = draft.tokens
        else:  # the walk's path [B, k+1] as the chain it accepted: its drafts, its nodes' logits and taps
            chosen = draft_tree.choices(logits, draft.accept_keys, rules)
            path, a, bonus = draft_tree.walk(draft.tree, chosen, k)
            along = lambda x: jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
            drafts, logits = along(draft.tree.tokens)[:, 1:], along(logits)
            out = dataclasses.replace(out, logits=logits, taps=along(out.taps), hidden=along(out.hidden))
        # Emitted this step: d_1 .. d_a, then the bonus at index a; token j is decided by the logits at j.
        # Cut after a stop id, at max_new_tokens, and before the first non-finite logits the rules read.
        j = jnp.arange(k + 1)[None, :]
        emitted = jnp.where(j < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])  # [B, k+1]
        bad = ~self._finite(logits, emitted, rules) & (j <= a[:, None])  # [B, k+1]; the rules chose emitted[:, :a+1]
        first_bad = jnp.where(bad.any(1), jnp.argmax(bad, axis=1), k + 1)
        active = s.finish == FinishReason.RUNNING
        is_stop = jnp.isin(emitted, jnp.asarray(self.stop_ids)) & (j <= a[:, None])
        first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), k + 1)
        count = jnp.minimum(jnp.minimum(a + 1, first_stop + 1), jnp.minimum(max_new - s.n_out, first_bad))
        count = jnp.where(active, count, 0)
        n_out = s.n_out + count
        finish = jnp.where(first_stop < count, FinishReason.STOP,
                           jnp.where(n_out >= max_new, FinishReason.LENGTH,
                                     jnp.where(first_bad <= k, FinishReason.NONFINITE, FinishReason.RUNNING)))
        finish = jnp.where(active, finish, s.finish)
        n = jnp.where(active, a + 1, 0)  # a row that finished here commits too; nothing reads it again
        hist = jnp.arange(s.accepted.shape[1])[None, :]  # the state's histogram: its layout's block >= this block
        pstate = self.proposer.commit(params=pparams, view=TargetView.of(tparams), state=draft.proposer,
                                      verified=out, n=n)
        return self._pin(LoopState(
            cache=commit(verified.cache, n, path), proposer=pstate, anchor=jnp.where(active, bonus, s.anchor),
            out=_write(s.out, s.n_out, emitted), n_out=n_out, finish=finish.astype(jnp.int32),
            keys=s.keys, step=s.step + 1, steps=s.steps + active,
            accepted=s.accepted + (active[:, None] & (first_bad > k)[:, None] & (hist == a[:, None])), rows=s.rows))

    @_phase(donate_argnames="state")
    def step(self, params, state: LoopState) -> LoopState:
        """One target step: draft, check, settle."""
        draft = self.draft(params, state)
        return self.settle(params, state, draft, self.check(params, state, draft))

    @_phase(static=("rows",), donate_argnames="state")
    def step_rows(self, params, state: LoopState, rows: int) -> LoopState:
        """``step`` of the first ``rows`` rows of ``state`` (the rest unchanged, its finished rows too): how a server
        whose running rows sit in its low slots pays for those only. ``state`` may be laid out for a larger block
        than this loop's (``init`` of a loop of the same capacity and a larger block: its ``out`` and ``accepted``
        are wider), so that loops of several blocks step one state in turn, each step exact under its own block.
        Rows are the arrays whose leading dimension is the batch (``parallel.state_shardings``' rule)."""
        B = state.anchor.shape[0]
        if not 1 <= rows <= B:
            raise ValueError(f"rows {rows}: a step runs 1..{B} rows of this state")
        if rows == B:
            return self.step(params, state)
        is_row = lambda x: x.ndim > 0 and x.shape[0] == B  # noqa: E731
        head = jax.tree.map(lambda x: x[:rows] if is_row(x) else x, state)
        new = self.step(params, self._pin(head, rows))
        return self._pin(jax.tree.map(lambda x, y: x.at[:rows].set(y) if is_row(x) else y, state, new))

    @_phase(donate_argnames="state")
    def decode(self, params, state: LoopState) -> tuple[GenerateOutput, LoopState]:
        """Steps until every row has finished, on device: (the output, the final state).

        The final state is returned so that the donated state's buffers alias it: the loop updates
        the caches in place instead of copying them at entry."""
        state = jax.lax.while_loop(lambda s: jnp.any(s.finish == FinishReason.RUNNING),
                                   functools.partial(self.step, params), state)
        return self.output(state), state

    @_phase(donate_argnames="state")
    def move(self, state: LoopState, src, dst) -> LoopState:
        """Row ``src`` of ``state`` copied into row ``dst`` (int32 scalars; ``state`` donated): how a server moves a
        running request into a lower free slot, so that its steps run over a smaller rows bucket (``step_rows``).
        Rows are the arrays whose leading dimension is the batch, as in ``step_rows``; row ``src`` is left as it was."""
        B = state.anchor.shape[0]

        def put(x):
            if x.ndim and x.shape[0] == B:
                return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(x, src, 1, 0), dst, axis=0)
            return x

        return self._pin(jax.tree.map(put, state))

    @_phase(donate_argnames="state")
    def insert(self, state: LoopState, row: LoopState, slot) -> LoopState:
        """``row`` (a one-row ``init`` state of this loop, with its ``capacity``) written into row ``slot`` of
        ``state``, which is donated: how a server starts a request in a free slot between steps. Every array
        whose leading dimension is the batch is a row's (as ``parallel.state_shardings`` reads a state);
        the rest (the RoPE tables, the step counter) is the state's own."""
        B = state.anchor.shape[0]

        def put(rows, one):
            if rows.ndim and rows.shape[0] == B and one.shape == (1,) + rows.shape[1:]:
                return jax.lax.dynamic_update_slice_in_dim(rows, one, slot, axis=0)
            return rows

        return self._pin(jax.tree.map(put, state, row))

    @_phase()
    def output(self, state: LoopState) -> GenerateOutput:
        max_new = self.spec.max_new_tokens
        valid = jnp.arange(max_new)[None, :] < state.n_out[:, None]
        return GenerateOutput(tokens=jnp.where(valid, state.out[:, :max_new], -1), lengths=state.n_out,
                              finish_reason=state.finish, steps=state.steps, accepted=state.accepted)

    @_phase()
    def recent(self, state: LoopState) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(n_out [B], finish [B], out[b, max(n_out[b] - block, 0) :][:block] [B, block]): all a step can
        have emitted, which ``stream`` copies to the host instead of the whole ``out``."""
        block = state.accepted.shape[1]  # the state's layout block (``step_rows``): the most a step emits
        start = jnp.maximum(state.n_out - block, 0)
        window = jax.vmap(lambda o, s: jax.lax.dynamic_slice_in_dim(o, s, block))(state.out, start)
        return state.n_out, state.finish, window

    @_phase()
    def run(self, params, prompts, prompt_lens, rng) -> GenerateOutput:
        """The whole generation: init, then decode."""
        return self.decode(params, self.init(params, prompts, prompt_lens, rng))[0]
