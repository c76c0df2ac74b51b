"""``--block-size auto``: the choice from acceptance and step costs, the acceptance card, the calibration run."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.decoding import blocksize
from dflash_jax.decoding.api import generate


def test_expected_tokens_is_the_mean_of_a_run_replayed_at_a_shorter_block():
    """E[tokens | B] from the histogram's conditional acceptance equals, for every B, the mean over the recorded
    steps of min(accepted, B - 1) + 1: what each step would have emitted had it stopped drafting at B - 1."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        accepted = rng.integers(0, 16, size=rng.integers(1, 60))  # drafts accepted per step, at block 16
        hist = np.bincount(accepted, minlength=16)
        acc = blocksize.acceptance_from_histogram(hist)
        assert len(acc) == 15 and all(0 <= a <= 1 for a in acc)
        for block in range(1, 17):
            assert blocksize.expected_tokens(acc, block) == pytest.approx(np.mean(np.minimum(accepted, block - 1) + 1))


def test_positions_no_step_reached_are_never_worth_drafting():
    assert blocksize.acceptance_from_histogram([2, 3, 0, 0]) == (0.6, 0.0, 0.0)
    with pytest.raises(ValueError, match="not all zero"):
        blocksize.acceptance_from_histogram([0, 0])
    with pytest.raises(ValueError, match="block 5 is outside 1..4"):
        blocksize.expected_tokens((0.5, 0.5, 0.5), 5)


def test_candidates_are_plain_decoding_the_powers_of_two_and_the_drafter_block():
    assert blocksize.candidate_blocks(16) == (1, 2, 4, 8, 16)
    assert blocksize.candidate_blocks(10) == (1, 2, 4, 8, 10)
    assert blocksize.candidate_blocks(1) == (1,)


ACCEPT = (0.8,) * 15  # E[tokens | B] = 1 + 0.8 + ... + 0.8^(B-1): 1, 1.8, 2.952, 4.3222, 4.8592 at B = 1, 2, 4, 8, 16
# Batch 1 reads the weights once a step whatever the block (memory-bound): the cost barely grows with B.
BATCH_1 = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2}  # tok/step / cost: 1, 1.76, 2.81, 3.93, 4.05 -> block 16
# Batch 32 does 32 x B tokens of matmul work a step (compute-bound): the cost grows with B.
BATCH_32 = {1: 1.0, 2: 1.4, 4: 2.2, 8: 3.8, 16: 7.0}  # 1, 1.29, 1.34, 1.14, 0.69 -> block 4


def test_batch_1_and_batch_32_choose_different_blocks_when_the_costs_say_so():
    """The report's concurrency-32 observation in miniature: once verification is compute-bound, a smaller block
    gives more tokens per second; with memory-bound steps the largest block does."""
    one = blocksize.choose_block(ACCEPT, BATCH_1, batch=1, source="synthetic")
    many = blocksize.choose_block(ACCEPT, BATCH_32, batch=32, source="synthetic")
    assert (one.block, many.block) == (16, 4)
    assert one.tokens_per_s(16) == pytest.approx(4.8592 / 1.2, rel=1e-4)
    assert many.tokens_per_s(4) == pytest.approx(32 * 2.952 / 2.2, rel=1e-4)
    line = many.reason()
    assert "\n" not in line and line.startswith("block size auto: dflash:4 (3 speculative tokens) at batch 32")
    assert "dflash:4: 2.95 tok/step / 2200.00 ms = 43 tok/s" in line and "acceptance synthetic" in line
    doc = many.as_dict()
    assert doc["block"] == 4 and doc["method"] == "dflash:4" and doc["step_ms"]["16"] == 7000.0
    assert doc["expected"]["1"] == 1.0


def test_untimed_blocks_still_say_what_a_step_commits_and_weigh_explains_plain_decoding():
    """``--block-size auto`` on a CPU whose caches hold the target: a 16-token step costs ~15 plain steps, so plain
    decoding wins although a DFlash2 step commits 7.5 tokens; every drafter's line and the weighing say so."""
    dflash = blocksize.choose_block(ACCEPT, {1: 1.0, 2: 8.0}, blocks=(1, 2, 4, 8, 16), source="s")
    assert "dflash:16: 4.86 tok/step (not timed)" in dflash.reason() and dflash.block == 1
    six = (0.95,) * 4 + (0.8,) * 11  # E[tokens | 16] = 7.5
    dflash2 = blocksize.choose_block(six, {2: 8.0, 16: 15.0}, blocks=(2, 4, 8, 16), family="dflash2", source="s")
    assert dflash2.block == 16 and dflash2.name(16) == "dflash2:16" and dflash2.name(1) == "ar"
    best, line = blocksize.weigh([dflash, dflash2])
    assert best is dflash and "\n" not in line
    assert line.startswith("block size auto: ar at batch 1, 1 tok/s expected; tokens a step commits: ar 1.00, "
                           "dflash:16 4.86, dflash2:16 7.50; ")
    assert line.endswith("a step costs dflash:2 8.0x plain's (0 tok/s), dflash2:16 15.0x plain's (1 tok/s)")
    cheap = blocksize.choose_block(six, {2: 0.5, 16: 0.9}, blocks=(2, 16), family="dflash2")
    assert blocksize.weigh([dflash, cheap])[0] is cheap  # a DFlash2 step at ~plain's cost: it wins


def test_costly_drafting_chooses_plain_decoding_and_ties_go_to_the_smaller_block():
    assert blocksize.choose_block(ACCEPT, {1: 1.0, 2: 2.0, 16: 10.0}).block == 1
    assert blocksize.choose_block((1.0,), {1: 1.0, 2: 2.0}).block == 1  # 2 tokens for twice the cost: a tie
    with pytest.raises(ValueError, match="finite seconds > 0"):
        blocksize.choose_block(ACCEPT, {1: 1.0, 2: 0.0})
    with pytest.raises(ValueError, match="no step costs"):
        blocksize.choose_block(ACCEPT, {})


def test_card_round_trip_and_errors_naming_the_file_and_key(tmp_path):
    assert blocksize.read_card(tmp_path) is None
    card = blocksize.Card(block_size=4, histogram=(1, 2, 3, 4), temperature=0.0, prompts="p", max_new_tokens=16)
    path = blocksize.write_card(tmp_path, card)
    assert path.name == blocksize.CARD and blocksize.read_card(tmp_path) == card
    doc = json.loads(path.read_text())
    assert doc["acceptance"] == pytest.approx([0.9, 7 / 9, 4 / 7], abs=1e-6) and doc["tau"] == 3.0
    for bad, match in ((dict(doc, format="x"), '"format" must be'), (dict(doc, block_size=1), '"block_size"'),
                       (dict(doc, histogram=[1, 2]), '"histogram" must be 4'),
                       (dict(doc, temperature=-1), '"temperature"')):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match) as e:
            blocksize.read_card(tmp_path)
        assert str(path) in str(e.value)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        blocksize.read_card(tmp_path)


def test_a_card_describes_the_weights_it_was_recorded_for(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    digest = blocksize.weights_digest(tmp_path)
    card = blocksize.Card(block_size=2, histogram=(1, 1), temperature=0.0, prompts="p", max_new_tokens=4,
                          weights=digest)
    blocksize.write_card(tmp_path, card)
    assert blocksize.read_card(tmp_path).fits(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"retrained")
    assert not blocksize.read_card(tmp_path).fits(tmp_path)


@pytest.fixture(scope="module")
def tiny_pair():
    from dflash_jax.perf import regime, synthetic

    target = synthetic.random_target(regime._hybrid(32, 4, 64, (2, 1, 16), (1, 2, 16)), dtype=jnp.float32)
    return target, synthetic.random_drafter(regime._drafter(32, 4, (2, 1, 16), 64), target)


@pytest.mark.slow
def test_calibration_is_the_real_loops_histogram_and_records_a_card(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    prompts = [[5, 6, 7], [8, 9]]
    hist = blocksize.calibrate(target, drafter, prompts, max_new_tokens=12, stop_ids=())
    out = generate(target, prompts, drafter=drafter, max_new_tokens=12, stop_ids=())
    assert hist == tuple(np.asarray(out.accepted).sum(0).tolist()) and sum(hist) == int(np.asarray(out.steps).sum())
    card = blocksize.record_acceptance(tmp_path, target, drafter, prompts, prompts_name="two", max_new_tokens=12,
                                       stop_ids=())
    assert blocksize.read_card(tmp_path) == card and card.histogram == hist and card.fits(tmp_path)
