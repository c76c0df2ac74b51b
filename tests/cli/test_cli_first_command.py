"""The first command a newcomer runs (issue 33, section 6): ``--block-size auto`` says what it is doing while it sizes
the blocks (progress on stderr), and on a busy machine its cost is bounded by ``step_cost.BUDGET`` (the blocks left
out so are named in the reason line)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decoding import blocksize
from dflash_jax.perf import regime, step_cost, synthetic


class BusyDevice:
    """``blocksize.run_steps`` on a fake clock of a busy machine: each block's first call compiles for ``compile``
    seconds; a run costs ``fixed`` + n steps of ``per_step[block]``; every draft is accepted."""

    def __init__(self, per_step, compile=40.0, fixed=0.2):
        self.now, self.per_step, self.compile, self.fixed = 0.0, per_step, compile, fixed
        self.compiled, self.calls = set(), []

    def clock(self):
        return self.now

    def run_steps(self, loop, params, tokens, lengths, rng, n, until_done):
        block = loop.spec.block_size
        self.calls.append((block, int(n)))
        self.now += self.fixed + int(n) * self.per_step[block] + (0.0 if block in self.compiled else self.compile)
        self.compiled.add(block)
        hist = np.zeros(block, np.int32)
        hist[-1] = 4
        return jnp.asarray(hist), jnp.int32(n)


@pytest.fixture(scope="module")
def tiny_pair():
    target = synthetic.random_target(regime._hybrid(32, 4, 64, (2, 1, 16), (1, 2, 16)), dtype=jnp.float32)
    return target, synthetic.random_drafter(regime._drafter(32, 4, (2, 1, 16), 64), target)


@pytest.mark.parametrize("budget", [None, 60.0])
def test_the_block_choice_reports_progress_and_is_bounded_on_a_busy_machine(tiny_pair, monkeypatch, budget):
    target, drafter = tiny_pair
    per_step = {1: 0.01, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.014}  # flat: every block can win, none is pruned
    device = BusyDevice(per_step)
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    heard = []
    got = step_cost.measure(target, drafter, [[5, 6, 7]], batch=1, blocks=(1, 2, 4, 8, 16), max_new_tokens=8,
                            calibrate=True, clock=device.clock, budget=budget, progress=heard.append)
    assert heard[0].startswith("calibrating the drafter's acceptance") and "block 16" in heard[0]
    if budget is None:  # every block compiled and sized, every round timed: 5 compilations of 40 s
        assert got.compiled == 5 and got.over_budget == () and got.rounds == step_cost.REPEATS
        assert device.now > 5 * device.compile
        return
    # calibration (block 16) and block 1 spend the budget: blocks 2, 4, 8 are never compiled; block 16, already
    # compiled by the calibration, is still sized; one timed round
    assert got.over_budget == (2, 4, 8) and set(got.costs) == {1, 16} and got.compiled == 2
    assert got.costs == pytest.approx({1: 0.01, 16: 0.014}) and got.rounds == 1
    assert device.now < budget + device.compile
    assert [m.split(":")[0] for m in heard[1:]] == ["sizing block 1 at batch 1", "sizing block 16 at batch 1",
                                                     "timing blocks 1, 16"]
    assert "compiling its program" in heard[1] and "compiling" not in heard[2]


def test_the_reason_line_names_the_blocks_the_budget_left_out(tiny_pair, monkeypatch):
    target, drafter = tiny_pair
    device = BusyDevice({1: 0.01, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.014})
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    real = step_cost.measure
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: real(*a, **k, clock=device.clock))
    choice, costs = step_cost.choose(target, drafter, [[5, 6, 7]], batch=1, key=("busy", "budget"), draft_dir=None,
                                     max_new_tokens=8, budget=60.0)
    assert costs.over_budget == (2, 4, 8) and choice.block in (1, 16)
    assert "blocks 2, 4, 8 not timed: the 60 s budget of the choice was spent" in choice.reason()
    assert "1 timed round of 5 (the budget)" in choice.reason()
    assert choice == blocksize.choose_block(blocksize.acceptance_from_histogram(costs.histogram)[:15], costs.costs,
                                            batch=1, source=choice.source, blocks=(1, 2, 4, 8, 16))
    assert "dflash:4: " in choice.reason() and "(not timed)" in choice.reason()  # untimed: what a step commits


def test_a_second_drafter_past_the_budget_times_only_what_its_calibration_compiled(tiny_pair, monkeypatch):
    """generate's auto weighs the shipped DFlash2 drafter after the DFlash one within one budget: once it is
    spent, the second drafter's calibration still runs (what a step commits is the point) and its largest block,
    compiled by it, is timed; no further block is compiled."""
    target, drafter = tiny_pair
    device = BusyDevice({2: 0.011, 4: 0.012, 8: 0.013, 16: 0.014})
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    real = step_cost.measure
    monkeypatch.setattr(step_cost, "measure", lambda *a, **k: real(*a, **k, clock=device.clock))
    choice, costs = step_cost.choose(target, drafter, [[5, 6, 7]], batch=1, key=("busy", "second"), draft_dir=None,
                                     max_new_tokens=8, blocks=(2, 4, 8, 16), family="dflash2", size_smallest=False,
                                     spent_before=step_cost.BUDGET)
    assert set(costs.costs) == {16} and costs.over_budget == (2, 4, 8) and costs.compiled == 1
    assert choice.block == 16 and "dflash2:2: " in choice.reason() and "the 30 s budget" in choice.reason()
