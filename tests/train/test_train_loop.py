"""train/loop.py: the shared training loop lowers the loss and resumes exactly from its checkpoints."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from train_fixtures import tiny_target

from dflash_jax.io.checkpoint import CheckpointError
from dflash_jax.models.target import init_target
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


def test_pretraining_resumes_only_checkpoints_that_record_the_gdn_layout(tmp_path):
    """``lm.train_target`` records the GDN channel order in its checkpoints and resumes them exactly; a
    checkpoint of the same shapes without the record (saved before the channels were head-grouped, so its
    in_proj_qkv/conv1d rows and their Adam moments are q | k | v) is refused, not resumed scrambled."""
    cfg = lm.small_config(vocab_size=64, eos_id=0, hidden=32, layers=1, intermediate=64, heads=2, kv_heads=1,
                          head_dim=16, linear_key_heads=2, linear_value_heads=4, linear_head_dim=8, mtp_layers=0)
    batch = np.random.default_rng(0).integers(2, 64, (2, 16)).astype(np.int32)
    tcfg = loop.TrainConfig(steps=2, lr=1e-2, warmup=0.0, ckpt_every=1, log_every=1)
    full, _ = lm.train_target(cfg, repeated(batch), tcfg, ckpt_dir=tmp_path / "new")
    shutil.rmtree(tmp_path / "new" / "step_2")
    resumed, res = lm.train_target(cfg, repeated(batch), tcfg, ckpt_dir=tmp_path / "new")
    assert res.step == 2 and [h["step"] for h in res.history] == [2]
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    old = init_target(cfg, mtp=False)
    loop.train(lm.lm_loss_fn(old.graphdef), old.params, None, repeated(batch), dataclasses.replace(tcfg, steps=1),
               ckpt_dir=tmp_path / "old")  # no meta: what train_target saved before
    with pytest.raises(CheckpointError, match=r"step_1 records no gdn_channels, this dflash_jax needs "
                                              r"gdn_channels 'head-grouped'; .* cannot be resumed: delete it"):
        lm.train_target(cfg, repeated(batch), tcfg, ckpt_dir=tmp_path / "old")
