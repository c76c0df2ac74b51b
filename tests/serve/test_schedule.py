"""Speculation chosen by load, per step (``serve/schedule.py`` and the loop's ``step_rows``): the chooser's rules on
synthetic cost tables and acceptance (no timing), and exactness when every step runs another block or budget over
another prefix of rows: greedy output equals plain decoding's."""

import dataclasses

import numpy as np
import pytest

from dflash_jax import frontend
from dflash_jax.decoding.api import generate
from dflash_jax.decoding.loop import SpeculativeLoop
from dflash_jax.serve import schedule
from dflash_jax.serve.engine import spec_for
from dflash_jax.serve.schedule import Option, Schedule

PLAIN, MID, BIG = Option(1), Option(4), Option(16)


def _schedule(costs, prior=None, options=(PLAIN, MID, BIG), rows=(1, 32)):
    s = Schedule(options, rows, prior)
    s.costs = {(r, o): costs[r][o] for r in rows for o in options}
    return s


def _accepting(s, option, a, steps):
    """``steps`` observed steps of ``option`` that each accepted ``a`` drafts."""
    for _ in range(steps):
        h = np.zeros(16)
        h[a] = 1
        s.observe(option, h)


def test_the_big_block_when_it_pays_plain_when_nothing_pays():
    costs = {1: {PLAIN: 1.0, MID: 1.1, BIG: 1.3}, 32: {PLAIN: 1.0, MID: 2.5, BIG: 9.0}}
    s = _schedule(costs)
    assert s.choose(1)[1] == BIG  # never seen: explored at once
    _accepting(s, BIG, 7, 100)  # 7 of 15 drafts accepted per step: E[16] = 8, E[4] = 4
    assert s.expected(BIG) == pytest.approx(8.0, abs=0.2) and s.expected(MID) == pytest.approx(4.0, abs=0.05)
    assert [s.choose(1) for _ in range(3)] == [(1, BIG)] * 3  # 8 / 1.3 beats 4 / 1.1 and 1 / 1.0
    assert s.choose(20) == (32, MID)  # rows bucket 32: 4 / 2.5 beats 8 / 9 and 1 / 1
    _accepting(s, BIG, 0, 200)  # nothing accepted any more: the evidence decays to it
    assert s.choose(32) == (32, PLAIN)
    assert s.choose(1)[1] == PLAIN  # 1 / 1.0 beats E[16] ~ 1 / 1.3
    _accepting(s, BIG, 15, 200)  # every draft accepted again: E[16] = 16
    assert s.choose(1, left=[16])[1] == BIG and s.choose(1, left=[1])[1] == PLAIN  # a row with 1 token left
    stats = s.as_dict()
    assert stats["step_ms"]["32"] == {"1": 1000.0, "4": 2500.0, "16": 9000.0} and stats["current"]["choice"] == "1"
    assert stats["counts"]["32x1"] == 1 and stats["recent"][-1] == [1, "1", "best", None]
    s.timed(1, PLAIN, 0.5)
    assert s.as_dict()["recent"][-1] == [1, "1", "best", 500.0]  # its served ms


def test_a_small_block_informs_only_its_positions_and_other_options_are_explored_within_their_share():
    costs = {1: {PLAIN: 1.0, MID: 1.1, BIG: 1.3}, 32: {PLAIN: 1.0, MID: 2.5, BIG: 9.0}}
    s = _schedule(costs, prior=[0.0] * 15)  # a card that says nothing is accepted
    _accepting(s, MID, 3, 100)  # every block-4 step accepts its 3 drafts: positions 1..3 certain, 4.. the prior
    assert s.acceptance()[:3] == pytest.approx([1.0] * 3, abs=0.01) and s.acceptance()[3] == 0.0
    assert s.expected(BIG) == pytest.approx(4.0, abs=0.05)
    # at bucket 32 MID's rate is 4 / 2.5 = 1.6 tokens/s; a step of BIG (4 / 9) loses 9 x (1 - 0.44 / 1.6) = 6.5 s
    # of MID's time, one of PLAIN (1 / 1) 1 x (1 - 1 / 1.6) = 0.375 s: explored after 6.5 / 2.5 / 0.02 = 130 and
    # 0.375 / 2.5 / 0.02 = 7.5 steps of MID, so each loses at most 2% of the time
    picks = [s.choose(32)[1] for _ in range(300)]
    assert [i for i, p in enumerate(picks) if p == BIG] == [130, 261]
    assert [i for i, p in enumerate(picks) if p == PLAIN][:3] == [8, 17, 26]
    lost = sum({BIG: 9.0 * (1 - (4 / 9) / 1.6), PLAIN: 1.0 * (1 - 1 / 1.6), MID: 0.0}[p] for p in picks)
    spent = sum(costs[32][p] for p in picks)
    assert 0.02 < lost / spent <= 2 * schedule.EXPLORE_SHARE  # two options, each within its share
    assert s.current == dict(rows=32, top=32, active=1, waiting=0, choice="4", why="best")


def test_a_costlier_option_over_many_rows_is_explored_by_what_it_can_cost_a_wave():
    """Plain decoding is best over 32 rows (32 / 0.09 s beats 32 x 5 / 0.6 s). Where freed slots are refilled a step
    of block 16 in its place loses 0.6 x (1 - 267 / 356) = 0.15 s, but a wave of 32 requests that arrived together
    waits for its slowest row, which may gain the one token a plain step gives it: up to 0.6 - 0.09 = 0.51 s. So
    block 16 is explored after 0.51 / 0.09 / 0.02 = 283 steps (2% of the time), not 83."""
    s = _schedule({1: {PLAIN: 0.01, BIG: 0.025}, 32: {PLAIN: 0.09, BIG: 0.6}}, options=(PLAIN, BIG))
    _accepting(s, BIG, 4, 40)  # E[16] = 5, and evidence enough
    picks = [s.choose(32, left=[32] * 32)[1] for _ in range(600)]
    assert [i for i, p in enumerate(picks) if p == BIG] == [284, 569]


def test_a_step_over_many_rows_outweighs_older_evidence():
    """Evidence decays per row-step: one block-16 step over 32 rows that accepted 2 drafts each (E = 3) moves E[16]
    from 14.4 (forty 1-row steps of 14) to 5.5 (per step, 7.8): the rows running now, not the requests before."""
    s = _schedule({1: {PLAIN: 0.01, BIG: 0.025}, 32: {PLAIN: 0.09, BIG: 0.6}}, options=(PLAIN, BIG))
    _accepting(s, BIG, 14, 40)
    assert s.expected(BIG) == pytest.approx(14.4, abs=0.1)
    h = np.zeros(16)
    h[2] = 32
    s.observe(BIG, h)
    assert s.expected(BIG) == pytest.approx(5.5, abs=0.1)
    assert s.choose(32, left=[32] * 32) == (32, PLAIN)  # 32 / 0.09 beats 32 x 5.5 / 0.6 (7.8: 32 x 7.8 / 0.6 won)


def test_trees_are_weighed_by_their_own_acceptance():
    small, big = Option(16, 8), Option(16, 32)
    costs = {4: {PLAIN: 1.0, small: 1.2, big: 2.0}}
    s = _schedule(costs, options=(PLAIN, small, big), rows=(4,))
    assert s.choose(1) == (4, big)  # no evidence yet (the unseen small one looks best): explored
    _accepting(s, small, 3, 30)
    _accepting(s, big, 4, 30)
    assert s.expected(small) == pytest.approx(4.0) and s.expected(big) == pytest.approx(5.0)
    assert s.choose(3) == (4, small)  # 4 / 1.2 beats 5 / 2 and 1 / 1


def test_served_steps_scale_their_program_and_the_ones_not_served_yet():
    s = _schedule({1: {PLAIN: 1.0, BIG: 2.0}, 4: {PLAIN: 1.5, BIG: 4.0}}, options=(PLAIN, BIG), rows=(1, 4))
    for _ in range(60):
        s.timed(1, BIG, 6.0)  # served, the big block's steps take 3x their warm-up time
    assert s.cost(1, BIG) == pytest.approx(6.0, abs=0.01)
    assert s.cost(4, PLAIN) == pytest.approx(4.5, abs=0.01)  # not served yet: scaled as the served ones
    for _ in range(60):
        s.timed(4, PLAIN, 1.5)  # ... and plain decoding's as timed
    assert s.cost(4, PLAIN) == pytest.approx(1.5, abs=0.01) and s.cost(1, BIG) == pytest.approx(6.0, abs=0.01)
    assert s.costs[1, BIG] == 2.0 and s.as_dict()["warmup_ms"]["1"] == {"1": 1000.0, "16": 2000.0}
    assert s.as_dict()["step_ms"]["4"]["1"] == pytest.approx(1500.0, abs=10)


def test_the_choice_follows_served_costs_not_the_warmup_table():
    """The warm-up table rates block 16 over 16 rows better than plain decoding over 32 (8 x 5 / 4.5 beats 8 / 1.0);
    served, its steps take twice that and plain decoding's what the table says: once plain decoding has been
    explored (its own served time, not the served block's ratio), it is chosen, in bucket 32."""
    s = _schedule({16: {PLAIN: 2.0, BIG: 4.5}, 32: {PLAIN: 1.0, BIG: 9.0}}, options=(PLAIN, BIG), rows=(16, 32))
    _accepting(s, BIG, 4, 40)  # E[16] = 5
    served = {(16, BIG): 9.0, (32, BIG): 18.0, (16, PLAIN): 2.0, (32, PLAIN): 1.0}
    picks = []
    for _ in range(60):
        rows, option = s.choose(8, left=[32] * 8)
        s.timed(rows, option, served[rows, option])
        picks.append((rows, option))
    assert picks[0] == (16, BIG) and (32, PLAIN) in picks[:4]
    assert picks[4:] == [(32, PLAIN)] * 56


def test_while_requests_are_prefilled_a_step_is_worth_its_tokens_less_the_held_load_in_its_time():
    """Four rows run while twelve prompts prefill: alone, block 16 pays for them (4 x 5 / 1.2 beats 4 / 0.25 tokens
    per second), but every iteration brings the prompts a chunk closer whatever it runs, and all 16 would emit
    16 x 5 / 4.0 = 20 tokens/s: block 16's step is worth 20 - 20 x 1.2 = -4 tokens, plain decoding's 4 - 20 x 0.25
    = -1."""
    s = _schedule({4: {PLAIN: 0.25, BIG: 1.2}, 16: {PLAIN: 2.0, BIG: 4.0}, 32: {PLAIN: 1.0, BIG: 9.0}},
                  options=(PLAIN, BIG), rows=(4, 16, 32))
    _accepting(s, BIG, 4, 40)  # E[16] = 5
    assert s.choose(4, left=[32] * 4) == (4, BIG)
    assert s.pace == 1.2  # the step the four rows alone run
    assert s.choose(4, left=[32] * 4, waiting=[32] * 12, held=16) == (4, PLAIN)
    assert s.current["why"] == "admitting" and s.current["waiting"] == 12
    assert s.pace == 1.2  # the prompts' chunks keep block 16's pace, not the short step's
    assert s.choose(4, left=[32] * 4, waiting=[32], held=5) == (4, BIG)  # 5 would emit 25 / 4.0: 20 - 7.5 beats 2.4
    assert s.choose(16, left=[32] * 16) == (16, BIG)  # all joined: 80 / 4.0 beats 16 / 1.0


def test_a_fresh_server_admitting_a_request_learns_the_acceptance_first():
    """Four rows run while a fifth prompt prefills, on a fresh server (the prior: every draft accepted half the time,
    E[16] = 2): on the prior plain decoding wins the admitting step (4 - 5 x 0.25 beats 8 - 5 x 1.2, 5 tokens/s the
    best rate for all five), as it would every admitting step of a burst, so block 16, with too little evidence,
    runs first; once it has shown 15 of 16 drafts accepted (E ~ 15), it wins them (60 - 18.75 x 1.2 beats 4 - 18.75
    x 0.25)."""
    s = _schedule({4: {PLAIN: 0.25, BIG: 1.2}, 16: {PLAIN: 2.0, BIG: 4.0}, 32: {PLAIN: 1.0, BIG: 9.0}},
                  options=(PLAIN, BIG), rows=(4, 16, 32))
    assert s.choose(4, left=[32] * 4, waiting=[32], held=5) == (4, BIG)
    assert s.current["why"] == "explore"
    _accepting(s, BIG, 15, 30)  # one row each: 19.6 decayed row-steps, evidence enough
    assert s.choose(4, left=[32] * 4, waiting=[32], held=5) == (4, BIG)
    assert s.current["why"] == "admitting"


def test_options_and_rows_buckets():
    assert schedule.default_rows(32) == (1, 4, 16, 32) and schedule.default_rows(1) == (1,)
    assert schedule.options_for(16, None) == (PLAIN, BIG)
    assert schedule.options_for(16, None, [1, 4, 16]) == (PLAIN, MID, BIG)
    assert schedule.options_for(16, 32, [0, 8, 32]) == (PLAIN, Option(16, 8), Option(16, 32))
    with pytest.raises(ValueError, match="--auto-candidates 1,32: 32 is outside the method's blocks 1..16"):
        schedule.options_for(16, None, [1, 32])


@pytest.fixture(scope="module")
def pair():
    method = frontend.Method("dflash", 8)
    target, drafter = frontend.load_models(frontend.ASSETS / "target", frontend.ASSETS / "drafter", [method],
                                           dtype=np.float32, progress=False)
    proposer, pparams = frontend.proposer_for(method, target, drafter)
    return target, proposer, pparams


def _switching(pair, plan, tree=None):
    """Two rows of prompts laid out for block 8 (a tree: of ``tree`` nodes), stepped as ``plan`` says: (option, rows)
    per step, a row outside a step waiting; each row's tokens so far and the histogram of accepted drafts."""
    target, proposer, pparams = pair
    tok = frontend.load_tokenizer(frontend.ASSETS / "target")
    prompts = [frontend.encode(tok, "def fibonacci(n):\n"), frontend.encode(tok, "class Stack:\n    def push(")]
    spec = spec_for(8, 64, tree)
    loops = {o: SpeculativeLoop.of(target, proposer, dataclasses.replace(spec, block_size=o.block,
                                                                        tree_budget=o.budget)) for o, _ in plan}
    tokens = np.zeros((2, 16), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    params = (target.params, pparams)
    state = SpeculativeLoop.of(target, proposer, spec).init(params, tokens, np.array([len(p) for p in prompts]), 0)
    for option, rows in plan:
        state = loops[option].step_rows(params, state, rows)
    n_out = np.asarray(state.n_out)
    outs = [np.asarray(state.out)[b, :n_out[b]].tolist() for b in range(2)]
    return prompts, outs, np.asarray(state.accepted)


def _plain(target, prompt):
    return generate(target, [prompt], block_size=1, max_new_tokens=64, stop_ids=()).token_lists()[0]


def test_greedy_with_the_block_and_rows_switching_every_step_equals_plain_decoding(pair):
    """Block 8 over the first row, then plain decoding (the drafter's context kept up, no draft pass) over both:
    each row's tokens equal plain decoding's, and the block-8 steps accepted drafts."""
    plan = [(Option(8), 1), (Option(1), 2), (Option(1), 2)] * 8
    prompts, outs, accepted = _switching(pair, plan)
    assert len(outs[0]) > len(outs[1]) > 16  # row 0 ran every step, row 1 only the plain ones
    for prompt, got in zip(prompts, outs, strict=True):
        assert got == _plain(pair[0], prompt)[:len(got)]
    assert accepted[0, 1:].sum() > 0 and accepted[1, 1:].sum() == 0


@pytest.mark.slow
def test_greedy_with_tree_budgets_and_chains_switching_equals_plain_decoding(pair):
    plan = [(Option(8, 16), 1), (Option(1), 2), (Option(8, 4), 2), (Option(3), 1)] * 6
    prompts, outs, accepted = _switching(pair, plan, tree=16)
    assert len(outs[0]) > len(outs[1]) > 16
    for prompt, got in zip(prompts, outs, strict=True):
        assert got == _plain(pair[0], prompt)[:len(got)]
    assert accepted[:, 1:].sum() > 0
