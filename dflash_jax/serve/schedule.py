"""Speculation chosen by load, per step (``--block-size auto``): the block or tree budget each engine step runs.

Sits in the serving layer beside the engine (``engine.py``), which asks it before every step and tells it what
the step accepted; it holds no arrays and runs no program. Its inputs are two:

- The cost table: seconds per step for each (rows bucket, option), measured at warm-up on this machine
  (``measure``), each scaled by how much slower its served steps ran (``timed``: a served step's time is the
  whole iteration but for the prompts' prefill: the step, the host copy, handing out the tokens, the choice);
  a program not served yet is scaled by what the served ones show. A step runs the first R slots, R a rows
  bucket that holds every running row (the engine keeps them in the low slots), so its cost follows the load.
- The acceptance observed online: each step's histogram of accepted drafts (``observe``). For chains, per
  draft position k, the steps that reached k and those that accepted it (a step at block b that accepted a
  drafts reached positions 1 .. min(a + 1, b - 1)), so a block-16 step informs every smaller block and a
  block-4 step the first three positions (``blocksize.expected_tokens`` turns them into E[tokens | b]). For
  trees, each budget's own mean accepted depth. Evidence decays by ``DECAY`` per row-step that brings some, so it
  follows the workload: a step over 32 rows outweighs what came before it, the rows running now.

``choose(top, left)`` picks the option with the most expected tokens per second: the sum over the running rows of
E[tokens | option, the tokens the row may still emit] (a request that ends inside a block does not use all of it)
over the option's cost in the cheapest rows bucket that holds them (a smaller bucket copies its rows in and out,
which can cost more than running every slot). Plain decoding (block 1, E = 1) wins when nothing pays. While requests
are being prefilled (``waiting``), they join after a set number of iterations, whatever the steps run, so a long
step holds every one of them back: a step is then worth its tokens less what all the held requests would emit in its
time at the best rate for all of them, E x cost, and the option with the most of that runs (during a burst of
arrivals, a short step), unless an informative option has too little evidence (below). The prompts' chunks keep the
``pace``, the cost of the step the running rows would run without them (the engine sizes a chunk by it), so the
iterations a prompt takes do not depend on the short steps run meanwhile: sized by those, a burst's prompts would
prefill in many small chunks under many short steps, each iteration reading every weight twice. Every other option
is explored now and then, so its cost (and, for the longest chain and the trees, the acceptance) stays current: at
once while an informative one has little evidence (under ``MIN_EVIDENCE`` row-steps), else once what the
explorations lost adds up to at most ``EXPLORE_SHARE`` of the steps' time. A step of option o in place of the best
one c loses loss = cost(o) x (1 - rate(o) / rate(c)) seconds (rate: expected tokens per second) where freed slots
are refilled, but up to cost(o) - cost(c) where a wave of requests that arrived together ends with its slowest row
(a row that accepts nothing gains one token whatever ran), so it is taken as the larger of the two, and o is
explored after period = loss / cost(c) / EXPLORE_SHARE steps of c (block 16 over 32 rows where plain decoding is
best: ~300 steps, not ~60): without it, a server that chose block 1 under load would never learn that speculation
pays again, nor one that speculates that plain decoding now does.

Greedy rows decode exactly as plain decoding whatever option each step ran. A sampled row's tokens are an exact
sample under any sequence of options, but which sample depends on them (its random stream is drawn per step, and
the drafts differ), so a step with a sampled row runs the largest option: a seeded request then reproduces itself
and ``generate --seed`` at the method as given, at any load, and only all-greedy steps are chosen by load.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from dflash_jax.decoding import blocksize

ROUNDS = 3  # timed steps per program at warm-up (interleaved); a program's cost is their median
DECAY = 0.97  # the weight of older evidence, per row-step that brings new evidence of the same kind
EXPLORE_SHARE = 0.02  # exploring the other options loses at most this share of the steps' time (each)
PRIOR_STEPS = 1.0  # pseudo-steps of the prior acceptance (the drafter's card, else 0.5 per position)
MIN_EVIDENCE = 16.0  # row-steps of evidence an informative option gathers before its estimate is trusted
RECENT = 256  # choices /stats keeps (a burst of 32 requests of 32 tokens runs ~40 steps)
COST_WEIGHT = 0.2  # the weight of each served step in its program's served / warm-up ratio (and the overall one)


@dataclasses.dataclass(frozen=True, order=True)
class Option:
    """One way to run a step: a chain of ``block`` tokens (1: plain decoding), or a draft tree of ``budget`` nodes
    of depth <= block - 1."""

    block: int
    budget: int | None = None

    @property
    def name(self) -> str:
        return str(self.block) if self.budget is None else f"ddtree:{self.budget}"

    @property
    def width(self) -> int:
        """Tokens per row one verify of it checks."""
        return self.block if self.budget is None else self.budget + 1


def default_rows(slots: int) -> tuple[int, ...]:
    """Rows buckets: the powers of 4 below ``slots``, and ``slots``."""
    return tuple(sorted({slots} | {4**i for i in range(slots.bit_length()) if 4**i < slots}))


def options_for(block: int, budget: int | None, numbers: Sequence[int] | None = None) -> tuple[Option, ...]:
    """The options a server of ``block`` (and draft trees of ``budget`` nodes) weighs: ``numbers`` are blocks for
    a chain (1: plain decoding), budgets for a tree (0: plain decoding); default: plain decoding and the method
    itself. A clear error naming ``--auto-candidates`` for a number outside the method's."""
    top = block if budget is None else budget
    numbers = sorted({0 if budget is not None else 1, top} if numbers is None else set(numbers))
    bad = [n for n in numbers if not (0 if budget is not None else 1) <= n <= top]
    if bad:
        what = f"blocks 1..{block}" if budget is None else f"tree budgets 0..{budget} (0: plain decoding)"
        raise ValueError(f"--auto-candidates {','.join(map(str, numbers))}: {bad[0]} is outside the method's {what}")
    if budget is None:
        return tuple(Option(n) for n in numbers)
    return tuple(Option(1) if n == 0 else Option(block, n) for n in numbers)


def measure(run: Callable[[Hashable], None], keys: Sequence[Hashable], *, rounds: int = ROUNDS,
            clock=time.perf_counter) -> dict[Hashable, float]:
    """Seconds per call of ``run(key)`` (one engine step, waited for) for each key, warm: the median of ``rounds``
    timed calls, keys in alternating order round by round so the machine's drift hits all alike. Each key's
    program must already be compiled (the engine's warm-up runs each once first)."""
    times = {k: [] for k in keys}
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            t0 = clock()
            run(key)
            times[key].append(clock() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


class Schedule:
    """The chooser of one engine: ``options`` (``Option``s, all within the engine's state layout), ``rows``
    buckets, and ``prior`` a_k (the drafter's card) or None. ``costs`` (seconds per step at warm-up, the host copy
    included) is filled by the engine's warm-up; without it (``--no-warmup``) every step runs the largest option."""

    def __init__(self, options: Sequence[Option], rows: Sequence[int], prior: Sequence[float] | None = None):
        if not options or not rows:
            raise ValueError("a schedule needs at least one option and one rows bucket")
        self.options, self.rows = tuple(sorted(options)), tuple(sorted(rows))
        depth = max(o.block for o in self.options) - 1
        a = np.full(depth, 0.5) if prior is None else np.resize(np.asarray(prior, float), depth)
        self._reach = np.full(depth, PRIOR_STEPS)  # decayed steps that reached draft position k (k = 1 .. depth)
        self._passed = PRIOR_STEPS * a  # ... and accepted it
        self._seen = 0.0  # decayed row-steps of chain evidence (the prior's excluded)
        self._trees = {o: [0.0, 0.0] for o in self.options if o.budget is not None}  # decayed [steps, drafts]
        self._since = dict.fromkeys(self.options, 0)  # steps since an option last ran (or since the start)
        self.costs: dict[tuple[int, Option], float] = {}
        self.copy = 0.0  # seconds of the host copy each step waits for (in every cost)
        self._ratio: dict[tuple[int, Option], float] = {}  # served / warm-up seconds, per program served so far
        self._load = 1.0  # ... over every served step: the ratio of a program not served yet
        self.recent: collections.deque = collections.deque(maxlen=RECENT)
        self.counts: collections.Counter = collections.Counter()
        self.current: dict | None = None
        self.pace: float | None = None  # seconds of the step the running rows alone would run now (``choose``)

    def programs(self) -> list[tuple[int, Option]]:
        """Every (rows bucket, option) a step may run: the programs the warm-up compiles and times."""
        return [(r, o) for r in self.rows for o in self.options]

    def cost(self, rows: int, option: Option) -> float | None:
        """Seconds a served step of ``option`` over ``rows`` takes now: its warm-up cost x its served / warm-up ratio
        (a program not served yet: every served program's); None when it was not timed."""
        key = (rows, option)
        return self.costs[key] * self._ratio.get(key, self._load) if key in self.costs else None

    def served(self, seconds: float) -> float:
        """``seconds`` of another program timed at warm-up (a prompt chunk), as served now: scaled as a step program
        not served yet is (every served program's served / warm-up ratio)."""
        return seconds * self._load

    def bucket(self, top: int) -> int:
        """The smallest rows bucket holding slots 0 .. top - 1."""
        return next(r for r in self.rows if r >= top)

    def acceptance(self) -> np.ndarray:
        """a_k, k = 1 .. depth: the chance draft k is accepted once drafts 1 .. k-1 were (prior included)."""
        return self._passed / self._reach

    def expected(self, option: Option, left: int | None = None) -> float:
        """E[tokens per row per step] of ``option`` from the evidence so far, for a row that may emit at most
        ``left`` more (a step at block b emits min(T_b, left): T at block min(b, left))."""
        if option.budget is None:
            return blocksize.expected_tokens(self.acceptance(), min(option.block, left or option.block))
        steps, drafts = self._trees[option]
        mean = 1.0 + drafts / steps if steps else float(option.block)  # unseen: optimistic (explored at once)
        return min(mean, left or mean)

    def _informs(self, option: Option) -> bool:
        """Whether running ``option`` brings evidence ``choose`` needs: the longest chain (every position) or a
        tree (its own budget)."""
        longest = max((o.block for o in self.options if o.budget is None), default=1)
        return option.budget is not None or (option.block == longest > 1)

    def _starved(self, option: Option) -> bool:
        """Whether ``option`` informs ``choose`` (``_informs``) on too little evidence: under ``MIN_EVIDENCE``
        decayed row-steps behind its estimate."""
        evidence = self._seen if option.budget is None else self._trees[option][0]
        return self._informs(option) and evidence < MIN_EVIDENCE

    def choose(self, top: int, left: Sequence[int] | None = None, sampled: bool = False, waiting: Sequence[int] = (),
               held: int = 0) -> tuple[int, Option]:
        """(rows bucket, option) of the next step when slots 0 .. top - 1 hold every running row; ``left``: the
        tokens each running row may still emit (None: unbounded), so a block is not paid for where a request ends
        inside it; ``waiting``: the same for each request being prefilled, ``held`` the highest slot any request
        holds + 1 (while any is, a step is judged against what all of them would emit in its time: the module doc).
        ``sampled``: some row samples (temperature > 0): the step runs the largest option, the method as given, so
        that a seeded request reproduces itself whatever the load (the module doc)."""
        left = [None] if left is None else list(left)

        def cheapest(rows):  # {option: (its cheapest bucket holding ``rows`` rows, its cost there)}
            fits = [r for r in self.rows if r >= rows]
            return {o: min(((self.cost(r, o), r) for r in fits), key=lambda c: (math.inf if c[0] is None else c[0],
                                                                               c[1]))[::-1] for o in self.options}

        run, load = cheapest(top), cheapest(max(top, held))
        if sampled or any(c is None for _, c in load.values()):
            choice, why = max(self.options, key=lambda o: o.width), "sampled" if sampled else "untimed"
            rows = self.bucket(top)
            self.pace = run[choice][1]
        else:
            tokens = {o: sum(self.expected(o, n) for n in left) for o in self.options}  # this step's, all its rows
            rate = {o: tokens[o] / c for o, (_, c) in run.items()}
            best = min(self.options, key=lambda o: (-rate[o], o.width))
            self.pace = run[best][1]
            if waiting:  # they join after a set number of iterations, whatever the steps: the step that costs the
                # load least, its tokens less what every held request would have emitted in its time at the best rate
                full = max((tokens[o] + sum(self.expected(o, n) for n in waiting)) / c for o, (_, c) in load.items())
                choice = max(self.options, key=lambda o: (tokens[o] - full * run[o][1], -o.width))
                why = "admitting"
            else:
                choice, why = best, "best"
                for o in self.options:
                    if o == choice:
                        continue
                    period = self._loss(run[o][1], run[choice][1], rate[o] / rate[choice]) / run[choice][1] / \
                        EXPLORE_SHARE
                    if self._since[o] >= period:
                        choice, why = o, "explore"
                        break
            # an informative option on too little evidence runs first, admitting or not: its estimate (the prior's,
            # at first) would decide every step after this one
            starved = next((o for o in self.options if o != choice and self._starved(o)), None)
            if starved is not None:
                choice, why = starved, "explore"
            rows = run[choice][0]
        for o in self.options:
            self._since[o] += 1
        self._since[choice] = 0
        self.current = dict(rows=rows, top=top, active=len(left), waiting=len(waiting), choice=choice.name, why=why)
        self.recent.append([rows, choice.name, why, None])  # its served ms once ``timed``
        self.counts[f"{rows}x{choice.name}"] += 1
        return rows, choice

    @staticmethod
    def _loss(cost: float, best: float, rate: float) -> float:
        """Seconds a step of cost ``cost`` and ``rate`` x the best option's expected tokens per second loses in place
        of one of the best option (cost ``best``): cost x (1 - rate) where freed slots are refilled, but at least
        cost - best, what it loses when the requests' ends wait on a row that accepts nothing (every row gains at
        least the one token of any step): a wave of requests that arrived together ends with its slowest one."""
        return max(cost * (1 - rate), cost - best)

    def timed(self, rows: int, option: Option, seconds: float) -> None:
        """A served step of ``option`` over ``rows`` took ``seconds`` (all of its iteration but the prefill): the
        program's served / warm-up ratio, and every program's, move toward this one's, so that the table follows
        the machine's load and what serving adds to a step after warm-up."""
        key = (rows, option)
        if self.recent and self.recent[-1][:2] == [rows, option.name]:
            self.recent[-1][3] = round(seconds * 1e3, 3)
        if key in self.costs:
            ratio = seconds / self.costs[key]
            mine = self._ratio.get(key, self._load)
            self._ratio[key] = mine + COST_WEIGHT * (ratio - mine)
            self._load += COST_WEIGHT * (ratio - self._load)

    def observe(self, option: Option, histogram) -> None:
        """Evidence of one step of ``option``: ``histogram`` [W] steps (over the rows it ran) that accepted
        0 .. W-1 drafts."""
        h = np.asarray(histogram, float)
        if option.block == 1 or h.sum() <= 0:
            return
        keep = DECAY ** h.sum()  # per row-step: a step over every running row is a sample of the rows running now
        if option.budget is not None:
            tree = self._trees[option]
            tree[0] = keep * tree[0] + h.sum()
            tree[1] = keep * tree[1] + float((h * np.arange(h.size)).sum())
            return
        at_least = h[::-1].cumsum()[::-1]  # at_least[a]: steps that accepted >= a drafts
        depth = min(option.block - 1, self._reach.size)
        self._reach *= keep
        self._passed *= keep
        self._seen = keep * self._seen + h.sum()
        self._reach[:depth] += at_least[:depth]  # position k reached: >= k - 1 accepted
        self._passed[:depth] += at_least[1:depth + 1]  # position k accepted: >= k accepted

    def table(self) -> str:
        """The cost table and the expected tokens per step, for the start-up log."""
        head = "rows " + " ".join(f"{o.name:>10}" for o in self.options)
        lines = [f"{r:>4} " + " ".join(f"{self.cost(r, o) * 1e3:>8.2f}ms" if (r, o) in self.costs else f"{'-':>10}"
                                       for o in self.options) for r in self.rows]
        tokens = "E[tokens/step] " + ", ".join(f"{o.name}: {self.expected(o):.2f}" for o in self.options)
        return "\n".join([head, *lines, tokens])

    def as_dict(self) -> dict:
        """/stats' "speculation": the table (ms per step by rows bucket and option, as served now, and at warm-up),
        the acceptance and expected tokens per step now, the last choice, the recent choices ([rows, option, why,
        served ms]) and their counts."""
        def ms(cost):
            return {str(r): {o.name: round(cost(r, o) * 1e3, 3) for o in self.options if (r, o) in self.costs}
                    for r in self.rows}

        return dict(
            options=[o.name for o in self.options], rows=list(self.rows), step_ms=ms(self.cost),
            warmup_ms=ms(lambda r, o: self.costs[r, o]),
            acceptance=[round(float(a), 4) for a in self.acceptance()],
            expected_tokens={o.name: round(self.expected(o), 3) for o in self.options},
            current=self.current, counts=dict(self.counts), recent=[list(c) for c in self.recent])
