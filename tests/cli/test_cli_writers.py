"""The commands that write directories (quantize, train-*, bench's --out) against directories they must not
touch (issue 25): another model's directory, a user's folder, their own input. Every refusal names the paths and
leaves every directory byte-for-byte as it was (hashed before and after); --overwrite and reruns are allowed."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from dirhash import tree_hash

from dflash_jax import cli
from dflash_jax.io import atomic, checkpoint
from dflash_jax.models import quark
from dflash_jax.models.target import init_target, load_target
from dflash_jax.train.lm import hf_config, small_config


@pytest.fixture
def dense(tmp_path):
    cfg = small_config(vocab_size=64, eos_id=0, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1,
                       head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_head_dim=16, mtp_layers=0)
    path = tmp_path / "dense"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config(cfg)))
    checkpoint.write_safetensors(path / "model.safetensors", quark._tensors(init_target(cfg, seed=2), np.float32))
    return path


def _drafter_dir(path):
    path.mkdir()
    (path / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "block_size": 16}')
    (path / "model.safetensors").write_bytes(b"the drafter's weights")
    return path


def _fail(capsys, argv) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_quantize_never_replaces_a_drafter_directory(dense, tmp_path, capsys, monkeypatch):
    from dflash_jax.models import target as target_module

    drafter = _drafter_dir(tmp_path / "drafter")
    before = tree_hash(tmp_path)
    load = target_module.load_target
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("loaded before the check"))
    err = _fail(capsys, ["quantize", "--model", str(dense), "--out", str(drafter), "--quiet"])
    assert f"--out {drafter}" in err and "non-empty directory that dflash-jax quantize did not write" in err
    assert "--overwrite" in err and tree_hash(tmp_path) == before
    with pytest.raises(atomic.WriteError, match="did not write"):  # the library call refuses it too
        quark.quantize_checkpoint(dense, drafter, progress=False)
    assert tree_hash(tmp_path) == before
    for out in (dense, dense / "mxfp4", tmp_path):  # its own input, inside it, or holding it: even with --overwrite
        err = _fail(capsys, ["quantize", "--model", str(dense), "--out", str(out), "--overwrite", "--quiet"])
        assert str(out) in err and f"source checkpoint {dense}" in err
        assert tree_hash(tmp_path) == before
    monkeypatch.setattr(target_module, "load_target", load)
    assert cli.main(["quantize", "--model", str(dense), "--out", str(drafter), "--overwrite", "--quiet"]) == 0
    assert atomic.written_by(drafter) == quark.WRITER
    assert load_target(drafter, jnp.float32, progress=False).cfg.num_hidden_layers == 4
    assert cli.main(["quantize", "--model", str(dense), "--out", str(drafter), "--quiet"]) == 0  # a rerun: its own


def test_train_commands_never_write_into_their_input_or_a_foreign_directory(tmp_path, capsys):
    target = _drafter_dir(tmp_path / "target")
    user = tmp_path / "notes"
    user.mkdir()
    (user / "todo.txt").write_text("keep me")
    before = tree_hash(tmp_path)
    argv = {"train drafter": ["--target", str(target)], "train mtp": ["--target", str(target)],
            "train target": ["--tokenizer", str(target)], "train tokenizer": []}
    for command, inputs in argv.items():
        err = _fail(capsys, [*command.split(), *inputs, "--out", str(user)])
        assert f"--out {user}" in err and f"non-empty directory that dflash-jax {command} did not write" in err
        if inputs:
            err = _fail(capsys, [*command.split(), *inputs, "--out", inputs[1], "--overwrite"])
            assert f"--out {target.absolute()} is or holds the source checkpoint {target}" in err
            err = _fail(capsys, [*command.split(), *inputs, "--out", str(tmp_path / "new"), "--ckpt-dir",
                                 str(target / "ck")])
            assert f"--ckpt-dir {target / 'ck'} is inside the source checkpoint {target}" in err
        assert tree_hash(tmp_path) == before
    err = _fail(capsys, ["train", "target", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "o"),
                         "--ckpt-dir", str(tmp_path / "o" / "ck")])
    assert "overlap" in err


def test_train_tokenizer_on_a_corpus_directory_writes_reruns_and_refuses_others(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    out = tmp_path / "tok"
    assert cli.main(["train", "tokenizer", "--corpus", str(corpus), "--vocab", "300", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and atomic.written_by(out) == "dflash-jax train tokenizer"
    assert cli.main(["train", "tokenizer", "--corpus", str(corpus), "--vocab", "300", "--out", str(out)]) == 0
    before = tree_hash(tmp_path)
    err = _fail(capsys, ["train", "target", "--tokenizer", str(tmp_path / "other"), "--corpus", str(corpus),
                         "--out", str(out)])
    assert "dflash-jax train target did not write (dflash-jax train tokenizer wrote it)" in err
    assert tree_hash(tmp_path) == before


def test_bench_out_that_holds_a_user_file_is_refused(tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "bench.json").write_text('{"mine": true}')
    before = tree_hash(tmp_path)
    err = _fail(capsys, ["bench", "--out", str(out), "--quiet"])
    assert f"--out {out}" in err and "dflash-jax bench did not write" in err
    assert tree_hash(tmp_path) == before


def test_a_tools_json_file_replaces_only_its_own(tmp_path, capsys):
    """--json OUT of a tool: an existing file it did not write is refused (unchanged) unless --overwrite; the file
    it writes is marked as its own, so a rerun replaces it."""
    import argparse

    from dflash_jax.cli import args as cli_args

    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    before = tree_hash(tmp_path)
    err = _fail(capsys, ["report", "perf-model", "--json", str(mine)])
    assert f"--json {mine}: an existing file that dflash-jax report perf-model did not write" in err
    assert "--overwrite" in err
    assert tree_hash(tmp_path) == before

    def tool(args):
        atomic.write_text(args.json, '{"rows": []}')

    out = tmp_path / "rows.json"
    ns = dict(command="report perf-model", json=str(out), func=tool, overwrite=False)
    assert cli_args.run(lambda: argparse.Namespace(**ns)) == 0
    if atomic.file_written_by(out) is None:
        pytest.skip("this file system keeps no extended attributes")
    assert cli_args.run(lambda: argparse.Namespace(**ns)) == 0  # a rerun replaces its own file
    assert cli_args.run(lambda: argparse.Namespace(**{**ns, "json": str(mine), "overwrite": True})) == 0
    assert json.loads(mine.read_text()) == {"rows": []}
