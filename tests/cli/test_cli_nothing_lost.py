"""Nothing lost (issue 33, section 2): ``ship --work`` is claimed as every writer's output (a user's folder is
refused unchanged; with --overwrite its files are never taken as finished stages and its ship_log.json is replaced,
never merged), and a failed command leaves no output folder holding only its claim marker."""

from __future__ import annotations

import json

import pytest
from dirhash import tree_hash

from dflash_jax import cli
from dflash_jax.io import atomic
from dflash_jax.train import corpus, ship
from dflash_jax.train import tokenizer as tk

SMALL = ship.with_overrides(ship.TINY, ["vocab=300"])


def _fail(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dflash-jax: error: "), err  # one line, no traceback
    return err


def _user_work(path):
    """A user's folder holding what ship would write: a log, a tokenizer, a target, an export."""
    for rel, text in {"ship_log.json": '{"mine": 1}', "tokenizer/tokenizer.json": "my tokenizer",
                      "target/model.safetensors": "my weights", "export/target/notes.txt": "keep me",
                      "notes.txt": "keep me too"}.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    """ship's corpus replaced by two small files: its tokenizer stage takes a fraction of a second."""
    files = []
    for i in range(2):
        files.append(tmp_path / f"corpus{i}.py")
        files[-1].write_text(f"def f{i}(x):\n    return [x * {i} for _ in range(3)]\n" * 50)
    monkeypatch.setattr(corpus, "stdlib_files", lambda split: files)
    return files


def test_ship_refuses_a_users_folder_unchanged(tmp_path, capsys):
    work = _user_work(tmp_path / "work")
    before = tree_hash(tmp_path)
    err = _fail(capsys, ["ship", "--tiny", "--work", str(work)])
    assert f"--work {work}: a non-empty directory that dflash-jax ship did not write" in err and "--overwrite" in err
    assert tree_hash(tmp_path) == before


def test_ship_with_overwrite_takes_nothing_of_the_users_as_finished_and_never_merges_their_log(
        tmp_path, capsys, small_corpus):
    work = _user_work(tmp_path / "work")
    # the user's tokenizer/tokenizer.json is not a finished tokenizer stage: the target stage cannot start
    err = _fail(capsys, ["ship", "--tiny", "--work", str(work), "--overwrite", "--stages", "target"])
    assert "the tokenizer result" in err and "missing or not as ship recorded it; run the tokenizer stage" in err
    assert json.loads((work / "ship_log.json").read_text()) == {"sizes": json.loads(json.dumps(
        ship.dataclasses.asdict(ship.TINY)))}  # the user's log replaced (--overwrite), not merged into
    # the tokenizer stage runs (the user's file is replaced) and the log starts afresh
    with pytest.raises(ValueError, match=r"the target result .* missing or not as ship recorded it"):
        ship.run(work, SMALL, ["tokenizer", "grow"], overwrite=True)
    log = json.loads((work / "ship_log.json").read_text())
    assert "mine" not in log and set(log) == {"sizes", "tokenizer"}
    assert tk.load(work / "tokenizer").get_vocab_size() == log["tokenizer"]["vocab"] > 256  # ship's, not the user's
    assert (work / "target/model.safetensors").read_text() == "my weights"  # not a stage result: never read
    assert (work / "notes.txt").read_text() == "keep me too"
    assert (work / "export/target/notes.txt").read_text() == "keep me"
    assert atomic.written_by(work) == ship.WRITER
    # a rerun (no --overwrite: the folder is ship's now) finds the tokenizer finished and does not retrain it
    capsys.readouterr()
    ship.run(work, SMALL, ["tokenizer"])
    assert "[ship] tokenizer:" not in capsys.readouterr().out


def test_a_stage_result_counts_as_finished_only_as_ship_recorded_it(tmp_path):
    work = tmp_path / "work"
    (work / "target").mkdir(parents=True)
    (work / "target" / "model.safetensors").write_bytes(b"weights")
    (work / "target" / "config.json").write_text("{}")
    assert not ship.finished({}, work, "target")  # there, but never recorded
    log = {"target": {"files": ship._files(work, ship.RESULTS["target"])}}
    assert ship.finished(log, work, "target")
    (work / "target" / "model.safetensors").write_bytes(b"weighty")  # same size, other bytes
    assert not ship.finished(log, work, "target")
    (work / "target" / "model.safetensors").write_bytes(b"weights")
    (work / "target" / "config.json").unlink()
    assert not ship.finished(log, work, "target")


def test_a_corrupt_ship_log_is_one_line_naming_it(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    atomic.mark(work, ship.WRITER)
    (work / "ship_log.json").write_text('{"tokenizer": {"seconds": 1')
    err = _fail(capsys, ["ship", "--tiny", "--work", str(work)])
    assert f"{work / 'ship_log.json'}: unreadable ship log" in err
    (work / "ship_log.json").write_text("[1, 2]")
    assert f"{work / 'ship_log.json'}: not a ship log" in _fail(capsys, ["ship", "--tiny", "--work", str(work)])


def test_a_failed_ship_leaves_no_work_folder(tmp_path, capsys):
    work = tmp_path / "new"
    _fail(capsys, ["ship", "--tiny", "--work", str(work), "--stages", "drafter"])
    assert not work.exists()


def test_train_target_without_a_tokenizer_names_the_path_and_leaves_no_output(tmp_path, capsys):
    tok = tmp_path / "tok"
    tok.mkdir()  # a tokenizer directory a failed train-tokenizer might have left: no tokenizer.json
    out, empty = tmp_path / "target", tmp_path / "empty"
    empty.mkdir()
    for where in (out, empty):
        err = _fail(capsys, ["train", "target", "--tokenizer", str(tok), "--out", str(where),
                             "--ckpt-dir", str(tmp_path / "ck")])
        assert f"--tokenizer {tok}: it holds no tokenizer.json" in err
    assert not out.exists() and not (tmp_path / "ck").exists()  # created by the claim, removed on failure
    assert empty.is_dir() and not any(empty.iterdir())  # the user's empty folder stays, empty
    err = _fail(capsys, ["train", "target", "--tokenizer", str(tmp_path / "nowhere"), "--out", str(out)])
    assert f"--tokenizer {tmp_path / 'nowhere'}: no such directory" in err
    (tok / "tokenizer.json").write_text("{not json")
    assert f"{tok / 'tokenizer.json'}: not a readable tokenizer" in _fail(
        capsys, ["train", "target", "--tokenizer", str(tok), "--out", str(out)])
    assert not out.exists()


def test_a_failed_train_tokenizer_leaves_no_output_folder(tmp_path, capsys):
    out = tmp_path / "tok"
    err = _fail(capsys, ["train", "tokenizer", "--vocab", "10", "--out", str(out)])
    assert "--vocab 10" in err and not out.exists()


def test_a_released_claim_keeps_anything_else(tmp_path):
    path = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic.claimed(path, writer="w"):
        (path / "partial.bin").write_bytes(b"x")  # something was written: the folder is not the claim's alone
        raise RuntimeError
    assert (path / "partial.bin").is_file() and atomic.written_by(path) == "w"
    with pytest.raises(RuntimeError), atomic.claimed(tmp_path / "fresh", writer="w"):
        raise RuntimeError
    assert not (tmp_path / "fresh").exists()
    assert not atomic.release_claim(path, writer="other", existed=False) and path.is_dir()
