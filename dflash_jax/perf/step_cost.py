"""The cost of one loop step per block size on this machine and batch, measured: ``--block-size auto``'s cost input.

Sits in the measurement layer between the decoding core's choice (``decoding.blocksize``: pure, from
acceptance and costs) and the front ends (``dflash-jax generate`` and ``bench``). For each candidate
block it builds the loop of that block as every timed run does (``bench.method_loop``) and times
``blocksize.run_steps`` (the loop's own init, then its step in a device loop) with 1 step and with
enough steps (at least ``STEPS``) to take ``WINDOW`` longer: the difference per extra step is one step as the
fused decode loop runs it, with prefill and every call's fixed cost (dispatch, argument handling, the
wait) left out. Warm (each program runs untimed first: its compilation), interleaved (blocks in
alternating order, round by round, so the machine's drift hits all alike), the median over ``REPEATS``
rounds. The timed runs step exactly as often as asked (a row that reached its length steps on, doing
the same work), with no stop ids.

Where the drafter has no acceptance card the largest block's program, run once to its end first, is the
calibration too (its histogram of accepted drafts). With the acceptance known (card or calibration) the blocks
are sized in increasing order and a block is left untimed, and uncompiled, where it cannot win: a step's cost
grows with the block, so a block b above a sized block s emits at most E[tokens | b] / cost(s) per second, and
b is dropped where that bound is under ``PRUNE`` x the best rate sized so far (each sized cost bounded from
both sides, with the margin for a noisy sizing run). Results are kept in memory per (model key, batch,
backend, blocks, sampling, prompt bucket, tokens): a second choice in one process measures nothing. What it
costs: one compilation per block it times (~6 s each for the shipped pair on 2 cores), plus ~(2 + REPEATS) x
WINDOW of runs each; the reason line says how long it took. On a busy machine (compilations 3-4x slower) the
choice is bounded by ``BUDGET``: once it is spent, no further block is compiled (a block the calibration already
compiled is still sized: it costs no compilation) and no further timed round starts; the reason line names the
blocks left out so. ``progress`` (the front ends print it on stderr) hears of each phase as it starts.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import frontend
from dflash_jax.decoding import blocksize
from dflash_jax.decoding.api import bucket_for, pad_prompts
from dflash_jax.decoding.loop import SpecConfig
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.perf.bench import method_loop

STEPS = 4  # the fewest steps in the long run; the short run has 1
WINDOW = 0.3  # seconds: the long run's steps take at least this much more than the short run (doubling the
# steps until they do, at most MAX_STEPS), so that a busy machine's noise in a call's fixed cost (prefill,
# dispatch, thread wake-ups: 70-210 ms a call on the 2-core machine at load 20) is a small part of it; 4
# steps of a 2 ms plain step read 49 ms there
MAX_STEPS = 1024
REPEATS = 5  # rounds; each block's cost is the median of its per-round differences
PRUNE = 0.7  # a block whose bound on tokens/s is under this fraction of the best sized rate is not timed
BUDGET = 30.0  # seconds: ``choose``'s bound on the measurement (the module doc); the shipped pair's takes ~21 s quiet
_MEMO: dict = {}


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds per step (all rows) per block; the calibration histogram when one was asked for."""

    costs: dict[int, float]
    histogram: tuple[int, ...] | None
    seconds: float  # wall time of the measurement, compilation included (0 when cached)
    cached: bool = False
    untimed: tuple[int, ...] = ()  # blocks dropped by the bound (module doc): they cannot win
    compiled: int = 0  # programs compiled
    over_budget: tuple[int, ...] = ()  # blocks left unsized because the budget was spent
    rounds: int = REPEATS  # timed rounds run (fewer than asked when the budget was spent)


def rows_for(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """``batch`` rows: the prompts cycled (as the bench fills a batch)."""
    return [list(prompts[i % len(prompts)]) for i in range(batch)]


def measure(target, drafter, prompts: list[list[int]], *, batch: int, blocks, max_new_tokens: int,
            sampling: SamplingConfig = SamplingConfig(), calibrate: bool = False, acceptance=None, seed: int = 0,
            mesh=None, steps: int = STEPS, repeats: int = REPEATS, clock=time.perf_counter,
            budget: float | None = None, progress=None, size_smallest: bool = True) -> StepCosts:
    """Seconds per loop step at each of ``blocks`` that can win for ``batch`` rows of ``prompts`` (see the module
    doc); ``calibrate``: also the largest block's histogram of accepted drafts over a whole run, first;
    ``acceptance`` (a_k, from a card) or the calibration's lets it leave out blocks that cannot win. ``budget``
    (seconds, None: none) bounds the measurement as the module doc says; ``progress(message)`` hears each phase.
    ``size_smallest``: the smallest block is compiled and sized even past the budget (so that there is a choice);
    False where another drafter's choice already timed plain decoding and a block the calibration compiled will do.
    """
    if steps < 2 or repeats < 1:
        raise ValueError(f"steps must be >= 2 and repeats >= 1, got {steps} and {repeats}")
    start = clock()
    say = progress or (lambda message: None)
    spent = lambda: budget is not None and clock() - start > budget  # noqa: E731
    tokens, lengths = pad_prompts(rows_for(prompts, batch), bucket_for(max(len(p) for p in prompts)),
                                  vocab_size=target.cfg.vocab_size)
    programs = {}
    for block in blocks:
        method = frontend.AR if block == 1 else frontend.Method("dflash", block)
        spec = SpecConfig(block_size=block, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=())
        loop, params = method_loop(target, *frontend.proposer_for(method, target, drafter), spec, mesh)
        programs[block] = (loop, params)
    compiled = set()

    def run(block, n, until_done=False):
        loop, params = programs[block]
        compiled.add(block)
        return jax.block_until_ready(blocksize.run_steps(loop, params, tokens, lengths, seed, jnp.int32(n),
                                                         jnp.bool_(until_done)))

    def seconds(block, n):
        t0 = clock()
        run(block, n)
        return clock() - t0

    histogram = None
    if calibrate:
        say(f"calibrating the drafter's acceptance on these prompts: compiling and running block {max(blocks)}")
        histogram = tuple(int(c) for c in np.asarray(run(max(blocks), max_new_tokens, until_done=True)[0]))
        if sum(histogram):
            acceptance = blocksize.acceptance_from_histogram(histogram)
    # The sizing runs bound each sized block's step from both sides: at most the long run per step (fixed costs
    # included: the best rate is not overrated), at least its extra time over the short run per extra step (a
    # slow short run lowers it: fewer blocks dropped). A later block costs at least the largest lower bound.
    expected = lambda b: blocksize.expected_tokens(acceptance, b)  # noqa: E731
    long, at_most, at_least, untimed, over_budget = {}, {}, {}, [], []
    for block in sorted(blocks):  # untimed: each program's compilation, then warm runs doubling the long run's steps
        if acceptance is not None and at_most and expected(block) < \
                PRUNE * max(at_least.values()) * max(expected(b) / c for b, c in at_most.items()):
            untimed.append(block)
            continue
        if block not in compiled and spent() and (at_most or not size_smallest and compiled):
            over_budget.append(block)
            continue
        say(f"sizing block {block} at batch {batch}: "
            + ("timing its step" if block in compiled else "compiling its program, then timing its step"))
        run(block, 1)
        short, n = seconds(block, 1), steps
        while (took := seconds(block, n)) - short < WINDOW and n < MAX_STEPS:
            n *= 2
        long[block], at_most[block], at_least[block] = n, took / n, max(took - short, 0.0) / (n - 1)
    diffs = {b: [] for b in long}
    order = [b for b in blocks if b in long]
    rounds = 0
    say(f"timing blocks {', '.join(map(str, order))}: {repeats} interleaved rounds")
    for r in range(repeats):
        if r and spent():
            break
        rounds += 1
        for block in (order if r % 2 == 0 else order[::-1]):
            times = {n: seconds(block, n) for n in ((1, long[block]) if r % 2 == 0 else (long[block], 1))}
            diffs[block].append((times[long[block]] - times[1]) / (long[block] - 1))
            if diffs[block][-1] <= 0:  # noise larger than the steps: the long run per step bounds it above
                diffs[block][-1] = times[long[block]] / long[block]
    costs = {b: statistics.median(d) for b, d in diffs.items()}
    return StepCosts(costs=costs, histogram=histogram, seconds=clock() - start, untimed=tuple(untimed),
                     compiled=len(compiled), over_budget=tuple(over_budget), rounds=rounds)


def choose(target, drafter, prompts: list[list[int]], *, batch: int, key, draft_dir, max_new_tokens: int,
           sampling: SamplingConfig = SamplingConfig(), seed: int = 0, mesh=None,
           blocks=None, budget: float | None = BUDGET, progress=None,
           family: str = "dflash", size_smallest: bool = True,
           spent_before: float = 0.0) -> tuple[blocksize.Choice, StepCosts]:
    """The block ``auto`` picks for ``batch`` rows (``blocksize.choose_block``): acceptance from the card in
    ``draft_dir`` (when it was recorded for its weights at this temperature) or calibrated here, costs measured here (or
    remembered: ``key`` names the models, e.g. their folders and dtype). ``family``: the drafter's methods'
    name (``dflash``, ``dflash2``), for the reason line; ``size_smallest``: as ``measure`` takes it;
    ``spent_before``: seconds of ``budget`` that earlier choices (other drafters') already used."""
    blocks = tuple(blocks or blocksize.candidate_blocks(drafter.cfg.block_size))
    card = blocksize.read_card(draft_dir) if draft_dir is not None else None
    unused = None if card is None else ("recorded for other weights" if not card.fits(draft_dir) else
                                        f"recorded at temperature {card.temperature}"
                                        if card.temperature != sampling.temperature else None)
    if unused:
        card = None
    memo_key = (key, batch, jax.default_backend(), blocks, sampling, bucket_for(max(len(p) for p in prompts)),
                max_new_tokens, card is None)
    if memo_key in _MEMO:
        costs = dataclasses.replace(_MEMO[memo_key], seconds=0.0, cached=True)
    else:
        costs = measure(target, drafter, prompts, batch=batch, blocks=blocks, max_new_tokens=max_new_tokens,
                        sampling=sampling, calibrate=card is None, acceptance=None if card is None else card.acceptance,
                        seed=seed, mesh=mesh, budget=None if budget is None else max(budget - spent_before, 0.0),
                        progress=progress, size_smallest=size_smallest)
        _MEMO[memo_key] = costs
    if card is not None:
        acceptance, source = card.acceptance, f"from {blocksize.CARD} ({card.prompts})"
    elif not sum(costs.histogram):  # every row stopped at its first token: no evidence for any draft
        acceptance, source = (0.0,) * (max(blocks) - 1), "unknown: the calibration run took no step"
    else:
        acceptance = blocksize.acceptance_from_histogram(costs.histogram)
        source = f"calibrated on these prompts ({sum(costs.histogram)} steps at block {max(blocks)})"
    if unused:
        source += f" ({blocksize.CARD} unused: {unused})"
    timing = "remembered" if costs.cached else (f"measured in {costs.seconds:.1f} s, {costs.compiled} "
                                                f"program{'s' * (costs.compiled != 1)} compiled")
    if costs.untimed:
        timing += (f"; block{'s' * (len(costs.untimed) > 1)} {', '.join(map(str, costs.untimed))} not timed: under "
                   f"{PRUNE:.0%} of the best even at a smaller block's step cost")
    if costs.over_budget:
        timing += (f"; block{'s' * (len(costs.over_budget) > 1)} {', '.join(map(str, costs.over_budget))} not "
                   f"timed: the {budget:.0f} s budget of the choice was spent (a busy machine; --block-size N "
                   "runs block N)")
    if costs.rounds < REPEATS and not costs.cached:
        timing += f"; {costs.rounds} timed round{'s' * (costs.rounds > 1)} of {REPEATS} (the budget)"
    choice = blocksize.choose_block(acceptance[:max(blocks) - 1], costs.costs, batch=batch,
                                    source=f"{source}; step costs {timing}", blocks=blocks, family=family)
    return choice, costs
