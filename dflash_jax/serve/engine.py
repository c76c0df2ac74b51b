"""The serving engine: continuous batching over the speculative loop's phases, in a fixed number of slots.

Sits between the HTTP front end (``app.py``) and the loop (``SpeculativeLoop``): it owns one decode state of
``slots`` rows and a bounded queue of requests, and drives them from one thread, JetStream's shape. A
request takes a free slot and is prefilled alone, in chunks of at most ``max_num_batched_tokens`` tokens
(``loop.extend`` on one row, each chunk padded to a power-of-two width; by default, while requests run, the
widest that costs at most a step) between the running slots' steps, so no stream waits for a whole prompt;
with the prefix cache (``decoding.prefix.PrefixStore``) it resumes from
the deepest stored snapshot of its prompt (the target's K/V and Gated DeltaNet states and the drafter's
context) and its chunks are stored in turn. Its first token is chosen with its own sampling settings and seed
(``loop.start``), it is inserted into its slot between steps (``loop.insert``), and every slot advances in
the one jitted ``loop.step`` with its own acceptance; after each step the host copies what the step emitted
(``loop.recent``), hands each request its new tokens, and frees at once the slot of a request that is done
(a stop id, its ``max_tokens``, its caller's stop string or disconnect). Shapes never change as requests
come and go (the slot count and the cache capacity are fixed; chunks are padded to a power-of-two width up to
the chunk), so nothing compiles after ``warmup``. Stop ids are decided here, per request, not
by the loop (whose spec has none): the tokens are the loop's, cut where ``generate``'s would stop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import heapq
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import parallel
from dflash_jax.decoding import prefix as prefix_store
from dflash_jax.decoding.api import bucket_for
from dflash_jax.decoding.loop import FinishReason, LoopState, Prefix, SpecConfig, SpeculativeLoop, tile_capacity
from dflash_jax.decoding.sampling import RowSampling, SamplingConfig
from dflash_jax.serve import schedule
from dflash_jax.serve.schedule import Option

log = logging.getLogger("dflash_jax.serve")


class QueueFull(Exception):
    """The bounded queue of waiting requests is full (the server answers 503 with Retry-After)."""


class Closed(Exception):
    """The engine takes no new requests (it is draining for shutdown)."""


FINISHED_KEPT = 1024  # /stats keeps the records of this many most recent finished requests
DEFAULT_BATCHED_TOKENS = 256  # prompt tokens prefilled between two steps (--max-num-batched-tokens): a chunk


@dataclasses.dataclass(frozen=True)
class Finish:
    """How a request ended: ``reason`` "stop" (a stop id or string), "length" (max_tokens), "abort"
    (cancelled: its client left) or "nonfinite" (the target's logits had no finite peak); ``tokens``: the
    completion's tokens (up to the one that ended it); ``steps``: target verify steps it took to emit them;
    ``accepted``: drafts the target accepted among them; ``cached``: prompt tokens resumed from the prefix cache
    instead of prefilled (OpenAI's usage.prompt_tokens_details.cached_tokens)."""

    reason: str
    tokens: int
    steps: int
    accepted: int
    cached: int = 0


@dataclasses.dataclass(eq=False)
class Job:
    """One request: a token-id prompt and its settings (``seed``: any 64-bit integer). ``emit(tokens, finish)``
    is called from the engine's thread with each step's new tokens, and once with ``finish`` set (then never
    again). ``watch(tokens)``, when given, sees the same new tokens first (engine thread) and may end the
    request by its caller's own rule (a stop string): it returns how many of them to keep, or None."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stop_ids: tuple[int, ...]
    emit: Callable[[list[int], Finish | None], None]
    watch: Callable[[list[int]], int | None] | None = None
    cancelled: bool = False  # set by the caller (e.g. its client disconnected); the engine frees the slot
    slot: int = -1
    sent: int = 0  # tokens handed to emit so far
    cached: int = 0  # prompt tokens resumed from the prefix cache
    done: int = 0  # prompt tokens prefilled so far (cached ones included)
    row: Prefix | None = None  # the prompt's one-row prefill while it is prefilled in chunks
    reply: list[int] = dataclasses.field(default_factory=list)  # the tokens handed to emit so far
    checkpoint: tuple | None = None  # (tokens processed, boundary snapshot) of its row before a step that can take
    # it past max_tokens: what the prefix cache keeps when that step's row has processed tokens past its end
    marks: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # per step: (tokens out, steps,
    # accepted drafts) of its row, cumulative: which steps and drafts the first n tokens took (``figures``)

    def cancel(self) -> None:
        self.cancelled = True

    def figures(self, n: int) -> tuple[int, int]:
        """(verify steps, accepted drafts) that emitted the first ``n`` tokens: a step that emitted a drafts and
        the bonus, cut after its k-th token, counts min(a, k) of them (none after a stop or max_tokens)."""
        tokens = accepted = 0
        for out, steps, total in self.marks:
            if out >= n:
                return steps, accepted + min(total - accepted, n - tokens)
            tokens, accepted = out, total
        return (self.marks[-1][1], accepted) if self.marks else (0, 0)


@dataclasses.dataclass
class Stats:
    """The engine's own counters (``Engine.stats`` copies them): finished requests, their tokens and verify
    steps, engine steps, and a record per finished request (completion tokens, verify steps, reason) for the
    last ``FINISHED_KEPT`` of them (``requests`` counts them all)."""

    requests: int = 0
    completion_tokens: int = 0
    verify_steps: int = 0
    accepted_drafts: int = 0
    engine_steps: int = 0
    finished: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=FINISHED_KEPT))


class Engine:
    """Continuous batching of ``loop`` (a ``SpeculativeLoop`` whose spec has ``capacity`` and no stop ids:
    ``spec_for`` builds it) over ``slots`` rows with ``params`` = (target params, proposer params).

    ``submit`` queues a ``Job`` (at most ``max_queue`` waiting, else ``QueueFull``); ``stats`` keeps the records
    of the last ``keep`` finished requests; ``start`` runs the engine's thread; ``close`` stops taking requests
    and, with ``drain``, finishes every accepted one first.

    Prompts are prefilled in chunks of at most ``max_num_batched_tokens`` prompt tokens per engine iteration,
    between steps; None (auto): ``DEFAULT_BATCHED_TOKENS`` while no request runs, else the widest chunk that costs
    at most the step that follows (``_budget``). ``prefix_cache_bytes`` > 0 keeps prefilled prompts in a
    prefix cache of that many bytes (blocks of ``prefix_block`` tokens, None: ``prefix.DEFAULT_BLOCK`` or the
    largest power of two a chunk holds; snapshots where a chunk ends on a block boundary, at the last boundary
    before a prompt's last token, and a finished request's row after its prompt and reply (``_keep_reply``);
    ``decoding.prefix``): a request resumes from the deepest one its prompt matches (``Finish.cached`` tokens) and
    prefills the rest. When a request ends, running rows move into lower free slots (``_compact``).

    Speculation by load (``schedule.py``): each step runs one of ``options`` (blocks or tree budgets, default:
    the loop's own; each a loop of the same capacity whose block and width are at most ``loop``'s, which lays out
    the state) over the smallest of the ``rows`` buckets (default: all slots) that holds the running rows, which
    sit in the lowest free slots; the warm-up times every (rows, option) step, and ``schedule`` picks the one with
    the most expected tokens per second from those costs and the acceptance the steps report.
    """

    def __init__(self, loop: SpeculativeLoop, params, *, slots: int, max_model_len: int, max_queue: int,
                 keep: int = FINISHED_KEPT, options: Sequence[Option] | None = None,
                 rows: Sequence[int] | None = None, prior: Sequence[float] | None = None,
                 prefix_cache_bytes: int = 0, max_num_batched_tokens: int | None = None,
                 prefix_block: int | None = None):
        if slots < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {slots}")
        if max_queue < 1:
            raise ValueError(f"--max-queue-len must be >= 1, got {max_queue}")
        self.loop, self.params, self.slots = loop, params, slots
        self.max_model_len, self.max_queue = max_model_len, max_queue
        self._pending: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}
        self._free = list(range(slots))  # a heap: a request takes the lowest free slot (``schedule``'s rows buckets)
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._stats = Stats(finished=collections.deque(maxlen=keep))
        chunk = DEFAULT_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens
        if chunk < bucket_for(1):
            raise ValueError(f"--max-num-batched-tokens must be >= {bucket_for(1)}, got {chunk}")
        if prefix_block is None:  # the default block, or the largest power of two a chunk holds
            prefix_block = min(prefix_store.DEFAULT_BLOCK, 1 << (chunk.bit_length() - 1))
        if not 1 <= prefix_block <= chunk:
            raise ValueError(f"prefix cache block {prefix_block}: must be 1 .. --max-num-batched-tokens {chunk}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"--prefix-cache-size must be >= 0 bytes (0: no prefix cache), got {prefix_cache_bytes}")
        self.prefix_block, self.chunk = prefix_block, min(chunk, bucket_limit(max_model_len))
        self.auto_chunks = max_num_batched_tokens is None  # chunks sized by the steps' cost while requests run
        self.chunk_costs: dict[int, float] = {}  # seconds of a prompt chunk per width (``buckets``), at warm-up
        self.chunk_budget = self.chunk  # prompt tokens the last iteration that prefilled could take (``_budget``)
        self.budgets: collections.Counter = collections.Counter()  # iterations that prefilled, by their budget
        self.store = prefix_store.PrefixStore(prefix_block, prefix_cache_bytes) if prefix_cache_bytes else None
        self._layout = prefix_store.Layout.of(loop, params) if self.store else None
        self._replies = self.store is not None and prefix_store.keeps_replies(loop)  # finished rows kept too
        self._no_logits = None  # [slots, V] zeros: the logits of ``_rows`` (made once)
        self._ahead: dict[int, concurrent.futures.Future] = {}  # prompt chunk width -> its compile (warm-up)
        self.moves = 0  # running rows moved into lower slots (``_compact``)
        self._prefilling: collections.deque[Job] = collections.deque()  # admitted (a slot held), prefilling
        spec = loop.spec
        options = tuple(options or (Option(spec.block_size, spec.tree_budget),))
        data = 1 if loop.mesh is None else dict(loop.mesh.shape).get("data", 1)
        rows = tuple(r for r in rows or (slots,) if r % data == 0 or r == slots)  # a mesh splits a step's rows
        bad = [o for o in options if o.block > spec.block_size or o.width > max(spec.block_size, spec.width)]
        if bad:
            raise ValueError(f"speculation option {bad[0].name} does not fit the state of block {spec.block_size} and "
                             f"verify width {spec.width}")
        if not all(1 <= r <= slots for r in rows) or slots not in rows:
            raise ValueError(f"--auto-rows {','.join(map(str, rows))}: rows buckets must be in 1..{slots} "
                             f"(--max-num-seqs) and include {slots}")
        self._loops = {o: dataclasses.replace(loop, spec=dataclasses.replace(spec, block_size=o.block,
                                                                             tree_budget=o.budget)) for o in options}
        self.schedule = schedule.Schedule(options, rows, prior)
        self._last: Option | None = None  # the option of the last step (whose acceptance the next snapshot shows)
        self.state = self._empty_state()
        self._seen = None  # [slots, block] the histograms of accepted drafts already observed

    @staticmethod
    def capacity(max_model_len: int, width: int) -> int:
        """The cache length of every slot: the largest prompt bucket plus max_model_len new tokens and the verify
        width ``width`` (the block, or max(block, N + 1) for a draft tree of N nodes: the tokens one verify writes;
        ``SpeculativeLoop.capacity``'s rule for any prompt, a multiple of 128 on a TPU; a request's prompt +
        max_tokens <= max_model_len)."""
        return tile_capacity(bucket_limit(max_model_len) + max_model_len + width, jax.default_backend())

    def buckets(self) -> list[int]:
        """The widths a prompt chunk is padded to (one prefill program each): powers of two from 16, the last one
        the chunk (``--max-num-batched-tokens``)."""
        out, b = [], bucket_for(1)
        while b < self.chunk:
            out.append(b)
            b *= 2
        return out + [self.chunk]

    def _next_chunk(self, prompt: list[int], done: int, budget: int | None = None, cached: int = 0) -> int:
        """Where the chunk of ``prompt`` after its first ``done`` tokens ends: at most ``budget`` (None: ``chunk``)
        tokens on, at the last block boundary it reaches unless at the prompt's end (inside the block when it reaches
        none: a budget below the block, the next chunk goes on from there), and, with the prefix cache, at the last
        boundary before the prompt's last token (where the cache keeps a snapshot: the one a resent prompt resumes
        from; a chunk more), unless the prompt resumed from a finished request's row (``cached`` not on a boundary:
        a conversation's next turn, which its own reply's row continues) and has reached no boundary since."""
        block, end = self.prefix_block, min(done + (budget or self.chunk), len(prompt))
        resend = (len(prompt) - 1) // block * block
        reply = cached % block != 0 and done // block == cached // block
        if self.store is not None and not reply and done < resend < end:
            return resend
        return end if end == len(prompt) or end // block * block <= done else end // block * block

    def _extend(self, row: Prefix, prompt: list[int], done: int, end: int | None = None) -> tuple[Prefix, int]:
        """``row`` after the chunk of ``prompt`` from ``done`` to ``end`` (None: ``_next_chunk``'s), and ``end``."""
        end = self._next_chunk(prompt, done) if end is None else end
        return self.loop.extend(self.params, row, *self._chunk(prompt[done:end])), end

    def _chunk(self, tokens: list[int]) -> tuple[jax.Array, jax.Array]:
        """(tokens [1, width], n [1]) of a chunk, padded to the smallest width that holds it."""
        width = next(w for w in self.buckets() if w >= len(tokens))
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(tokens)] = tokens
        n = np.array([len(tokens)], np.int32)
        if self.loop.mesh is not None:
            padded, n = parallel.shard_rows(self.loop.mesh, padded, n)
        return jnp.asarray(padded), jnp.asarray(n)

    def _launch(self, row: Prefix, sampling: SamplingConfig, seed: int) -> LoopState:
        """The one-row decode state of a prefilled ``row``: the first token chosen with its own settings and ``seed``
        (``seed_key``: a seed under 2**31 draws as ``generate --seed`` does)."""
        return self.loop.start(self.params, row, jnp.asarray(seed_key(seed)), RowSampling.of([sampling]))

    def _prefill(self, prompt: list[int], sampling: SamplingConfig, seed: int) -> LoopState:
        """A one-row state of ``prompt``, prefilled in chunks without the prefix cache, and its first token."""
        row, done = self.loop.empty(self.params, 1), 0
        while done < len(prompt):
            row, done = self._extend(row, prompt, done)
        return self._launch(row, sampling, seed)

    def _empty_state(self) -> LoopState:
        """``slots`` free rows (each a copy of a one-token prefill, marked finished so no step changes it)."""
        row = self._prefill([0], SamplingConfig(), 0)
        state = jax.tree.map(lambda x: jnp.repeat(x, self.slots, 0) if x.ndim and x.shape[0] == 1 else x, row)
        # not weak-typed (as jnp.full's would be): a step's and insert's finish is not, and insert compiles once
        return dataclasses.replace(state, finish=jnp.asarray(np.full(self.slots, FinishReason.STOP, np.int32)))

    def warmup(self, progress: Callable[[str], None] | None = None,
               costs: tuple[dict[tuple[int, Option], float], float, dict[int, float]] | None = None) -> None:
        """Compiles every program serving runs (prefill per bucket, insert, a step per rows bucket and option, the
        host copies), so that no request waits for a compilation, and times each step for ``schedule``'s cost
        table (each step's own time, plus the host copy every step waits for) and each prompt chunk width for
        ``_budget`` (interleaved with the steps); the slots stay free. The prompt
        chunk and step programs compile on a pool of threads, one per core (XLA compiles one program on one core),
        while this thread runs the prefill programs in turn. ``costs``: (the table, the host copy's seconds, the
        chunks' seconds by width) an earlier start of this configuration measured (``cost_cache``), used instead of
        timing them again.
        ``progress(message)`` hears of each program as it compiles."""
        say = progress or (lambda message: None)
        prefill, programs = self._prefill_programs(), self.schedule.programs()
        total = len(prefill) + len(programs)
        # the state as a step will see it (a step's output is committed to its devices when any input is), so that
        # the program compiled here is the one run: the same shapes, and the same placement
        committed = any(getattr(x, "committed", False) for x in jax.tree.leaves((self.params, self.state)))
        shapes = functools.partial(jax.tree.map, lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, weak_type=getattr(x, "weak_type", False), sharding=x.sharding if committed else None))
        state, row = shapes(self.state), shapes(self.loop.empty(self.params, 1))

        # (a bound jitted method's .lower drops its self)
        def compile_chunk(width: int) -> None:  # a chunk continues a row of the empty row's shapes
            SpeculativeLoop.extend.lower(self.loop, self.params, row, *self._chunk([0] * width)).compile()

        def compile_step(rows: int, option: Option) -> None:
            SpeculativeLoop.step_rows.lower(self._loops[option], self.params, state, rows).compile()

        pool = concurrent.futures.ThreadPoolExecutor(_cores(), "dflash-jax-compile")
        try:
            self._ahead = {w: pool.submit(compile_chunk, w) for w in self.buckets()[::-1]}  # the longest first
            steps = {p: pool.submit(compile_step, *p) for p in programs}
            for k, (what, run) in enumerate(prefill, 1):
                say(f"program {k} of {total}: {what}")
                run()
            self.state = self._free_rows(self.state, np.ones(self.slots, bool))
            for k, (rows, option) in enumerate(programs, len(prefill) + 1):
                say(f"program {k} of {total}: a step of {rows} rows at {option.name}")
                steps[rows, option].result()
                self._time_step((rows, option))
        finally:
            self._ahead = {}
            pool.shutdown(wait=False, cancel_futures=True)  # after an error: the compiles not begun are dropped
        parallel.host(self._snapshot())  # the host copy after each step, compiled whether or not steps are timed
        if costs is None:
            widths = self.buckets()
            say(f"timing {len(programs)} steps and {len(widths)} prompt chunks")
            measured = schedule.measure(lambda p: self._time_chunk(p) if isinstance(p, int) else self._time_step(p),
                                        [*programs, *widths])
            copy = schedule.measure(lambda _: parallel.host(self._snapshot()), [None])[None]
            costs = {p: measured[p] + copy for p in programs}, copy, {w: measured[w] for w in widths}
        self.schedule.costs, self.schedule.copy, self.chunk_costs = costs
        log.info("speculation by load: step costs by rows bucket and option (1: plain decoding; ddtree:N: a draft "
                 "tree of N nodes), the host copy of %.2f ms included:\n%s", self.schedule.copy * 1e3,
                 self.schedule.table())
        log.info("prompt chunks: %s; %s", ", ".join(f"{w} tokens {c * 1e3:.2f}ms" for w, c in self.chunk_costs.items()),
                 "while requests run, each iteration prefills the widest costing at most the running rows' step, else "
                 f"{self.chunk} tokens (--max-num-batched-tokens auto)" if self.auto_chunks else
                 f"up to {self.chunk} tokens per iteration (--max-num-batched-tokens {self.chunk})")

    def _prefill_programs(self) -> list[tuple[str, Callable[[], None]]]:
        """(what, run) of each program that admitting a request runs, in order (an empty row, a prompt chunk per
        width, with the prefix cache its copies and restores of a page and a boundary, the first token and the
        insertion into a slot: slot 0, left for the caller to free); each run compiles one."""
        held, store, layout = {}, prefix_store, self._layout

        def chunk(width):
            if width in self._ahead:
                self._ahead[width].result()  # compiled on the warm-up's pool: run it, do not compile it twice
            held["row"] = self.loop.extend(self.params, held["row"], *self._chunk([0] * width))

        def first():
            held["state"] = self._launch(held.pop("row"), SamplingConfig(), 0)

        programs = [("an empty prompt row", lambda: held.update(row=self.loop.empty(self.params, 1)))]
        programs += [(f"a prompt chunk of {w} tokens", lambda w=w: chunk(w)) for w in self.buckets()]
        if self.store is not None:
            block = self.prefix_block
            programs += [
                ("prefix cache: a page copied",
                 lambda: held.update(page=store.cut(layout, held["row"], 0, size=block))),
                ("prefix cache: a boundary copied", lambda: held.update(boundary=store.snapshot(layout, held["row"]))),
                ("prefix cache: a page restored", lambda: held.update(row=store.paste(layout, held["row"],
                                                                                      held["page"], 0))),
                ("prefix cache: a boundary restored", lambda: held.update(row=store.resume(layout, held["row"],
                                                                                           held["boundary"])))]
        programs += [("the first token", first),
                     ("a request into a slot", lambda: setattr(self, "state", self.loop.insert(
                         self.state, held.pop("state"), jnp.asarray(0, jnp.int32)))),
                     ("a running row into a lower slot", lambda: setattr(self, "state", self.loop.move(
                         self.state, jnp.asarray(0, jnp.int32), jnp.asarray(0, jnp.int32))))]
        if self._replies:
            programs += [("prefix cache: a finished row copied", lambda: (
                store.cut(layout, self._rows(), 0, size=self.prefix_block, row=0),
                store.snapshot(layout, self._rows(), 0)))]
        return programs

    def _time_chunk(self, width: int) -> None:
        """A prompt chunk of ``width`` tokens from an empty row, waited for (a request's first chunk: its row is made
        in the same iteration)."""
        jax.block_until_ready(self.loop.extend(self.params, self.loop.empty(self.params, 1), *self._chunk([0] * width)))

    def _time_step(self, program: tuple[int, Option]) -> None:
        rows, option = program
        self.state = jax.block_until_ready(self._loops[option].step_rows(self.params, self.state, rows))

    def _snapshot(self):
        n_out, finish, window = self.loop.recent(self.state)
        return n_out, finish, window, self.state.steps, self.state.accepted

    def _free_rows(self, state: LoopState, rows: np.ndarray) -> LoopState:
        """``state`` with ``rows`` [slots] bool marked finished: no later step changes them."""
        finish = jnp.where(jnp.asarray(rows), FinishReason.STOP, state.finish).astype(jnp.int32)
        return dataclasses.replace(state, finish=finish)

    # -- the caller's side (any thread) --

    def submit(self, job: Job) -> Job:
        """Queues ``job``; ``QueueFull`` when ``max_queue`` requests already wait, ``Closed`` when draining."""
        if not 1 <= len(job.prompt) < self.max_model_len:
            raise ValueError(f"prompt of {len(job.prompt)} tokens: must be 1 .. {self.max_model_len - 1} tokens "
                             f"(--max-model-len {self.max_model_len})")
        if job.max_tokens < 1 or len(job.prompt) + job.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens {job.max_tokens}: must be 1 .. {self.max_model_len - len(job.prompt)} "
                             f"for a prompt of {len(job.prompt)} tokens (--max-model-len {self.max_model_len})")
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"{len(self._pending)} requests are waiting (--max-queue-len {self.max_queue})")
            self._pending.append(job)
            self._cond.notify()
        return job

    def stats(self) -> dict:
        """The counters, and the slots and queue now."""
        with self._cond:
            s = dataclasses.replace(self._stats, finished=list(self._stats.finished))  # asdict copies it
            return dict(dataclasses.asdict(s), finished_kept=self._stats.finished.maxlen, active=len(self._active),
                        waiting=len(self._pending), slots=self.slots, block_size=self.loop.spec.block_size,
                        tree_budget=self.loop.spec.tree_budget, drafts_per_step=self.drafts_per_step,
                        speculation=self.schedule.as_dict(), prefilling=len(self._prefilling),
                        prefill=self.prefill_stats(), prefix_cache=self.prefix_cache_stats())

    def prefill_stats(self) -> dict:
        """/stats' "prefill": how prompts are chunked (``max_num_batched_tokens``: "auto" or the number given, ``cap``:
        the widest chunk), each chunk width's cost at warm-up and as served now (ms), the last iteration's budget
        (``_budget``: prompt tokens it could prefill) and the iterations that prefilled by their budget."""
        def ms(cost):
            return {str(w): round(cost(c) * 1e3, 3) for w, c in self.chunk_costs.items()}

        return dict(max_num_batched_tokens="auto" if self.auto_chunks else self.chunk, cap=self.chunk,
                    chunk_ms=ms(lambda c: c), chunk_ms_served=ms(self.schedule.served), budget=self.chunk_budget,
                    budgets={str(b): n for b, n in sorted(self.budgets.items())})

    def prefix_cache_stats(self) -> dict:
        """The prefix cache's counters (``PrefixStore.stats``; zeros when it is off)."""
        if self.store is None:
            return dict(hits=0, misses=0, evictions=0, bytes=0, capacity_bytes=0, entries=0, cached_tokens=0)
        return self.store.stats()

    @property
    def drafts_per_step(self) -> int:
        """Draft tokens each row's verify checks per step: block - 1 for a chain, the N nodes of a draft tree
        (``accepted_drafts`` over ``verify_steps`` x this is the acceptance rate SGLang reports)."""
        return self.loop.spec.width - 1

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dflash-jax-engine", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Blocks until the engine's thread ends: after ``close``, or on its own when the engine failed."""
        if self._thread is not None:
            self._thread.join()

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops taking requests; ``drain``: finishes the accepted ones first, else cancels them. Waits for the
        engine's thread (at most ``timeout`` seconds)."""
        with self._cond:
            self._closing = True
            if not drain:
                for job in [*self._pending, *self._prefilling, *self._active.values()]:
                    job.cancel()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine's thread --

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception:  # a bug or a device failure: every waiting caller gets an answer, not a hang
            log.exception("the engine failed; aborting every request")
            with self._cond:
                jobs, self._closing = [*self._pending, *self._prefilling, *self._active.values()], True
                self._pending.clear()
                self._prefilling.clear()
                self._active.clear()
            for job in jobs:
                job.emit([], Finish("abort", job.sent, *job.figures(job.sent), job.cached))

    def _iterate(self) -> bool:
        """Admits waiting requests into free slots, prefills a chunk of the admitted prompts (``_prefill_some``),
        hands out what the last step emitted, steps; False once closed and empty."""
        with self._cond:
            while not self._pending and not self._active and not self._prefilling:
                if self._closing:
                    return False
                self._cond.wait()
            admit = []
            while self._pending and self._free:
                job = self._pending.popleft()
                if job.cancelled:
                    self._finish(job, Finish("abort", 0, 0, 0))
                    continue
                job.slot = heapq.heappop(self._free)
                admit.append(job)
        for job in admit:
            self._admit(job)
        self._prefill_some()
        served = time.perf_counter()  # what the step costs the iteration, the prefill aside (``schedule.timed``)
        n_out, finish, window, steps, accepted = parallel.host(self._snapshot())
        self._observe(accepted)
        # A step emits at most a block of tokens (a chain's block - 1 drafts and the bonus; a tree's path is at most
        # block - 1 deep): the histogram of accepted drafts [slots, block] and the window [slots, block] hold it.
        block = self.loop.spec.block_size
        drafts = (accepted * np.arange(block)).sum(-1)  # [slots] drafts each row's steps accepted
        done = np.zeros(self.slots, bool)
        for slot, job in list(self._active.items()):
            out = int(n_out[slot])
            if not job.marks or out > job.marks[-1][0]:
                job.marks.append((out, int(steps[slot]), int(drafts[slot])))
            start = max(out - block, 0)
            new = window[slot, job.sent - start:out - start].tolist()
            reason = None
            stops = [i for i, t in enumerate(new) if t in job.stop_ids]
            if stops:
                new, reason = new[:stops[0] + 1], "stop"
            if job.sent + len(new) >= job.max_tokens:
                new, reason = new[:job.max_tokens - job.sent], reason or "length"
            if new and job.watch is not None and (keep := job.watch(new)) is not None:
                new, reason = new[:keep], "stop"  # the caller's stop string ends at its keep-th token
            if reason is None and finish[slot] == FinishReason.NONFINITE:
                reason = "nonfinite"
            if reason is None and job.cancelled:
                reason = "abort"
            job.sent += len(new)
            job.reply += new
            if new:
                job.emit(new, None)
            if reason is None:
                continue
            if self._replies and reason != "nonfinite":
                self._keep_reply(job, slot, out)
            done[slot] = True
            with self._cond:
                del self._active[slot]
                heapq.heappush(self._free, slot)
                self._finish(job, Finish(reason, job.sent, *job.figures(job.sent), job.cached))
        if done.any():
            self.state = self._free_rows(self.state, done)
            self._compact()
        if self._active:
            with self._cond:  # /stats reads the schedule from another thread
                sampled = any(not job.sampling.greedy for job in self._active.values())
                left = [job.max_tokens - job.sent for job in self._active.values()]
                waiting = [job.max_tokens for job in self._prefilling]  # they join soon: the option is theirs too
                held = max([*self._active, *(job.slot for job in self._prefilling)]) + 1
                rows, self._last = self.schedule.choose(max(self._active) + 1, left, sampled, waiting, held)
            self._checkpoint(self._last.block)
            self.state = jax.block_until_ready(self._loops[self._last].step_rows(self.params, self.state, rows))
            with self._cond:
                self.schedule.timed(rows, self._last, time.perf_counter() - served)
            self._stats.engine_steps += 1
        return True

    def _admit(self, job: Job) -> None:
        """Starts prefilling ``job`` (its slot held): from the deepest snapshot of its prompt in the prefix cache,
        restored with every page before it, when there is one."""
        row = self.loop.empty(self.params, 1)
        if self.store is not None:
            hit = self.store.lookup(job.prompt)
            for b, page in enumerate(hit.pages):
                row = prefix_store.paste(self._layout, row, page, b * self.prefix_block)
            if hit.length:
                row = prefix_store.resume(self._layout, row, hit.boundary)
            job.cached = job.done = hit.length
        job.row = row
        self._prefilling.append(job)

    def _rows(self) -> Prefix:
        """The slots' rows as prefilled rows (``prefix.of_state``), to copy a finished request's from."""
        if self._no_logits is None:
            logits = jax.eval_shape(lambda: self.loop.empty(self.params, 1)).logits
            self._no_logits = jnp.zeros((self.slots,) + logits.shape[1:], logits.dtype)
        return prefix_store.of_state(self.state, self._no_logits)

    def _checkpoint(self, block: int) -> None:
        """Before a step of ``block`` (the most tokens it emits per row), copies the boundary of each running row it
        can take past its request's ``max_tokens`` (more than the tokens left + 1: its target would process tokens
        the client never gets) into ``Job.checkpoint``, for ``_keep_reply``. A running request has been handed
        every token its row emitted."""
        if not self._replies:
            return
        for slot, job in self._active.items():
            if job.max_tokens - job.sent + 1 < block:
                job.checkpoint = (len(job.prompt) + job.sent - 1,
                                  prefix_store.snapshot(self._layout, self._rows(), slot))

    def _keep_reply(self, job: Job, slot: int, out: int) -> None:
        """Stores the row of ``job`` (ended, its slot not yet reused; ``out`` tokens emitted by its row) in the
        prefix cache at the tokens its target processed, its prompt and reply, so that the conversation's next turn
        resumes after the reply. The row has processed its prompt and its first ``out - 1`` emitted tokens; when
        that runs past what ``job`` handed out (the last step emitted past a cut) it is stored as it was before
        that step (``Job.checkpoint``), else not at all (its state past the reply would never match)."""
        length, rows = len(job.prompt) + out - 1, self._rows()
        if out - 1 <= job.sent:
            boundary = lambda: prefix_store.snapshot(self._layout, rows, slot)  # noqa: E731
        elif job.checkpoint is not None:
            length, kept = job.checkpoint
            boundary = lambda: kept  # noqa: E731
        else:
            return
        block = self.prefix_block
        self.store.add(job.prompt + job.reply[:length - len(job.prompt)],
                       lambda b: prefix_store.cut(self._layout, rows, b * block, size=block, row=slot), boundary)

    def _budget(self) -> int:
        """Prompt tokens this iteration prefills: ``chunk``, or with auto chunks (``auto_chunks``), while any request
        runs and the costs are known, the widest chunk width whose cost (at warm-up, as served now:
        ``schedule.served``) is at most the step the running rows would run without the prompts (``schedule.pace``,
        as served now), and at least the narrowest width: a running stream then waits about two of its steps between
        two of its tokens while a prompt prefills, not a step and a chunk of ``chunk`` tokens, and the short steps
        run while requests join (``schedule``'s admitting) do not shrink their chunks."""
        step = self.schedule.pace
        if not (self.auto_chunks and self._active and self.chunk_costs and step is not None):
            return self.chunk
        widths = self.buckets()
        return max((w for w in widths if self.schedule.served(self.chunk_costs[w]) <= step), default=widths[0])

    def _prefill_some(self) -> None:
        """Prefills the admitted prompts' next chunks, oldest first, up to ``_budget`` tokens in all (so no running
        stream waits for more than that between two steps), and waits for them (the step after them is timed
        alone: ``schedule.timed``); the prefix cache keeps each chunk that ends at a block boundary. A prompt done
        gets its first token and joins the slots."""
        budget = left = self._budget()
        block = self.prefix_block
        while self._prefilling:
            job = self._prefilling[0]
            if job.cancelled:
                self._prefilling.popleft()
                with self._cond:
                    heapq.heappush(self._free, job.slot)
                    self._finish(job, Finish("abort", 0, 0, 0, job.cached))
                continue
            end = self._next_chunk(job.prompt, job.done, budget, job.cached)
            if end - job.done > left:
                break
            left -= end - job.done
            job.row, job.done = self._extend(job.row, job.prompt, job.done, end)
            if self.store is not None and job.done % block == 0:
                row = job.row
                self.store.add(job.prompt[:job.done],
                               lambda b, row=row: prefix_store.cut(self._layout, row, b * block, size=block),
                               lambda row=row: prefix_store.snapshot(self._layout, row))
            if job.done == len(job.prompt):
                self._prefilling.popleft()
                row, job.row = self._launch(job.row, job.sampling, job.seed), None
                self.state = self.loop.insert(self.state, row, jnp.asarray(job.slot, jnp.int32))
                with self._cond:
                    self._active[job.slot] = job
        if left < budget:
            with self._cond:  # /stats reads them from another thread
                self.chunk_budget = budget
                self.budgets[budget] += 1
            jax.block_until_ready((self.state, [job.row for job in self._prefilling]))

    def _compact(self) -> None:
        """Moves the highest running row into the lowest free slot while that lets the steps run over a smaller rows
        bucket (``schedule.bucket``): a request that outlives those below it no longer holds its burst's bucket.
        The row (``loop.move``) and what the engine keeps of its slot (its request, its last histogram) go
        together; the old slot is freed."""
        while self._active and self._free and self._free[0] < max(self._active):
            src = max(self._active)
            if self.schedule.bucket(src + 1) == self.schedule.bucket(len(self._active)):
                return
            with self._cond:
                dst = heapq.heappop(self._free)
                job = self._active.pop(src)
                job.slot, self._active[dst] = dst, job
                heapq.heappush(self._free, src)
            self.state = self.loop.move(self.state, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))
            self.state = self._free_rows(self.state, np.arange(self.slots) == src)
            if self._seen is not None:
                self._seen[dst] = self._seen[src]
            self.moves += 1

    def _observe(self, accepted: np.ndarray) -> None:
        """Tells ``schedule`` what the last step accepted: each row's histogram [slots, block] less what was
        seen before (a row inserted since starts from zero)."""
        delta = accepted - (0 if self._seen is None else self._seen)
        fresh = (delta < 0).any(-1)
        delta[fresh] = accepted[fresh]
        self._seen = accepted.astype(np.int64)
        if self._last is not None:
            with self._cond:
                self.schedule.observe(self._last, delta.sum(0))

    def _finish(self, job: Job, finish: Finish) -> None:
        """Counts a finished request and tells its caller (``self._cond`` held)."""
        s = self._stats
        s.requests += 1
        s.completion_tokens += finish.tokens
        s.verify_steps += finish.steps
        s.accepted_drafts += finish.accepted
        s.finished.append((finish.tokens, finish.steps, finish.reason))
        job.emit([], finish)


def seed_key(seed: int) -> np.ndarray:
    """Raw threefry key data [2] uint32 of a 64-bit ``seed`` (taken modulo 2**64): (high word, low word), the key
    ``jax.random.key(seed)`` makes with 64-bit integers on, so a seed under 2**31 gives ``generate --seed``'s."""
    seed %= 2**64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def _cores() -> int:
    """The cores this process may run on (the warm-up compiles that many step programs at once)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def bucket_limit(max_model_len: int) -> int:
    """The largest prompt bucket: the context, or the power of two above it when that is smaller than 16."""
    return max(bucket_for(1), max_model_len)


def spec_for(block_size: int, max_model_len: int, tree_budget: int | None = None):
    """The loop spec a server runs: no stop ids (the engine applies each request's), a fixed cache capacity;
    ``tree_budget`` N: a draft tree of N nodes of depth <= block_size - 1 per row and step (``SpecConfig``)."""
    spec = SpecConfig(block_size=block_size, max_new_tokens=max_model_len, stop_ids=(), tree_budget=tree_budget)
    return dataclasses.replace(spec, capacity=Engine.capacity(max_model_len, max(block_size, spec.width)))
