"""Who may write where (issue 25): a writer writes only a new or empty directory, one it wrote before (its
marker), or with ``overwrite``; never a checkpoint it reads, or into one; and the temporaries of a killed
writer are removed by the next. Every refusal leaves the directories byte-for-byte as they were."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from dirhash import tree_hash

from dflash_jax.io import atomic


def _model(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    (path / "model.safetensors").write_bytes(b"drafter weights")
    return path


def test_a_directory_of_someone_else_is_refused_unchanged_and_overwrite_allows_it(tmp_path):
    drafter = _model(tmp_path / "drafter")
    before = tree_hash(tmp_path)
    for write in (lambda: atomic.claim_directory(drafter, writer="dflash-jax bench"),
                  lambda: atomic.check_replaceable(drafter, writer="dflash-jax quantize", flag="--out"),
                  lambda: atomic.directory_writer(drafter, writer="dflash-jax quantize", flag="--out").__enter__()):
        with pytest.raises(atomic.WriteError, match=rf"--out {drafter}.* non-empty directory that dflash-jax \w+ did "
                                                    rf"not write \(no {atomic.MARKER} in it\).*--overwrite"):
            write()
        assert tree_hash(tmp_path) == before
    with atomic.directory_writer(drafter, writer="dflash-jax quantize", overwrite=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert atomic.written_by(drafter) == "dflash-jax quantize"
    with atomic.directory_writer(drafter, writer="dflash-jax quantize") as tmp:  # its own: a rerun replaces it
        (tmp / "config.json").write_text('{"again": 1}')
    before = tree_hash(tmp_path)
    with pytest.raises(atomic.WriteError, match="that dflash-jax train-target did not write \\(dflash-jax quantize "
                                                "wrote it\\)"):
        atomic.check_replaceable(drafter, writer="dflash-jax train-target")
    assert tree_hash(tmp_path) == before


def test_claim_directory_creates_marks_and_reclaims(tmp_path):
    out = tmp_path / "bench_out"
    assert atomic.claim_directory(out, writer="dflash-jax bench") == out
    assert atomic.written_by(out) == "dflash-jax bench"
    (out / "bench.json").write_text("{}")
    atomic.claim_directory(out, writer="dflash-jax bench")  # a rerun writes there again
    empty = tmp_path / "empty"
    empty.mkdir()
    atomic.claim_directory(empty, writer="dflash-jax bench")
    with pytest.raises(atomic.WriteError, match="exists and is not a directory"):
        (tmp_path / "file").write_text("x")
        atomic.claim_directory(tmp_path / "file", writer="dflash-jax bench")


@pytest.mark.parametrize("where", ["is", "holds", "inside"])
def test_an_output_never_is_holds_or_lies_in_an_input_model(tmp_path, where):
    model = _model(tmp_path / "parent" / "model")
    out = {"is": model, "holds": tmp_path / "parent", "inside": model / "sub"}[where]
    before = tree_hash(tmp_path)
    phrase = "is inside the source checkpoint" if where == "inside" else "is or holds the source checkpoint"
    for write in (lambda: atomic.claim_directory(out, writer="w", sources=[model], overwrite=True),
                  lambda: atomic.directory_writer(out, writer="w", sources=[model], overwrite=True).__enter__()):
        with pytest.raises(atomic.WriteError, match=f"{out} {phrase} {model}"):
            write()
        assert tree_hash(tmp_path) == before


_KILLED = textwrap.dedent("""
    import sys
    from dflash_jax.io import atomic
    with atomic.directory_writer(sys.argv[1], writer="w") as tmp:
        (tmp / "big").write_bytes(b"x" * 1000)
        print(tmp, flush=True)
        sys.stdin.readline()
""")


def test_a_killed_writers_temporary_is_removed_by_the_next_run(tmp_path):
    out = tmp_path / "q"
    strays = []
    for _ in range(2):  # two killed runs: their temporaries do not accumulate
        p = subprocess.Popen([sys.executable, "-c", _KILLED, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        strays.append(p.stdout.readline().strip())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert not os.path.exists(strays[0]) and os.path.isdir(strays[1])  # the second run removed the first's
    live = tmp_path / f".q.tmp-{os.getppid()}-0000"  # a temporary of a running process is left alone
    live.mkdir()
    with atomic.directory_writer(out, writer="w") as tmp:
        (tmp / "a").write_text("1")
    assert not any(os.path.exists(s) for s in strays)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["q", live.name])
