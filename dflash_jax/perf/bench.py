"""``dflash-jax bench``: the report's comparison (tau, tokens/s, speed-up over plain decoding) from one command.

Top of the data flow beside ``cli.py``: it loads a target (and a DFlash drafter and/or the target's
MTP head) through ``frontend.py``, turns a workload into token prompts in the format of z-lab's
benchmark client, and times the loop's own compiled phases, ``SpeculativeLoop.init`` (prefill) and
``SpeculativeLoop.decode`` (every step in one ``lax.while_loop``), for every method on the same prompts.

How the figures are made honest (``measure``): the first call of each method (compile + one run) is
timed apart; every timed run is preceded by a run of the same method (an untimed one where needed),
so each method is measured warm, as it runs back to back, however the methods are interleaved; the
clock starts only after the previous work is waited on; methods alternate order from batch to batch
and repeat to repeat, so machine drift hits all alike; each figure is the median over ``--repeats``
whole passes, with the spread. The per-step split into draft / verify / commit times the loop's
public phases ``draft``, ``check`` and ``settle`` one by one (each waited on), on the states the
loop's own ``step`` produces, each phase updating its state in place as the fused step does, and each
as it costs inside a loop: its program run once and ``PHASE_REPEATS`` times, the difference per repeat,
so what every call costs (and the fused loop never pays) is left out.
``--simulate-acceptance`` replaces the drafts by the plain-decoding
output with an error at fixed offsets (``OracleProposer``), while the real proposer still runs, so
tau is fixed and only kernel and loop cost differ. Beside each step time, its floor: one program running
exactly the step's matmuls at their own shapes, each weight a distinct buffer of its real size
(``roofline.step_floor_timer``), one window timed right after each timed run, so that each step time is
divided by a floor measured beside it (the machine's speed drifts by tens of % between minutes here);
beside each speed-up, the ceiling those floors allow at the
measured tau (``roofline.measured_ceiling``).

Outputs: a table on stdout, ``bench.json`` (settings, machine, versions, every number), then PNG plots.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import statistics
import time
import warnings
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import frontend, parallel
from dflash_jax.decoding.api import bucket_for, pad_prompts
from dflash_jax.decoding.loop import FinishReason, SpecConfig, SpeculativeLoop
from dflash_jax.decoding.proposers import OracleParams, OracleProposer
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.cache import split_pending, with_pending
from dflash_jax.perf import peers, roofline

AUTO = "dflash:auto"  # the DFlash method at the block ``--block-size auto`` picks per concurrency


def parse_methods(text: str) -> list:
    """'ar,mtp:3,dflash:16,dflash:auto,hf:ar,zlab:16' -> [frontend.Method | AUTO | peers.Peer]; ``ar`` is always
    measured (first), since speed-ups are relative to it."""
    methods, bad = [frontend.AR], []
    for item in text.split(","):
        try:
            method = AUTO if item.strip() == AUTO else peers.parse_peer(item) or frontend.parse_method(item, "")
        except ValueError as e:  # every bad item blamed at once
            bad.append(str(e).removeprefix(": "))
            continue
        if method == frontend.AR:
            continue
        if method in methods:
            bad.append(f"{item.strip()!r} is listed twice")
        methods.append(method)
    if bad:
        raise ValueError(f"--methods: {'; '.join(bad)}")
    return methods


@dataclasses.dataclass(frozen=True)
class SimulatedProposer:
    """Runs ``inner`` for its cost, but drafts what ``OracleProposer`` replays (fixed acceptance pattern).

    Its params are ``(inner params, OracleParams)``.
    """

    inner: object
    oracle: OracleProposer

    @property
    def taps(self):
        return self.inner.taps

    @property
    def max_block(self):
        return self.inner.max_block

    def init(self, *, params, view, prefill, prompts, prompt_lens, capacity):
        kw = dict(view=view, prefill=prefill, prompts=prompts, prompt_lens=prompt_lens, capacity=capacity)
        return self.inner.init(params=params[0], **kw), self.oracle.init(params=params[1], **kw)

    def propose(self, *, params, view, state, anchor, k, keys, sampling):
        kw = dict(view=view, anchor=anchor, k=k, keys=keys, sampling=sampling)
        real, _, inner = self.inner.propose(params=params[0], state=state[0], **kw)
        drafts, _, oracle = self.oracle.propose(params=params[1], state=state[1], **kw)
        # The real drafts are never -1, but XLA cannot know: this keeps the drafter's pass from being eliminated.
        return jnp.where(real == -1, real, drafts), None, (inner, oracle)

    def commit(self, *, params, view, state, verified, n):
        kw = dict(view=view, verified=verified, n=n)
        return (self.inner.commit(params=params[0], state=state[0], **kw),
                self.oracle.commit(params=params[1], state=state[1], **kw))

    def start(self, *, params, view, batch, capacity):
        kw = dict(view=view, batch=batch, capacity=capacity)
        return self.inner.start(params=params[0], **kw), self.oracle.start(params=params[1], **kw)

    def extend(self, *, params, view, state, chunk, tokens, n):
        kw = dict(view=view, chunk=chunk, tokens=tokens, n=n)
        return (self.inner.extend(params=params[0], state=state[0], **kw),
                self.oracle.extend(params=params[1], state=state[1], **kw))


def method_loop(target, proposer, pparams, spec: SpecConfig, mesh=None, *, simulate: bool = False):
    """(loop, params) of one method as every timed run builds it (bench, generate's comparison, the
    regime and the MXFP4 report): params placed on ``mesh`` for the real proposer (``shard_params``),
    the loop of ``spec`` on the same mesh. ``simulate``: the proposer runs inside ``SimulatedProposer``,
    whose params ``with_oracle`` completes."""
    params = parallel.shard_params((target.params, pparams), mesh, target.cfg, proposer)
    if simulate:
        proposer = SimulatedProposer(proposer, OracleProposer(target.cfg.vocab_size))
    return SpeculativeLoop.of(target, proposer, spec, mesh), params


def with_oracle(params, ar_tokens, block: int, accepted: tuple[int, ...]):
    """A simulated method's params: its own (placed) target and proposer params, and the oracle that
    replays ar's tokens [B, max_new] with ``accepted`` drafts accepted per step, cycled (``_oracle``)."""
    return params[0], (params[1], _oracle(ar_tokens, block, accepted))


def timed_run(loop, params, tokens, lengths, rng, clock=time.perf_counter):
    """(GenerateOutput, prefill seconds, decode seconds) of one run of the loop's compiled init and decode.

    Each phase's result is waited on before the clock is read, so no phase's time leaks into another's.
    """
    t0 = clock()
    state = jax.block_until_ready(loop.init(params, tokens, lengths, rng))
    t1 = clock()
    out = jax.block_until_ready(loop.decode(params, state)[0])
    return out, t1 - t0, clock() - t1


def _batch_params(params, b: int):
    """A method's params for batch b: one pair for all batches, or a list with one per batch (simulated)."""
    return params[b] if isinstance(params, list) else params


def _run_one(loop, params, batches, rng, b: int, clock):
    """``timed_run`` of batch b of ``batches`` [(tokens, lengths)]: the ``run`` that ``measure`` calls."""
    return timed_run(loop, _batch_params(params, b), *batches[b], rng, clock)


@dataclasses.dataclass
class Timing:
    """One method's runs over the batches: its first (compiling) run apart, then seconds per timed repeat."""

    first_s: float = 0.0  # the first call on batch 0: compile + one run
    warm_s: float = 0.0  # the call right after it, on the same batch: one warm run
    prefill_s: list[float] = dataclasses.field(default_factory=list)  # per repeat, summed over batches
    decode_s: list[float] = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)  # the last repeat's GenerateOutput per batch
    # With ``measure(floors=...)``, per timed run: (its decode seconds, its output, the floor window right after)
    paired: list[tuple[float, object, float]] = dataclasses.field(default_factory=list)

    @property
    def compile_s(self) -> float:
        return max(self.first_s - self.warm_s, 0.0)


def measure(runs: dict, batches: int, repeats: int, *, clock=time.perf_counter, progress=None,
            floors: dict | None = None) -> dict:
    """Times ``runs[name](batch, clock) -> (out, prefill_s, decode_s)`` warm, interleaved, repeated.

    Each run waits on its results. A method's first run (it compiles) and the warm run after it are
    timed apart (``Timing.compile_s`` is their difference). Each timed run follows a run of the same
    method (an untimed one where the previous run was another method's), so a method is always
    measured warm, never right after another method has evicted it from the caches; the order of
    methods alternates between batches and repeats (A B | B A | A B ...), so the runs paired by
    ``speedups`` sit next to each other in time and a busy machine's slow spells hit both alike.
    ``floors[name]()`` (seconds of one window of the method's floor program), where given, runs right
    after each timed run of that method, so each step time has a floor measured next to it
    (``Timing.paired``); it runs after the clock is read, so no timed run contains it.
    Returns ``{name: Timing}``.
    """
    names = list(runs)
    timing = {n: Timing() for n in names}
    for n in names:
        for field in ("first_s", "warm_s"):
            start = clock()
            runs[n](0, clock)
            setattr(timing[n], field, clock() - start)
    last = names[-1]  # the method of the previous run
    for r in range(repeats):
        sums = {n: [0.0, 0.0] for n in names}
        for b in range(batches):
            for n in (names if (r + b) % 2 == 0 else names[::-1]):
                if n != last:
                    runs[n](b, clock)  # untimed: this method warm right before its timed run
                out, prefill_s, decode_s = runs[n](b, clock)
                if floors and n in floors:
                    timing[n].paired.append((decode_s, out, floors[n]()))
                last = n
                sums[n][0] += prefill_s
                sums[n][1] += decode_s
                if r == repeats - 1:
                    timing[n].outputs.append(out)
                if progress is not None:
                    progress(n, r, b)
        for n in names:
            timing[n].prefill_s.append(sums[n][0])
            timing[n].decode_s.append(sums[n][1])
    return timing


def median_interval(values, confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``confidence`` interval of the median: order statistics x_(j) .. x_(n+1-j)
    with j the largest rank where P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2 ([min, max] when n is
    too small for any narrower one: up to 8 values at 95%)."""
    x, n = sorted(values), len(values)
    tail, j = 0.0, 0
    while j < n // 2 and tail + math.comb(n, j) / 2**n <= (1 - confidence) / 2:
        tail += math.comb(n, j) / 2**n
        j += 1
    j = max(j, 1)
    return x[j - 1], x[n - j]


def spread(values) -> dict:
    """{"median", "min", "max", "ci"} of a list of figures; ci: the median's 95% interval (``median_interval``)."""
    low, high = median_interval(values)
    return dict(median=round(statistics.median(values), 4), min=round(min(values), 4), max=round(max(values), 4),
                ci=[round(low, 4), round(high, 4)])


def speedups(timing: Timing, base: Timing, tokens: int, base_tokens: int, rows: int) -> dict:
    """Per-repeat ratios of tokens/s against ``base`` (paired repeat by repeat), decode-only and end to end.

    Decode-only leaves out each row's first token (prefill makes it), as z-lab's time per output token.
    """
    dec = [((tokens - rows) / d) / ((base_tokens - rows) / bd) for d, bd in zip(timing.decode_s, base.decode_s,
                                                                               strict=True)]
    e2e = [(tokens / (p + d)) / (base_tokens / (bp + bd)) for p, d, bp, bd in
           zip(timing.prefill_s, timing.decode_s, base.prefill_s, base.decode_s, strict=True)]
    return dict(decode=spread(dec), e2e=spread(e2e))


def mean_context(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The tokens a row's attention reads per step, averaged over the rows and the decode: its real prompt
    (not the padded bucket) and half the new tokens. The floors and ceilings use it."""
    return round(statistics.mean(len(p) for p in prompts) + max_new_tokens / 2)


def ceiling(method: frontend.Method, target_cfg, drafter_cfg, *, tau: float, batch: int, context: int, dtype: str):
    """The speed-up this machine allows at ``tau`` (``roofline.measured_ceiling``); None where it has no model.

    The roofline models plain decoding and DFlash steps; MTP's sequential head is not modelled.
    """
    if method.kind == "ar":
        return 1.0
    if method.kind != "dflash" or method.tree is not None:  # a tree's verify width is not modelled
        return None
    return round(roofline.measured_ceiling(target_cfg, drafter_cfg, block=method.block, tau=tau, batch=batch,
                                           context=context, dtype=jnp.dtype(dtype)), 3)


def compare(target, proposer, pparams, method: frontend.Method, prompts: list[list[int]], *, max_new_tokens: int,
            sampling: SamplingConfig, stop_ids: tuple[int, ...], seed: int, repeats: int, drafter_cfg,
            dtype: str, mesh=None) -> dict:
    """``method`` against plain decoding on the prompts as one batch, as ``dflash-jax generate`` reports it
    (on ``mesh`` when one is given: ``parallel.make_mesh``)."""
    tokens, lengths = pad_prompts(prompts, bucket_for(max(len(p) for p in prompts)),
                                  vocab_size=target.cfg.vocab_size)
    loops, params = {}, {}
    for m, prop, pp in ((method, proposer, pparams), (frontend.AR, *frontend.proposer_for(frontend.AR, target, None))):
        spec = SpecConfig(block_size=m.block, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                          tree_budget=m.tree)
        loops[m.name], params[m.name] = method_loop(target, prop, pp, spec, mesh)
    names = list(dict.fromkeys([method.name, "ar"]))  # --block-size 1: ar against itself, two timed runs
    runs = {f"{n}#{i}": functools.partial(_run_one, loops[n], params[n], [(tokens, lengths)], seed)
            for i, n in enumerate(names if len(names) == 2 else names * 2)}
    timing = measure(runs, 1, repeats)
    (m_key, m_t), (a_key, a_t) = timing.items()
    rows = len(prompts)
    n_m, n_a = (int(np.asarray(t.outputs[0].lengths).sum()) for t in (m_t, a_t))
    tau = float(np.mean(np.asarray(m_t.outputs[0].tau)))
    ratio = speedups(m_t, a_t, n_m, n_a, rows)
    context = mean_context(prompts, max_new_tokens)
    return dict(
        method=method.name, baseline="ar", repeats=repeats, rows=rows, tau=round(tau, 4),
        tokens=n_m, baseline_tokens=n_a,
        decode_tokens_per_s=spread([(n_m - rows) / d for d in m_t.decode_s]),
        baseline_decode_tokens_per_s=spread([(n_a - rows) / d for d in a_t.decode_s]),
        decode_speedup=ratio["decode"], e2e_speedup=ratio["e2e"],
        compile_s=dict(method=round(m_t.compile_s, 3), baseline=round(a_t.compile_s, 3)),
        ceiling=ceiling(method, target.cfg, drafter_cfg, tau=tau, batch=rows, context=context, dtype=dtype),
        same_tokens=m_t.outputs[0].token_lists() == a_t.outputs[0].token_lists(),
        greedy=sampling.greedy, backend=jax.default_backend(), load_average=load_average(), busy=busy_note())


def _fmt(s: dict, unit: str = "x") -> str:
    return f"{s['median']:.2f}{unit} ({s['min']:.2f}-{s['max']:.2f})"


def _fmt_ratio(s: dict) -> str:
    """A median ratio with the 95% interval of the median and the single runs' range."""
    return (f"{s['median']:.2f}x (median's 95% interval {s['ci'][0]:.2f}-{s['ci'][1]:.2f}; single runs "
            f"{s['min']:.2f}-{s['max']:.2f})")


def format_comparison(c: dict) -> str:
    """The CLI's summary of ``compare``: decode-only and end-to-end speed-ups with spread, ceiling, compile."""
    ceiling_text = ("n/a (the roofline models DFlash steps only)" if c["ceiling"] is None
                    else f"{c['ceiling']:.2f}x")
    lines = [f"[{c['method']} vs plain decoding on {c['backend']}, median (min-max) of {c['repeats']} warm runs each, "
             f"paired run by run; load average {c['load_average']} on {os.cpu_count()} cores:",
             f" decode-only {_fmt(c['decode_tokens_per_s'], '')} tok/s vs {_fmt(c['baseline_decode_tokens_per_s'], '')}"
             f" tok/s: speed-up {_fmt_ratio(c['decode_speedup'])}",
             f" end to end (prefill + decode): speed-up {_fmt_ratio(c['e2e_speedup'])}",
             f" ceiling on this machine at tau {c['tau']:.2f} (both steps at their matmul floors): {ceiling_text}; "
             f"compile (apart) {c['compile_s']['method']:.1f} s + {c['compile_s']['baseline']:.1f} s"]
    if c["greedy"] and not c["same_tokens"]:
        lines.append(" WARNING: greedy output differs from plain decoding")
    if c.get("busy"):
        lines.append(f" note: {c['busy']}")
    return "\n".join(lines) + "]"


# A phase's time is its cost inside a loop: each phase's program runs it once, then ``extra`` more times
# in a while loop; (seconds with PHASE_REPEATS - 1 extra) - (seconds with none), over PHASE_REPEATS - 1.
# The difference removes what every call costs whatever it computes (argument handling, dispatch, the
# wait: 0.3-1.5 ms a call on the CI machines, as much as MTP's whole 3-step draft), which the fused loop
# never pays.
PHASE_REPEATS = 8


def _repeat(body, params, carry, n):
    """``carry = body(params, carry)`` n ([] int32, traced) times in a while loop. Params and carry pass an
    optimization barrier first, so XLA cannot hoist the work that reads only unchanged inputs out of the
    loop (in the fused loop every step's inputs are new)."""
    return jax.lax.fori_loop(0, n, lambda _, c: body(*jax.lax.optimization_barrier((params, c))), carry)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _draft(loop, params, proposer_state, rest, extra):
    """``loop.draft`` 1 + extra times, each from the proposer state the last returned (``rest``: the state
    without it and the cache); the proposer state is donated and updated in place. Each repeat's whole
    result is carried, so none of its work is dead."""
    def once(p, c):
        r, d = c
        return r, loop.draft(p, dataclasses.replace(r, proposer=d.proposer))
    draft = loop.draft(params, dataclasses.replace(rest, proposer=proposer_state))
    return _repeat(once, params, (rest, draft), extra)[1]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _check(loop, params, cache, rest, draft, extra):
    """``loop.check`` 1 + extra times, each on the cache the last returned (verify reads none of its pending
    inputs); the target cache is donated: verify writes its K/V rows in place."""
    def once(p, c):
        r, d, v = c
        return r, d, loop.check(p, dataclasses.replace(r, cache=v.cache), d)
    verified = loop.check(params, dataclasses.replace(rest, cache=cache), draft)
    return _repeat(once, params, (rest, draft, verified), extra)[2]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2, 3, 4))
def _settle(loop, params, rest, draft, verified, extra):
    """``loop.settle`` 1 + extra times, each on the state the last returned: that state's cache (given the
    verified inputs pending again) and proposer state stand in for the verified cache and the draft's, so
    both are updated in place, never copied. The inputs are donated (settle reads neither the old cache nor
    the old proposer state)."""
    def once(p, c):
        s, d, v, pending = c
        s = loop.settle(p, s, dataclasses.replace(d, proposer=s.proposer),
                        dataclasses.replace(v, cache=with_pending(s.cache, pending)))
        return s, d, v, pending
    cache, pending = split_pending(verified.cache)
    state = dataclasses.replace(rest, cache=cache, proposer=draft.proposer)
    draft, verified = dataclasses.replace(draft, proposer=None), dataclasses.replace(verified, cache=None)
    return _repeat(once, params, (state, draft, verified, pending), 1 + extra)[0]


def _phases(loop, params, state, extra: int, clock) -> np.ndarray:
    """Seconds of [draft, verify, commit] from ``state``, each phase run 1 + extra times in its own program,
    waited on. They consume a copy of ``state`` (made untimed), which stays usable."""
    s = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    rest, extra = dataclasses.replace(s, cache=None, proposer=None), jnp.int32(extra)
    t0 = clock()
    d = jax.block_until_ready(_draft(loop, params, s.proposer, rest, extra))
    t1 = clock()
    verified = jax.block_until_ready(_check(loop, params, s.cache, rest, d, extra))
    t2 = clock()
    jax.block_until_ready(_settle(loop, params, rest, d, verified, extra))
    return np.asarray([t1 - t0, t2 - t1, clock() - t2])


def timed_phases(loop: SpeculativeLoop, params, state, clock=time.perf_counter,
                 repeats: int = PHASE_REPEATS) -> np.ndarray:
    """Seconds of [draft, verify, commit] of one step from ``state``, as inside a loop (``PHASE_REPEATS``):
    each phase's programs run once and ``repeats`` times, and the difference over ``repeats - 1`` is kept.

    As in the fused step, each phase updates the state parts it replaces in place (donated), so no phase
    pays for copying a cache; a repeat sees the state the one before it left: the same shapes and the same
    work (commit moves the positions on; nothing it computes depends on how far). ``state`` stays usable.
    """
    once = _phases(loop, params, state, 0, clock)
    return (_phases(loop, params, state, repeats - 1, clock) - once) / (repeats - 1)


def profile(loop: SpeculativeLoop, params, tokens, lengths, rng, clock=time.perf_counter) -> np.ndarray:
    """Seconds in [draft, verify, commit] of each of the loop's steps (``timed_phases``): [steps, 3].

    The state advances through the loop's own ``step`` (untimed), so the phases see exactly the
    states the on-device loop sees; the phases run once untimed first (their compilation).
    """
    s = jax.block_until_ready(loop.init(params, tokens, lengths, rng))
    with warnings.catch_warnings():  # settle's donated logits and GDN inputs have no output to reuse: freed
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        timed_phases(loop, params, s, clock)  # untimed: each phase is its own program, compiled on its first call
    steps = []
    while (np.asarray(s.finish) == FinishReason.RUNNING).any():
        steps.append(timed_phases(loop, params, s, clock))
        s = loop.step(params, s)
    return np.asarray(steps).reshape(-1, 3)


def _batches(n_prompts: int, concurrency: int) -> list[list[int]]:
    """Row indices per batch: prompts cycled to fill whole batches (as server benchmarks cycle the data set)."""
    n_batches = -(-n_prompts // concurrency)
    return [[(b * concurrency + r) % n_prompts for r in range(concurrency)] for b in range(n_batches)]


def _oracle(ar_tokens, block: int, accepted: tuple[int, ...]) -> OracleParams:
    """Replays ar's tokens [B, max_new] with the draft at offset a wrong, so a drafts are accepted (all if a >= k)."""
    continuation = jnp.pad(jnp.maximum(ar_tokens, 0), ((0, 0), (0, block)))  # -1 past a row's end
    return OracleParams(continuation=continuation, errors=jnp.asarray([min(a, block - 1) for a in accepted],
                                                                      jnp.int32))


def _cpu_model() -> str | None:
    """The CPU's model name and its widest vector extension (Linux's /proc/cpuinfo; None elsewhere): the
    floors and the ratios above them differ between the machines a CI kind is given."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    simd = next((f for f in ("avx512f", "avx2", "avx") if f in flags), None)
    return " ".join(x for x in (name, simd and f"({simd})") if x) or None


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_model": _cpu_model(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib"),
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}


def same_texts(outputs, base_outputs) -> list[bool]:
    """Per row, whether a method's tokens equal the baseline's; ``outputs``: one per batch (``Timing.outputs``),
    anything with ``token_lists()`` (the loop's ``GenerateOutput``, a peer's ``PeerOutput``)."""
    texts, base = ([x for o in outs for x in o.token_lists()] for outs in (outputs, base_outputs))
    return [x == a for x, a in zip(texts, base, strict=True)]


def bench_workload(workload, prompts, methods, target, drafters, args, progress, mesh=None, *, choose=None,
                   peer_models=None) -> list[dict]:
    """Every method at every concurrency on one workload's token prompts; one result dict per (method, conc).

    ``methods``: ``parse_methods``'s items; ``drafters``: {DFlash method (and ``AUTO``): its drafter}, so
    ``dflash:B`` and ``dflash2:B`` each run with their own. ``AUTO`` is resolved per concurrency by
    ``choose(prompts, batch) -> decoding.blocksize.Choice`` (``perf.step_cost.choose``: the CLI binds it), its
    reason printed; the chosen method's row says ``auto``. Peers run on ``peer_models`` (``peers.Models``), timed
    with the rest.
    """
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    stop_ids = () if args.ignore_eos else None
    bucket = bucket_for(max(len(p) for p in prompts))
    simulate = tuple(args.simulate_acceptance) if args.simulate_acceptance else None

    def drafter_of(m):  # the chosen auto block's drafter is auto's
        return drafters.get(m, drafters.get(AUTO)) if m.kind == "dflash" else None

    def cfg_of(m):
        return None if drafter_of(m) is None else drafter_of(m).cfg

    results = []
    for conc in args.concurrency:
        batches = _batches(len(prompts), conc)
        padded = [pad_prompts([prompts[i] for i in rows], bucket, vocab_size=target.cfg.vocab_size)
                  for rows in batches]
        chosen = None
        if AUTO in methods:
            chosen = choose(prompts, conc)
            print(f"dflash-jax bench: {workload} c={conc}: {chosen.reason()}", flush=True)
        auto_method = None if chosen is None else (
            frontend.AR if chosen.block == 1 else frontend.Method("dflash", chosen.block))
        loop_methods = list(dict.fromkeys([m for m in methods if isinstance(m, frontend.Method)]
                                          + ([auto_method] if auto_method else [])))
        peer_list = [m for m in methods if isinstance(m, peers.Peer)]
        loops, params = {}, {}
        for m in loop_methods:
            progress.set_postfix_str(f"{workload} c={conc}: building {m.name}")  # the phases the bar does not count
            spec = SpecConfig(block_size=m.block, max_new_tokens=args.max_new_tokens, sampling=sampling,
                              stop_ids=stop_ids, tree_budget=m.tree)
            loops[m], params[m] = method_loop(target, *frontend.proposer_for(m, target, drafter_of(m)), spec, mesh,
                                              simulate=simulate is not None and m.kind != "ar")
        if simulate:  # the oracles replay ar's output: one untimed ar pass first
            ar_tokens = [loops[frontend.AR].run(params[frontend.AR], t, n, args.seed).tokens for t, n in padded]
            for m in loop_methods[1:]:
                params[m] = [with_oracle(params[m], ar_tokens[b], m.block, simulate) for b in range(len(padded))]

        def show(m, r, b, conc=conc):
            progress.set_postfix_str(f"{workload} c={conc} repeat {r + 1} batch {b + 1} {m.name}")
            progress.update(1)

        context = mean_context(prompts, args.max_new_tokens)
        floors = {m: floor_timer(m, target.cfg, cfg_of(m), batch=conc, context=context, dtype=args.dtype)
                  for m in loop_methods if m.kind != "mtp" and m.tree is None}  # a tree's floor is not modelled
        runs = {m: functools.partial(_run_one, loops[m], params[m], padded, args.seed) for m in loop_methods}
        eos = () if args.ignore_eos else tuple(target.cfg.eos_token_ids)
        runs |= {p: peers.runner(p, peer_models, [[prompts[i] for i in rows] for rows in batches],
                                 max_new_tokens=args.max_new_tokens, stop_ids=eos, sampling=sampling, seed=args.seed)
                 for p in peer_list}
        progress.set_postfix_str(f"{workload} c={conc}: compiling and warming {len(runs)} methods (before the runs)")
        timing = measure(runs, len(padded), args.repeats, progress=show, floors=floors)
        phase = {}  # [steps, 3] per method: each profiled step's draft / verify / commit seconds
        for m in loop_methods:
            progress.set_postfix_str(f"{workload} c={conc}: profiling {m.name}'s phases (after the timed runs)")
            phase[m] = np.concatenate([np.zeros((0, 3))] + [
                profile(loops[m], _batch_params(params[m], b), *padded[b], args.seed)
                for b in range(min(args.profile_batches, len(padded)))])
        drafts = draft_floors({m: cfg_of(m) for m in loop_methods if cfg_of(m) is not None}, target.cfg,
                              batch=conc, context=context, dtype=args.dtype)
        ar = timing[frontend.AR]
        rows = sum(len(b) for b in batches)
        n_ar = sum(int(np.asarray(o.lengths).sum()) for o in ar.outputs)
        for m in loop_methods + peer_list:
            t = timing[m]
            n = sum(int(np.asarray(o.lengths).sum()) for o in t.outputs)
            tau_rows = [float(x) for o in t.outputs for x in np.asarray(o.tau)]
            same = same_texts(t.outputs, ar.outputs)
            ratio = speedups(t, ar, n, n_ar, rows)
            tau = float(np.mean(tau_rows))
            steps = sum(int(np.asarray(o.steps).sum()) for o in t.outputs)
            common = dict(
                workload=workload, concurrency=conc, method=m.name, kind=m.kind, block=m.block,
                tree=getattr(m, "tree", None),
                prompts=len(prompts), rows=rows, prompt_bucket=bucket, repeats=args.repeats, tokens=n,
                prefill_s=spread(t.prefill_s), decode_s=spread(t.decode_s),
                tokens_per_s=round(statistics.median((n - rows) / d for d in t.decode_s), 2),
                speedup=ratio["decode"]["median"], speedup_spread=ratio["decode"],
                e2e_tokens_per_s=round(statistics.median(n / (p + d) for p, d in zip(t.prefill_s, t.decode_s,
                                                                                     strict=True)), 2),
                e2e_speedup=ratio["e2e"]["median"], e2e_speedup_spread=ratio["e2e"],
                tau=round(tau, 4), tau_rows=[round(x, 4) for x in tau_rows], steps=steps,
                compile_s=round(t.compile_s, 3), first_run_s=round(t.first_s, 3),
                matches_ar=all(same) if sampling.greedy else None, mismatched_rows=len(same) - sum(same),
                auto=m == auto_method, block_choice=chosen.as_dict() if chosen and m == auto_method else None)
            if isinstance(m, peers.Peer):  # rows one at a time: a row's steps are iterations of its own loop
                results.append(dict(
                    common, peer=True, ceiling=None, tau_hist={}, accept_frac={}, step_ms=None, draft_floor_ms=None,
                    profiled_steps=0, loop_step_ms=round(statistics.median(t.decode_s) / max(steps, 1) * 1e3, 4),
                    loop_iterations=steps, floor_ms=None, floor_x=None, simulated=False))
                continue
            hist = sum(np.asarray(o.accepted).sum(0) for o in t.outputs)
            # the median is robust to slow spells; below zero (noise about a phase doing nothing) reads 0
            per_step = np.maximum(np.median(phase[m], axis=0), 0.0) if len(phase[m]) else np.zeros(3)
            # The while loop runs until a batch's last row finishes: its iterations are the rows' most steps.
            iterations = sum(int(np.asarray(o.steps).max()) for o in t.outputs)
            loop_ms = statistics.median(t.decode_s) / max(iterations, 1) * 1e3
            floor_ms, floor_x = paired_floor(t.paired)
            results.append(dict(
                common, peer=False,
                ceiling=ceiling(m, target.cfg, cfg_of(m), tau=tau, batch=conc,
                                context=context, dtype=args.dtype),
                tau_hist={str(i + 1): int(c) for i, c in enumerate(hist)},
                accept_frac={str(i): round(float(c) / max(hist.sum(), 1), 4) for i, c in enumerate(hist)},
                step_ms=dict(zip(("draft", "verify", "commit"), (per_step * 1e3).round(4).tolist(),
                                 strict=True)),
                draft_floor_ms=round(drafts[m] * 1e3, 4) if m in drafts else None,
                profiled_steps=len(phase[m]), loop_step_ms=round(loop_ms, 4), loop_iterations=iterations,
                floor_ms=None if floor_ms is None else round(floor_ms, 4),
                floor_x=None if floor_x is None else round(floor_x, 3),
                simulated=simulate is not None and m.kind != "ar"))
    return results


def floor_timer(method: frontend.Method, target_cfg, drafter_cfg, *, batch: int, context: int, dtype: str):
    """One window of the step's floor on this machine (seconds per run): its matmuls timed as one program
    at their own shapes (``roofline.step_floor_timer``); not for MTP (its sequential head is not modelled)."""
    return roofline.step_floor_timer(target_cfg, drafter_cfg if method.kind == "dflash" else None,
                                     block=method.block, batch=batch, context=context, dtype=jnp.dtype(dtype))


def draft_floors(drafter_cfgs: dict, target_cfg, *, batch: int, context: int, dtype: str, repeats: int = 7) -> dict:
    """{DFlash method: median seconds of its draft phase's floor} (``roofline.draft_floor_timer``) for
    ``drafter_cfgs`` ({method: its drafter's config}), the methods' windows taking turns, the order reversed every
    round, so drift hits all alike."""
    timers = {m: roofline.draft_floor_timer(target_cfg, cfg, block=m.block, batch=batch, context=context,
                                            dtype=jnp.dtype(dtype)) for m, cfg in drafter_cfgs.items()
              if m.kind == "dflash"}
    times = {m: [] for m in timers}
    for r in range(repeats):
        for m in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            times[m].append(timers[m]())
    return {m: statistics.median(t) for m, t in times.items()}


def paired_floor(paired) -> tuple[float | None, float | None]:
    """(median floor ms, median step / floor) of ``Timing.paired``: each run's seconds per while-loop
    iteration (its rows' most steps) over the floor window timed right after it; (None, None) if empty."""
    if not paired:
        return None, None
    ratios = [decode_s / max(int(np.asarray(out.steps).max()), 1) / floor for decode_s, out, floor in paired]
    return statistics.median(f for _, _, f in paired) * 1e3, statistics.median(ratios)


# The goals for the step on the XLA path: (what, how it is computed, limit, <= or >=).
STEP_GOALS = (("DFlash block-16 step / its floor", ("floor_x", "dflash:16", None), 1.3, "<="),
              ("plain-decoding step / its floor", ("floor_x", "ar", None), 2.0, "<="),
              ("DFlash draft ms, block 16 / block 4", ("draft", "dflash:16", "dflash:4"), 1.3, "<="),
              ("MTP draft ms, 15 steps / 3 steps", ("draft", "mtp:15", "mtp:3"), 3.0, ">="))


def format_goals(results: list[dict]) -> str:
    """Lines comparing the loop's step with its floor and the draft-time scaling against the goals above."""
    lines = []
    for key in dict.fromkeys((r["workload"], r["concurrency"]) for r in results):
        by = {r["method"]: r for r in results if (r["workload"], r["concurrency"]) == key}
        for what, (field, a, b), limit, sense in STEP_GOALS:
            if a not in by or (b is not None and b not in by):
                continue
            if field == "floor_x":
                value = by[a]["floor_x"]
                detail = f"{by[a]['loop_step_ms']:.2f} ms / {by[a]['floor_ms']:.2f} ms"
            else:
                den = by[b]["step_ms"]["draft"]
                value = by[a]["step_ms"]["draft"] / den if den > 0 else None
                detail = f"{by[a]['step_ms']['draft']:.2f} ms / {den:.2f} ms"
                floors = by[a].get("draft_floor_ms"), by[b].get("draft_floor_ms")
                if None not in floors:
                    floor_ratio = floors[0] / floors[1]
                    detail += f"; its matmuls alone: {floor_ratio:.2f}x"
                    if floor_ratio > limit:
                        detail += ", above the goal on this machine"
            if value is None:
                continue
            met = value <= limit if sense == "<=" else value >= limit
            lines.append(f"{key[0]} c={key[1]}: {what} = {value:.2f}x ({detail}); goal {sense} {limit} "
                         f"{'met' if met else 'NOT met'}")
    return "\n".join(lines)


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def busy_note() -> str | None:
    """A warning when other processes compete for the CPUs (load average above 1.5 x the cores): the
    timed runs are then noisy, however they are interleaved."""
    load = load_average()
    cores = os.cpu_count() or 1
    if load is None or load <= 1.5 * cores:
        return None
    return (f"the machine is busy (load average {load:.1f} on {cores} cores): other processes share the CPUs, "
            f"so single runs vary widely; read the spreads, and rerun on a quiet machine for firm figures")


def format_table(results: list[dict]) -> str:
    """One line per (workload, concurrency, method); ``*`` marks the block ``auto`` chose; a peer's texts that
    differ from ar's are said (``greedy==ar``), as every method's."""
    head = (f"{'workload':<10} {'conc':>4} {'method':<12} {'tau':>6} {'tok/s':>9} {'speedup (min-max)':>18} "
            f"{'ceiling':>7} {'e2e':>6} {'step ms':>7} {'x floor':>7} {'draft ms':>8} {'verify ms':>9} "
            f"{'commit ms':>9} {'compile s':>9}  greedy==ar")
    lines = [head, "-" * len(head)]
    for r in results:
        same = {True: "yes", False: f"NO ({r['mismatched_rows']} rows)", None: "n/a (sampled)"}[r["matches_ar"]]
        sp = r["speedup_spread"]
        ms = r["step_ms"] or dict.fromkeys(("draft", "verify", "commit"))
        ceil = "n/a" if r["ceiling"] is None else f"{r['ceiling']:.2f}x"
        floor = "n/a" if r["floor_x"] is None else f"{r['floor_x']:.2f}x"
        phases = " ".join(f"{'n/a' if ms[k] is None else f'{ms[k]:.2f}':>{w}}" for k, w in
                          (("draft", 8), ("verify", 9), ("commit", 9)))
        name = r["method"] + (" *" if r.get("auto") else "")
        lines.append(f"{r['workload']:<10} {r['concurrency']:>4} {name:<12} {r['tau']:>6.2f} "
                     f"{r['tokens_per_s']:>9.1f} {sp['median']:>6.2f}x ({sp['min']:.2f}-{sp['max']:.2f}) "
                     f"{ceil:>7} {r['e2e_speedup']:>5.2f}x {r['loop_step_ms']:>7.2f} {floor:>7} "
                     f"{phases} {r['compile_s']:>9.1f}  {same}")
    if any(r.get("auto") for r in results):
        lines.append("* the block --block-size auto chose for this concurrency (dflash:auto)")
    if any(r.get("peer") for r in results):
        lines.append("hf:ar / zlab:B: transformers' generate / z-lab's dflash_generate (PyTorch, rows one at a time) "
                     "on the same weights; step ms = decode s / target steps")
    return "\n".join(lines)


def _series(rows: list[dict], value: str) -> dict[str, list[tuple[int, float, str]]]:
    """{family (dflash, dflash2, mtp, ddtree, a peer's): [(tokens verified per step, value, method name)]} of the
    non-ar rows: each method under the name it was asked by, chains at their block, trees at N + 1."""
    series = {}
    for r in rows:
        if r["kind"] != "ar":
            width = r["tree"] + 1 if r.get("tree") else r["block"]
            series.setdefault(r["method"].split(":")[0], []).append((width, r[value], r["method"]))
    return {family: sorted(points) for family, points in series.items()}


def plot(results: list[dict], out: Path) -> list[str]:
    """tau vs tokens verified per step per workload and tokens/s vs the same per concurrency, each method labelled
    by its name (``dflash2:16``); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    concs = list(dict.fromkeys(r["concurrency"] for r in results))
    xlabel = "tokens verified per step (block; tree: N + 1)"

    def draw(ax, points, **kw):
        xs, ys, _ = zip(*points, strict=True)
        ax.plot(xs, ys, "o-" if len(points) > 1 else "o", **kw)
        for x, y, name in points:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)

    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.2), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        rows = [r for r in results if r["workload"] == w and r["concurrency"] == concs[0]]
        for points in _series(rows, "tau").values():
            draw(ax, points, label=", ".join(name for _, _, name in points))
        ax.set(title=w, xlabel=xlabel, ylabel="tau (tokens / target step)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 3.5), squeeze=False)
    for ax, c in zip(axes[0], concs, strict=True):
        for i, w in enumerate(workloads):
            rows = [r for r in results if r["workload"] == w and r["concurrency"] == c]
            for j, (family, points) in enumerate(_series(rows, "tokens_per_s").items()):
                draw(ax, points, color=f"C{(i * 5 + j) % 10}", label=f"{w} {family}")
            ax.axhline(next(r["tokens_per_s"] for r in rows if r["kind"] == "ar"), color=f"C{i}", ls=":",
                       label=f"{w} ar")
        ax.set(title=f"concurrency {c}", xlabel=xlabel, ylabel="output tokens/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=100)
    plt.close(fig)
    return ["tau.png", "tokens_per_s.png"]


TIMING = ("tokens_per_s: tokens after the first / seconds of the loop's compiled decode (SpeculativeLoop.decode, "
          "after prefill and the drafter's context prefill, as z-lab's TPOT), summed over batches, median over "
          "repeats; speedup: its ratio to ar's, paired repeat by repeat (median, with min/max in speedup_spread). "
          "e2e: all tokens / (prefill + decode) seconds. Every timed run follows a run of the same method (warm), "
          "methods alternate order (A B | B A); speedup_spread.ci: the median's 95% interval; compile_s (first "
          "run less a warm run) is excluded. ceiling: the "
          "speed-up this machine allows at the measured tau (roofline.measured_ceiling; DFlash only). step_ms: "
          "per-step draft / verify / accept+commit from the loop's public phases timed one by one as inside a loop "
          "(each phase's program run 1 and PHASE_REPEATS times, the difference per repeat: a call's fixed cost "
          "excluded), the median step of the first profile_batches batches; draft_floor_ms: the draft "
          "phase's matmuls alone in one program (roofline.draft_floor_timer), DFlash only. "
          "loop_step_ms: median decode seconds / while-loop "
          "iterations (the fused "
          "step as it runs); floor_ms: the median time of one program running exactly the step's matmuls at "
          "their own shapes, each weight a distinct buffer of its real size (roofline.step_floor_timer), one "
          "window right after each timed run; floor_x: the median over timed runs of the run's step time over "
          "the floor timed next to it. tau: mean over rows of tokens committed "
          "per target step. auto: the row of the block --block-size auto chose for this concurrency "
          "(block_choice: expected tokens/step, measured ms/step and tokens/s per candidate block). Peers (hf:ar, "
          "zlab:B; peer: true): PyTorch, rows one at a time, timed by the same measure; their decode seconds start "
          "when the first new token exists; loop_step_ms: decode seconds / target steps.")


def random_models(args, methods):
    """(target, drafter or None, target config path, drafter config path or None) for ``--random-config``:
    random weights from the config files alone, made on the device (``synthetic``); no checkpoint read."""
    from dflash_jax.perf import synthetic

    given = [f for f in ("model", "draft_model", "tokenizer", "prompts") if getattr(args, f)]
    if given:
        raise ValueError(f"--random-config builds the models and prompts itself: drop "
                         f"{', '.join('--' + f.replace('_', '-') for f in given)}")
    paths = [Path(p) for p in args.random_config.split(",")]
    if len(paths) > 2:
        raise ValueError(f"--random-config: expected TARGET_CONFIG[,DRAFTER_CONFIG], got {len(paths)} paths")
    for p in paths:
        if not p.exists():
            raise ValueError(f"--random-config {p}: does not exist")
    target_path, draft_path = paths[0], paths[1] if len(paths) == 2 else None
    cfg = synthetic.target_config(target_path)
    if any(m.kind == "dflash" for m in methods) and draft_path is None:
        raise ValueError("--random-config: DFlash methods need a drafter config: give TARGET_CONFIG,DRAFTER_CONFIG "
                         "(or --methods without dflash)")
    frontend.check_tree_fits(methods, cfg, "--methods")
    dtype = frontend.DTYPES[args.dtype]
    mtp = any(m.kind == "mtp" for m in methods) and cfg.mtp_num_hidden_layers > 0
    target = synthetic.random_target(cfg, dtype=dtype, mtp=mtp, seed=args.seed)
    drafter = None
    if any(m.kind == "dflash" for m in methods):
        drafter = synthetic.random_drafter(draft_path, target, seed=args.seed + 1)
        frontend.check_blocks(methods, drafter, draft_path)
    return target, drafter, target_path, draft_path if drafter is not None else None


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` uniform random token ids (ids 0 and 1 left out: often EOS / mask)."""
    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab_size, (n, length)).tolist()
