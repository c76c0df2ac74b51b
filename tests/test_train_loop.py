"""train/loop.py: the shared training loop lowers the loss and resumes exactly from its checkpoints."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
from train_fixtures import tiny_target

from dflash_jax.train import lm, loop


def repeated(batch):
    while True:
        yield batch


@pytest.mark.slow
def test_training_lowers_loss_and_resumes_exactly(tmp_path):
    target = tiny_target()
    batch = np.random.default_rng(0).integers(2, 64, (2, 32)).astype(np.int32)
    loss_fn = lm.lm_loss_fn(target.graphdef)
    cfg = loop.TrainConfig(steps=4, lr=1e-2, warmup=0.0, ckpt_every=2, log_every=1)
    full = loop.train(loss_fn, target.params, None, repeated(batch), cfg, ckpt_dir=tmp_path)
    losses = [h["loss"] for h in full.history]
    assert losses[-1] < losses[0]
    # Interrupted after step 2: the rerun resumes there and ends at the same params.
    shutil.rmtree(tmp_path / "step_4")
    resumed = loop.train(loss_fn, target.params, None, repeated(batch), cfg, ckpt_dir=tmp_path)
    assert resumed.step == 4 and [h["step"] for h in resumed.history] == [3, 4]
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
