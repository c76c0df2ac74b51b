"""The engine's prefix cache and chunked prefill, measured (docs/serving.md, "Prefix caching and chunked prefill").

Sits on ``serve/engine.py`` (driven in process, no HTTP) and the shipped pair or a ``regime`` miniature:

- ``reuse``: multi-turn conversations (HumanEval-derived: each turn's user message is a HumanEval prompt, the
  assistant's reply the engine's own completion, and each turn resends the whole conversation), each turn served
  alone by an engine with the prefix cache and then by one without: time to first token per turn, and the hit
  rate.
- ``stall``: streams decoding while a long prompt arrives: the longest gap between their tokens over their median
  gap, with prefill in chunks (as served by default: sized by the steps' cost; or of a given size) and in one
  piece (a random-weight ``regime`` miniature, big enough that the prompt's prefill takes a good part of a second
  on a CPU).
- ``memory``: the process's resident memory while distinct prompts pass through a small store.

``dflash-jax report serve-prefix reuse --method dflash:16`` (and ``stall``, ``memory``; ``cli/serve_prefix.py``)
prints one JSON line.
"""

from __future__ import annotations

import collections
import random
import statistics
import threading
import time

import numpy as np

from dflash_jax import frontend
from dflash_jax.decoding import workloads
from dflash_jax.decoding.loop import SpeculativeLoop
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.serve.engine import Engine, Job, spec_for

WAIT_S = 900


def _engine(target, proposer, pparams, method, max_len, *, cache_bytes, chunk, slots=4, parts=None):
    """A warm engine, running; ``parts`` (a ``_Parts``) times its programs once warm."""
    loop = SpeculativeLoop.of(target, proposer, spec_for(method.block, max_len, method.tree))
    engine = Engine(loop, (target.params, pparams), slots=slots, max_model_len=max_len, max_queue=64,
                    prefix_cache_bytes=cache_bytes, max_num_batched_tokens=chunk)
    engine.warmup()
    if parts is not None:
        parts.attach(engine)
    engine.start()
    return engine


def _submit(engine, prompt, max_tokens, times=None):
    """Submits a greedy request; returns (done event, tokens list, result dict); ``times`` gets each emit's time."""
    got, result, done = [], {}, threading.Event()

    def emit(tokens, finish):
        if tokens:
            now = time.perf_counter()
            result.setdefault("first", now)
            if times is not None:
                times.extend([now] * len(tokens))
        got.extend(tokens)
        if finish is not None:
            result["finish"] = finish
            done.set()

    result["sent"] = time.perf_counter()
    engine.submit(Job(prompt=prompt, max_tokens=max_tokens, sampling=SamplingConfig(), seed=0, stop_ids=(),
                      emit=emit))
    return done, got, result


def _shipped(method_name):
    method = frontend.parse_method(method_name)
    drafts = frontend.ASSETS / ("dflash2" if method.dflash2 else "drafter")
    target, drafter = frontend.load_models(frontend.ASSETS / "target", drafts, [method], dtype=np.float32,
                                           progress=False)
    return method, target, *frontend.proposer_for(method, target, drafter)


MESSAGE = 120  # reuse: a user message's tokens (a HumanEval prompt's first 120)


def reuse(method_name: str, conversations: int = 8, turns: int = 6, reply: int = 32, chunk: int = 256) -> dict:
    """TTFT per turn with and without the prefix cache, interleaved: each turn goes to an engine with the cache
    (its reply, ``reply`` tokens, joins the conversation) and then, the same prompt, to one without (one token);
    medians over the conversations per turn, their ratio from the third turn on, the hit rate of the cached engine
    and the median tokens it resumed per turn (a turn resumes past the previous prompt when the previous reply's
    row was kept)."""
    if reply < 1 or turns < 3 or conversations < 1:
        raise ValueError(f"reuse: needs --reply-tokens >= 1 (got {reply}), 3 turns or more (got {turns}) and a "
                         f"conversation (got {conversations})")
    max_len = max(1024, 1 << (turns * (MESSAGE + reply)).bit_length())  # the last turn's prompt and reply fit
    method, target, proposer, pparams = _shipped(method_name)
    tok = frontend.load_tokenizer(frontend.ASSETS / "target")
    problems = [p["prompt"] for p in workloads.humaneval_rows()]
    users = [[frontend.encode(tok, problems[(c * turns + t) % len(problems)])[:MESSAGE] for t in range(turns)]
             for c in range(conversations)]
    engines = {cached: _engine(target, proposer, pparams, method, max_len, cache_bytes=1 << 30 if cached else 0,
                               chunk=chunk) for cached in (True, False)}
    grid = lambda: [[0.0] * turns for _ in range(conversations)]  # noqa: E731  [conversation][turn]
    ttft, cached_tokens, prompt_lens = {cached: grid() for cached in engines}, grid(), grid()
    for c in range(conversations):
        history = []
        for t in range(turns):
            history = history + users[c][t]
            prompt_lens[c][t] = len(history)
            for cached, engine in engines.items():
                done, got, result = _submit(engine, history, reply if cached else 1)
                assert done.wait(WAIT_S)
                ttft[cached][c][t] = result["first"] - result["sent"]
                if cached:
                    answer, cached_tokens[c][t] = got, result["finish"].cached
            history = history + answer
    hit = engines[True].stats()["prefix_cache"]
    for engine in engines.values():
        engine.close()

    def median(rows, t):
        return statistics.median(row[t] for row in rows)

    lookups = hit["hits"] + hit["misses"]
    return dict(method=method_name, conversations=conversations, turns=turns, reply=reply,
                ttft_ms_cached=[round(median(ttft[True], t) * 1e3, 1) for t in range(turns)],
                ttft_ms_uncached=[round(median(ttft[False], t) * 1e3, 1) for t in range(turns)],
                ratio_turn3_on=[round(median(ttft[True], t) / median(ttft[False], t), 3) for t in range(2, turns)],
                prompt_tokens=[median(prompt_lens, t) for t in range(turns)],
                resumed_tokens=[median(cached_tokens, t) for t in range(turns)],
                hit_rate=round(hit["hits"] / max(lookups, 1), 3), cached_tokens=hit["cached_tokens"],
                evictions=hit["evictions"])


class _Parts:
    """What a served engine's iterations are made of (``stall``): each prompt chunk (``extend``), first token
    (``start``), insert into a slot and step (``step_rows``) of its loops and each ``add`` to its prefix store, kept
    as (part, began, ended). Each is waited for as it is called, so a part's time is its own (the engine would let
    a chunk run on while the host copies the last step's tokens; ``add`` is timed as dispatched, its copies land
    in the part after it)."""

    NAMES = dict(extend="chunk", start="first token", insert="insert", step_rows="step")

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []

    def timed(self, part: str, fn):
        import jax

        def run(*args, **kwargs):
            began = time.perf_counter()
            out = jax.block_until_ready(fn(*args, **kwargs))
            self.spans.append((part, began, time.perf_counter()))
            return out
        return run

    def attach(self, engine: Engine) -> None:
        engine.loop = _Timed(engine.loop, self)
        engine._loops = {option: _Timed(loop, self) for option, loop in engine._loops.items()}
        if engine.store is not None:
            engine.store.add = self.timed("prefix store", engine.store.add)

    def within(self, begin: float, end: float) -> dict[str, float]:
        """Milliseconds per part of the spans inside [begin, end] (a gap between two tokens), the rest "other"
        (the host's copy of the step's tokens, handing them out, dispatches)."""
        ms = {}
        for part, a, b in self.spans:
            if begin <= a and b <= end:
                ms[part] = ms.get(part, 0.0) + (b - a) * 1e3
        ms["other"] = (end - begin) * 1e3 - sum(ms.values())
        return {part: round(v, 1) for part, v in ms.items()}

    def medians(self, begin: float, end: float) -> dict[str, float]:
        """The median milliseconds of each part begun in [begin, end]."""
        by = {}
        for part, a, b in self.spans:
            if begin <= a <= end:
                by.setdefault(part, []).append((b - a) * 1e3)
        return {part: round(statistics.median(v), 1) for part, v in by.items()}


class _Timed:
    """A loop whose ``_Parts.NAMES`` phases ``parts`` times."""

    def __init__(self, loop: SpeculativeLoop, parts: _Parts):
        self._loop, self._parts = loop, parts

    def __getattr__(self, name):
        attr = getattr(self._loop, name)
        part = _Parts.NAMES.get(name)
        return attr if part is None else self._parts.timed(part, attr)


def stall(miniature: str = "37m", prompt_len: int = 2000, streams: int = 2, chunk: int | None = None) -> dict:
    """The running streams' longest gap between tokens over their median gap while a ``prompt_len`` prompt
    prefills, with chunks of ``chunk`` tokens (None: as served by default, sized by the steps' cost) and with the
    prompt in one piece, on an engine as served by default (prefix cache on); the prompt's prefill time; the median
    gap while it prefills over the median gap; what the longest gap was made of (``_Parts.within``), each part's
    median while the prompt prefilled (``_Parts.medians``), and the engine iterations that prefilled it by their
    budget of prompt tokens with the chunks' warm-up costs (``Engine.prefill_stats``)."""
    import jax.numpy as jnp

    from dflash_jax.perf import regime, synthetic

    tcfg, _ = regime.MINIATURES[miniature]
    target = synthetic.random_target(tcfg, dtype=jnp.float32)
    method = frontend.AR
    proposer, pparams = frontend.proposer_for(method, target, None)
    rng = np.random.default_rng(0)
    out = dict(miniature=miniature, prompt_len=prompt_len, streams=streams)
    for name, size in (("chunked", chunk), ("whole", 2048)):
        parts = _Parts()
        engine = _engine(target, proposer, pparams, method, 2560, cache_bytes=1 << 30, chunk=size, parts=parts)
        times = [[] for _ in range(streams)]
        runs = [_submit(engine, rng.integers(2, 4000, 16).tolist(), 400, times[s]) for s in range(streams)]
        while min(len(t) for t in times) < 20:
            time.sleep(0.01)
        budgets = collections.Counter(engine.budgets)  # the streams' own prompts' iterations
        long_done, _, long_result = _submit(engine, rng.integers(2, 4000, prompt_len).tolist(), 1)
        assert long_done.wait(WAIT_S)
        for done, *_ in runs:
            assert done.wait(WAIT_S)
        engine.close()
        start, first = long_result["sent"], long_result["first"]
        worst, medians, during = (0.0, 0.0, 0.0), [], []  # worst: (gap / median, gap began, gap ended)
        for t in times:
            t = np.unique(t)
            gaps = np.diff(t)
            medians.append(float(np.median(gaps)))
            for a, b in zip(t[:-1], t[1:], strict=True):
                if start <= b <= first + 0.5:
                    during.append((b - a) / medians[-1])
                    worst = max(worst, ((b - a) / medians[-1], a, b))
        prefill = engine.prefill_stats()
        out[name] = dict(chunk=size or "auto", prefill_ttft_s=round(first - start, 3),
                         max_gap_over_median=round(worst[0], 2),
                         median_gap_ms=round(statistics.median(medians) * 1e3, 1),
                         prefilling_gap_over_median=round(statistics.median(during), 2),
                         longest_gap_ms=parts.within(*worst[1:]), prefill_median_ms=parts.medians(start, first),
                         budgets={str(b): n for b, n in sorted((engine.budgets - budgets).items())},
                         chunk_ms=prefill["chunk_ms"], chunk_ms_served=prefill["chunk_ms_served"])
    return out


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def memory(method_name: str = "dflash:16", requests: int = 1000, cache_mb: int = 64, max_len: int = 512) -> dict:
    """RSS every 100 of ``requests`` distinct prompts (64-300 tokens, one new token each) through a store of
    ``cache_mb``."""
    method, target, proposer, pparams = _shipped(method_name)
    engine = _engine(target, proposer, pparams, method, max_len, cache_bytes=cache_mb << 20, chunk=256)
    rng = random.Random(0)
    rss, held = [], []
    for i in range(requests):
        done, *_ = _submit(engine, [rng.randrange(2, 500) for _ in range(rng.randint(64, 300))], 1)
        assert done.wait(WAIT_S)
        if i % 100 == 99:
            rss.append(round(_rss_mb(), 1))
            held.append(engine.stats()["prefix_cache"]["bytes"] >> 20)
    stats = engine.stats()["prefix_cache"]
    engine.close()
    return dict(method=method_name, requests=requests, cache_mb=cache_mb, rss_mb_every_100=rss, store_mb=held,
                rss_growth_mb=round(max(rss) - rss[0], 1), evictions=stats["evictions"])
