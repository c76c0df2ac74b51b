"""``perf.step_cost``: the step's cost per block measured as the difference of a long and a short run, warm and
interleaved; remembered per (models, batch, backend); the choice it feeds; the real program on a tiny pair."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decoding import blocksize
from dflash_jax.perf import step_cost


class FakeDevice:
    """``blocksize.run_steps`` on a fake clock: a call costs ``fixed`` + prefill + n steps of ``per_step[block]``,
    and the first call of each block compiles (100 s)."""

    def __init__(self, per_step, fixed=0.5, prefill=0.25):
        self.now, self.per_step, self.fixed, self.prefill = 0.0, per_step, fixed, prefill
        self.calls, self.compiled = [], set()

    def clock(self):
        return self.now

    def run_steps(self, loop, params, tokens, lengths, rng, n, until_done):
        block = loop.spec.block_size
        self.calls.append((block, int(n), bool(until_done), tokens.shape[0]))
        self.now += self.fixed + self.prefill + int(n) * self.per_step[block] + (100.0 if block not in
                                                                                   self.compiled else 0.0)
        self.compiled.add(block)
        hist = np.zeros(block, np.int32)
        hist[-1] = 3  # every draft accepted in 3 steps
        hist[0] = 1
        return jnp.asarray(hist), jnp.int32(n)


@pytest.fixture(scope="module")
def tiny_pair():
    from dflash_jax.perf import regime, synthetic

    target = synthetic.random_target(regime._hybrid(32, 4, 64, (2, 1, 16), (1, 2, 16)), dtype=jnp.float32)
    return target, synthetic.random_drafter(regime._drafter(32, 4, (2, 1, 16), 64), target)


def test_a_step_costs_the_difference_of_the_long_and_short_runs_without_compile_or_fixed_costs(tiny_pair,
                                                                                                 monkeypatch):
    target, drafter = tiny_pair
    device = FakeDevice({1: 0.01, 4: 0.03, 16: 0.2})
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    got = step_cost.measure(target, drafter, [[5, 6, 7]], batch=3, blocks=(1, 4, 16), max_new_tokens=8,
                            calibrate=True, clock=device.clock)
    assert got.costs == pytest.approx({1: 0.01, 4: 0.03, 16: 0.2})
    assert got.histogram == (1,) + (0,) * 14 + (3,) and got.seconds == pytest.approx(device.now)
    # the calibration runs the largest block until done, first; then every block compiled and warm, its long
    # run's steps doubled until they take WINDOW more than one step, before any timed run (no block dropped:
    # each can win); the timed runs alternate order round by round; every run has the batch's rows
    longs = {b: next(n for n in (4 * 2**k for k in range(9)) if (n - 1) * c >= step_cost.WINDOW - 1e-9)
             for b, c in {1: 0.01, 4: 0.03, 16: 0.2}.items()}
    assert longs == {1: 32, 4: 16, 16: 4}
    sizing = [(b, n) for b in (1, 4, 16) for n in [1, 1] + [4 * 2**k for k in range(9) if 4 * 2**k <= longs[b]]]
    k = len(sizing)
    assert device.calls[0] == (16, 8, True, 3) and [c[:2] for c in device.calls[1:k + 1]] == sizing
    assert got.untimed == () and got.compiled == 3
    timed = [c[:2] for c in device.calls[k + 1:]]
    assert timed[:6] == [(1, 1), (1, 32), (4, 1), (4, 16), (16, 1), (16, 4)]
    assert timed[6:12] == [(16, 4), (16, 1), (4, 16), (4, 1), (1, 32), (1, 1)]
    assert {c[3] for c in device.calls} == {3} and not any(c[2] for c in device.calls[k + 1:])


def test_a_cheap_step_is_timed_over_a_window_long_enough_for_a_busy_machine(tiny_pair, monkeypatch):
    target, drafter = tiny_pair
    device = FakeDevice({1: 0.001, 16: 0.004}, fixed=0.0, prefill=0.0)
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    got = step_cost.measure(target, drafter, [[5, 6, 7]], batch=1, blocks=(1, 16), max_new_tokens=8,
                            clock=device.clock)
    assert got.costs == pytest.approx({1: 0.001, 16: 0.004})
    longest = {b: max(n for blk, n, _, _ in device.calls if blk == b) for b in (1, 16)}
    assert longest == {1: 512, 16: 128}  # the first doubling of 4 whose extra steps take WINDOW (0.3 s)


SHIPPED = {1: 0.00028, 2: 0.00255, 4: 0.00323, 8: 0.00382, 16: 0.00461}  # the shipped pair's steps on 2 cores
WEIGHT_BOUND = {1: 0.004, 2: 0.0045, 4: 0.005, 8: 0.006, 16: 0.008}  # a target too large for the caches


@pytest.mark.parametrize("per_step, accepted, timed", [(SHIPPED, 0.5, (1, 2)), (SHIPPED, 0.95, (1, 2, 8, 16)),
                                                        (WEIGHT_BOUND, 0.5, (1, 2, 4, 8, 16))])
def test_blocks_that_cannot_win_are_neither_compiled_nor_timed(tiny_pair, monkeypatch, per_step, accepted, timed):
    """A block above a timed one costs at least as much, so where even that cost gives it under 70% of the best
    rate so far it is dropped unrun: on the shipped pair's costs (a plain step 10x cheaper than any speculative
    one) every block above 2 at acceptance 0.5, block 4 alone at 0.95 (3.7 tokens a step; 8 and 16 emit up to
    6.7 and 11.2); where the steps cost alike, none."""
    target, drafter = tiny_pair
    device = FakeDevice(per_step, fixed=0.002, prefill=0.001)
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    got = step_cost.measure(target, drafter, [[5, 6, 7]], batch=1, blocks=tuple(per_step), max_new_tokens=8,
                            acceptance=(accepted,) * 15, repeats=1, clock=device.clock)
    assert tuple(got.costs) == timed and {c[0] for c in device.calls} == set(timed)
    assert got.untimed == tuple(b for b in per_step if b not in timed) and got.compiled == len(timed)
    assert got.costs == pytest.approx({b: per_step[b] for b in timed})
    rate = {b: blocksize.expected_tokens((accepted,) * 15, b) / per_step[b] for b in per_step}
    assert max(rate, key=rate.get) in timed  # the block with the most tokens/s is never dropped


class HiccupDevice(FakeDevice):
    """A busy machine: every run of ``n`` steps (1: the short runs, else the long ones) takes 0.2 s more."""

    def __init__(self, per_step, n):
        super().__init__(per_step, fixed=0.002, prefill=0.001)
        self.n = n

    def run_steps(self, loop, params, tokens, lengths, rng, n, until_done):
        self.now += 0.2 if (int(n) == 1) == (self.n == 1) and not until_done else 0.0
        return super().run_steps(loop, params, tokens, lengths, rng, n, until_done)


@pytest.mark.parametrize("hiccup", [1, "long"])
def test_a_slow_sizing_run_drops_no_block_a_quiet_one_keeps(tiny_pair, monkeypatch, hiccup):
    """A slow short run of plain decoding would make it look 3x cheaper by its extra time alone (the best rate
    overrated: blocks 8 and 16 dropped); a slow long run raises both bounds alike."""
    target, drafter = tiny_pair
    device = HiccupDevice(SHIPPED, hiccup)
    monkeypatch.setattr(step_cost.blocksize, "run_steps", device.run_steps)
    got = step_cost.measure(target, drafter, [[5, 6, 7]], batch=1, blocks=tuple(SHIPPED), max_new_tokens=8,
                            acceptance=(0.95,) * 15, repeats=1, clock=device.clock)
    assert set(got.untimed) <= {4} and {1, 2, 8, 16} <= set(got.costs)  # quiet: 4 alone dropped (above)


def test_auto_picks_per_batch_and_remembers_the_costs(tiny_pair, monkeypatch, tmp_path):
    """Batch 1 (the steps' cost flat in the block) and batch 32 (growing with it) choose different blocks from the
    same card; the second choice for a batch measures nothing."""
    target, drafter = tiny_pair
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    blocksize.write_card(tmp_path, blocksize.Card(block_size=16, histogram=(2,) * 4 + (1,) * 8 + (4,) * 4,
                                                  temperature=0.0, prompts="p", max_new_tokens=8,
                                                  weights=blocksize.weights_digest(tmp_path)))
    costs = {1: {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2}, 32: {1: 1.0, 2: 1.4, 4: 2.2, 8: 3.8, 16: 7.0}}
    measured = []

    def fake_measure(target, drafter, prompts, *, batch, blocks, calibrate, **kw):
        measured.append((batch, calibrate))
        assert blocks == (1, 2, 4, 8, 16)
        return step_cost.StepCosts(costs=costs[batch], histogram=(0,) * 15 + (5,) if calibrate else None,
                                   seconds=3.0, compiled=5)

    monkeypatch.setattr(step_cost, "measure", fake_measure)
    kw = dict(key=("t", "d", "float32"), draft_dir=tmp_path, max_new_tokens=8)
    one, _ = step_cost.choose(target, drafter, [[5, 6]], batch=1, **kw)
    many, _ = step_cost.choose(target, drafter, [[5, 6]], batch=32, **kw)
    assert one.block > many.block
    card = blocksize.read_card(tmp_path)
    assert one == blocksize.choose_block(card.acceptance, costs[1], batch=1, source=one.source)
    assert "from acceptance.json (p); step costs measured in 3.0 s, 5 programs compiled" in one.reason()
    again, c = step_cost.choose(target, drafter, [[5, 6]], batch=1, **kw)
    assert measured == [(1, False), (32, False)] and c.cached and again.block == one.block
    assert "remembered" in again.reason()
    # a retrained drafter makes the card stale: calibrated here instead (every draft accepted: block 16), and said
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    stale, _ = step_cost.choose(target, drafter, [[5, 6]], batch=32, **kw)
    assert measured[-1] == (32, True) and stale.block == 16
    assert "calibrated on these prompts (5 steps at block 16) (acceptance.json unused: recorded for other " \
           "weights)" in stale.reason()


@pytest.mark.slow
def test_the_real_program_times_each_block_and_calibrates(tiny_pair):
    target, drafter = tiny_pair
    got = step_cost.measure(target, drafter, [[5, 6, 7], [8, 9]], batch=2, blocks=(1, 4), max_new_tokens=8,
                            calibrate=True, repeats=1)
    assert set(got.costs) == {1, 4} and all(c > 0 for c in got.costs.values())
    assert len(got.histogram) == 4 and sum(got.histogram) > 0
