"""Training settings that cannot train anything are refused before any work; a run whose loss becomes
non-finite stops, keeping its last good checkpoint; corpora of one's own; the default taps (issue 25)."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import cli
from dflash_jax.train import corpus, loop


@pytest.mark.parametrize("kw, match", [
    (dict(lr=float("nan")), "learning rate must be a finite number > 0, got nan"),
    (dict(lr=-1e-3), "learning rate must be a finite number > 0"), (dict(lr=0.0), "learning rate"),
    (dict(steps=0), "steps must be an integer >= 1, got 0"), (dict(warmup=1.0), "warmup"),
    (dict(weight_decay=float("inf")), "weight_decay"), (dict(clip=0.0), "clip"),
])
def test_degenerate_train_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        loop.TrainConfig(**{"steps": 10, "lr": 1e-3, **kw})


@pytest.fixture
def no_work(monkeypatch):
    """Any load of a model or a tokenizer fails the test: the refusals come first."""
    from dflash_jax.models import target
    from dflash_jax.train import tokenizer

    monkeypatch.setattr(target, "load_target", lambda *a, **k: pytest.fail("loaded a target before the check"))
    monkeypatch.setattr(tokenizer, "load", lambda *a, **k: pytest.fail("loaded a tokenizer before the check"))


@pytest.mark.parametrize("argv, match", [
    (["train-target", "--lr", "nan"], "--lr"), (["train-target", "--lr", "-0.1"], "--lr"),
    (["train-target", "--steps", "0"], "--steps"), (["train-target", "--seq", "1"], "--seq must be >= 2"),
    (["train-target", "--batch", "0"], "--batch must be >= 1"),
    (["train-drafter", "--anchors", "0"], "anchors must be an integer >= 1"),
    (["train-drafter", "--block-size", "1"], "block size must be an integer >= 2"),
    (["train-drafter", "--seq", "64"], "--seq 64 must exceed --prompt-len 64"),
    (["train-drafter", "--seq", "80", "--anchors", "16"], "leave 2 anchor positions for blocks of 16"),
    (["train-drafter", "--data-seqs", "0"], "--data-seqs must be >= 1"),
    (["train-drafter", "--taps", "1,9"], "--taps '1,9': expected distinct layer ids in 0..3"),
    (["train-drafter", "--taps", "a"], "--taps 'a': expected comma-separated layer ids"),
    (["train-mtp", "--steps", "0"], "--steps"), (["train-mtp", "--seq", "65"], "needs at least 2"),
    (["train-mtp", "--seq", "86"], "leave 15 chain anchors for 7 unrolled steps, fewer than 16"),
    (["train-mtp", "--unroll", "0"], "unroll must be an integer >= 1"),
    (["train-tokenizer", "--vocab", "10"], "--vocab 10: must be at least 258"),
])
def test_degenerate_flags_are_refused_before_any_work(tmp_path, capsys, no_work, argv, match):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(_target_config()))
    inputs = {"train-target": ["--tokenizer", str(target)], "train-tokenizer": []}.get(argv[0], ["--target",
                                                                                               str(target)])
    assert cli.main([*argv, *inputs, "--out", str(tmp_path / "out")]) == 2
    assert match in capsys.readouterr().err


def _target_config():
    from dflash_jax.train.lm import hf_config, small_config

    return hf_config(small_config(vocab_size=64, eos_id=0, layers=4, hidden=32, intermediate=64, heads=2, kv_heads=1,
                                  head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16))


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    """The loss is finite for three steps, then NaN: the run stops at step 4, saving nothing of it; the
    checkpoint of step 3 is there, whole and finite."""
    def loss_fn(params, frozen, batch):
        loss = jnp.sum(params["w"] ** 2) * batch[0]
        return loss, {}

    def batches():
        for scale in (1.0, 1.0, 1.0, math.nan, 1.0, 1.0):
            yield np.array([scale], np.float32)

    cfg = loop.TrainConfig(steps=6, lr=1e-2, ckpt_every=1, keep=2, log_every=1)
    params = {"w": jnp.ones((4,), jnp.float32)}
    with pytest.raises(loop.NonFiniteLoss, match=r"loss became nan .* at step 4; training stopped .*step_3, is kept"):
        loop.train(loss_fn, params, None, batches(), cfg, ckpt_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_2", "step_3"]
    state = {"params": params, "opt": loop.make_optimizer(cfg).init(params), "step": jnp.zeros((), jnp.int32)}
    from dflash_jax.io import checkpoint

    restored = checkpoint.restore_params(tmp_path / "step_3", state)
    assert int(restored["step"]) == 3 and np.isfinite(np.asarray(restored["params"]["w"])).all()


def test_a_corpus_directory_or_jsonl_of_ones_own(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha")
    (d / "sub" / "b.txt").write_text("beta")
    (d / ".hidden").write_text("no")
    (d / "bin").write_bytes(b"\xff\xfe\x00")
    assert corpus.user_texts(d) == ["alpha", "beta"]
    j = tmp_path / "t.jsonl"
    j.write_bytes(b"\xef\xbb\xbf" + b'{"text": "one"}\n\n{"prompt": "two"}\n')  # a UTF-8 BOM, as Windows writes
    assert corpus.user_texts(j) == ["one", "two"]
    j.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r'--corpus .*t.jsonl: object 1 has no "text" string'):
        corpus.user_texts(j)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no UTF-8 text files"):
        corpus.user_texts(tmp_path / "empty")
    with pytest.raises(ValueError, match="does not exist"):
        corpus.user_texts(tmp_path / "none.jsonl")


def test_default_taps_follow_the_shipped_recipe():
    from dflash_jax.cli.train import default_taps
    from dflash_jax.train.ship import Sizes

    assert default_taps(Sizes().grow_layers) == Sizes().drafter_taps
    assert default_taps(8)[0] == 1 and default_taps(8)[-1] == 7 and len(default_taps(8)) == len(Sizes().drafter_taps)
