"""Atomic writes (dflash_jax.io.atomic): whole or nothing under failures, kills and a second writer;
manifests that catch a flipped byte or a missing file; unwritable outputs fail fast, never hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dflash_jax.io import atomic


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_file_write_failure_keeps_the_old_file(tmp_path):
    f = tmp_path / "bench.json"
    atomic.write_text(f, "old")
    with pytest.raises(RuntimeError), atomic.file_writer(f) as out:
        out.write(b"half of the new cont")
        raise RuntimeError("disk full")
    assert f.read_text() == "old" and _siblings(f) == []
    atomic.write_text(f, "new")
    assert f.read_text() == "new" and _siblings(f) == []


def test_directory_write_failure_keeps_the_old_directory(tmp_path):
    d = tmp_path / "out"
    with atomic.directory_writer(d) as tmp:
        (tmp / "a").write_text("1")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text("2")
    assert _tree(d) == {"a": b"1", "sub/b": b"2"}
    with pytest.raises(RuntimeError), atomic.directory_writer(d) as tmp:
        (tmp / "a").write_text("new")
        raise RuntimeError("interrupted")
    assert _tree(d) == {"a": b"1", "sub/b": b"2"} and _siblings(d) == []
    with atomic.directory_writer(d) as tmp:  # replacing: nothing of the old copy survives
        (tmp / "c").write_text("3")
    assert _tree(d) == {"c": b"3"} and _siblings(d) == []


def test_directory_writer_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(atomic.WriteError, match="exists and is not a directory"), \
            atomic.directory_writer(tmp_path / "f"):
        pass


_WRITER = textwrap.dedent("""
    import sys, time
    from dflash_jax.io import atomic
    with atomic.directory_writer(sys.argv[1]) as tmp:
        (tmp / "a").write_text(sys.argv[2])
        (tmp / "b").write_text("half")
        print("ready", flush=True)
        sys.stdin.readline()  # until the test says go (or kills us)
        (tmp / "b").write_text(sys.argv[2])
""")


def _start_writer(path, content):
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), content], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_killed_writer_leaves_the_previous_copy(tmp_path):
    d = tmp_path / "out"
    with atomic.directory_writer(d) as tmp:
        (tmp / "a").write_text("old")
    p = _start_writer(d, "new")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert _tree(d) == {"a": b"old"}
    with atomic.directory_writer(d) as tmp:  # the dead writer's lock is gone with it
        (tmp / "a").write_text("again")
    assert _tree(d) == {"a": b"again"}


def test_second_concurrent_writer_fails_and_the_first_wins_whole(tmp_path):
    d = tmp_path / "out"
    p = _start_writer(d, "first")
    try:
        with pytest.raises(atomic.WriteError, match=f"another process is writing {d}"), \
                atomic.directory_writer(d) as tmp:
            (tmp / "a").write_text("second")
    finally:
        p.communicate("go\n", timeout=60)
    assert p.returncode == 0
    assert _tree(d) == {"a": b"first", "b": b"first"}


def test_manifest_catches_flips_missing_files_and_an_unfinished_write(tmp_path):
    d = tmp_path / "copy"
    d.mkdir()
    (d / "x.bin").write_bytes(bytes(range(256)))
    (d / "sub").mkdir()
    (d / "sub" / "y.json").write_text("{}")
    with pytest.raises(atomic.IntegrityError, match=f"incomplete thing at {d}: no {atomic.MANIFEST}"):
        atomic.verify_manifest(d, "thing")
    atomic.write_manifest(d)
    atomic.verify_manifest(d, "thing", checksums=True)
    assert set(json.loads((d / atomic.MANIFEST).read_text())["files"]) == {"x.bin", "sub/y.json"}
    raw = bytearray((d / "x.bin").read_bytes())
    raw[100] ^= 1
    (d / "x.bin").write_bytes(bytes(raw))
    atomic.verify_manifest(d, "thing")  # the sizes (checked before every load) still agree
    with pytest.raises(atomic.IntegrityError, match="corrupt thing .*x.bin does not match its checksum"):
        atomic.verify_manifest(d, "thing", checksums=True)
    (d / "x.bin").write_bytes(bytes(raw[:-1]))
    with pytest.raises(atomic.IntegrityError, match="corrupt thing .*x.bin has 255 bytes, its manifest says 256"):
        atomic.verify_manifest(d, "thing")
    (d / "x.bin").unlink()
    with pytest.raises(atomic.IntegrityError, match="x.bin is missing"):
        atomic.verify_manifest(d, "thing")


def test_unwritable_output_is_a_clear_error(tmp_path):
    assert atomic.check_writable(tmp_path / "a" / "b", "--out").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(atomic.WriteError, match=r"--out .*file: exists and is not a directory"):
        atomic.check_writable(tmp_path / "file", "--out")
    with pytest.raises(atomic.WriteError, match=r"--ckpt-dir .*file/out: not writable \(Not a directory\)"):
        atomic.check_writable(tmp_path / "file" / "out", "--ckpt-dir")
    with pytest.raises(atomic.WriteError, match="file: exists and is not a directory"), \
            atomic.directory_writer(tmp_path / "file" / "d"):
        pass
    with pytest.raises(atomic.WriteError, match="cannot write"):
        atomic.write_text(tmp_path / "file" / "x.json", "{}")
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe file is gone


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no file can be written into: mode 0o500, or as root (who ignores permission bits) a tmpfs
    mounted read-only."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                      capture_output=True).returncode:
        pytest.skip("running as root and cannot mount a read-only tmpfs here")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def test_a_read_only_dir_is_not_writable(read_only_dir):
    with pytest.raises(atomic.WriteError, match=f"--out {read_only_dir}: not writable"):
        atomic.check_writable(read_only_dir, "--out")
    with pytest.raises(atomic.WriteError, match="not writable"), atomic.directory_writer(read_only_dir / "d"):
        pass


def test_orbax_save_into_a_read_only_directory_fails_fast(read_only_dir):
    """Orbax itself raises there and then hangs the process at exit; save_params must refuse first."""
    code = ("import sys, jax.numpy as jnp; from dflash_jax.io import checkpoint\n"
            "checkpoint.save_params(sys.argv[1], {'w': jnp.ones(3)})")
    p = subprocess.run([sys.executable, "-c", code, str(read_only_dir / "step_1")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 1
    assert f"WriteError: output directory {read_only_dir}: not writable (" in p.stderr


def test_exports_write_each_file_whole(tmp_path):
    """The HF-format writers (tokenizer, target, drafter exports) go through atomic files; the tokenizer's
    bytes are the ones ``Tokenizer.save`` writes."""
    from tokenizers import Tokenizer

    from dflash_jax.frontend import ASSETS
    from dflash_jax.train.tokenizer import save_hf

    tok = Tokenizer.from_file(str(ASSETS / "target" / "tokenizer.json"))
    tok.save(str(tmp_path / "reference.json"))
    save_hf(tok, tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (tmp_path / "reference.json").read_bytes()
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_replacing_without_an_atomic_exchange(tmp_path, monkeypatch):
    """Where renameat2 is missing the old copy is moved aside, the new one renamed in, the old removed."""
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    d = tmp_path / "out"
    for content in ("1", "2"):
        with atomic.directory_writer(d) as tmp:
            (tmp / "a").write_text(content)
        assert _tree(d) == {"a": content.encode()} and _siblings(d) == []


def _checkpoint(root):
    """A parent folder that looks like a replaceable output (a config.json) holding a checkpoint ``src``."""
    (root / "src").mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / "src" / "model.safetensors").write_bytes(b"weights")
    return root / "src"


@pytest.mark.parametrize("out", ["src", ".", "link", "link/src", "src_link"])
def test_directory_writer_refuses_an_output_that_holds_its_source(tmp_path, out):
    """The output is the source, its parent, a symlink to the parent (or through it to the source), or the
    source is reached through a symlink: replacing the output would delete the source, so nothing is written."""
    src = _checkpoint(tmp_path / "parent")
    (tmp_path / "link").symlink_to(tmp_path / "parent")
    (tmp_path / "src_link").symlink_to(src)
    out = tmp_path / "parent" / out if out in ("src", ".") else tmp_path / out
    before = _tree(tmp_path / "parent")
    with pytest.raises(atomic.WriteError) as e, \
            atomic.directory_writer(out, replaces=lambda p: True, what="checkpoint", source=src) as tmp:
        (tmp / "config.json").write_text("new")
    assert _tree(tmp_path / "parent") == before and os.path.samefile(tmp_path / "link", tmp_path / "parent")
    assert f"checkpoint {out.absolute()} is or holds the source checkpoint {src}" in str(e.value)
    if out.is_symlink() or out.parent.is_symlink():
        assert f"with symlinks resolved: {out.resolve()} and {src}" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "parent", "src_link"]  # no lock, no temporary
    # Through a symlinked source: the checkpoint it points to is protected the same way.
    with pytest.raises(atomic.WriteError, match="is or holds the source checkpoint"), \
            atomic.directory_writer(tmp_path / "parent", replaces=lambda p: True, source=tmp_path / "src_link"):
        pass
    assert _tree(tmp_path / "parent") == before


def test_directory_writer_beside_but_never_inside_its_source(tmp_path):
    """An output next to the source is written; one inside it is refused (a command never writes into the
    model it reads), naming both paths, with nothing written."""
    src = _checkpoint(tmp_path / "parent")
    for out in (tmp_path / "parent" / "out", tmp_path / "parent" / "src2"):
        with atomic.directory_writer(out, source=src) as tmp:
            (tmp / "a").write_text("1")
        assert _tree(out) == {"a": b"1"}
    before = _tree(src)
    with pytest.raises(atomic.WriteError, match=f"{src / 'out'} is inside the source checkpoint {src}"), \
            atomic.directory_writer(src / "out", source=src) as tmp:
        (tmp / "a").write_text("1")
    assert _tree(src) == before and (src / "model.safetensors").read_bytes() == b"weights"


@pytest.mark.parametrize("exchange", [True, False])
def test_writes_through_a_symlinked_output_replace_its_target_and_leave_nothing_behind(tmp_path, monkeypatch,
                                                                                       exchange):
    """A symlinked output (``--out results`` -> a folder on a bigger disk) is written through: the folder or
    file it points to is replaced, the link stays a link, and no temporary, old copy or lock is left
    (replacing the link itself used to leave the swapped-out link behind as a hidden temporary)."""
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    disk, home = tmp_path / "disk", tmp_path / "home"
    disk.mkdir(), home.mkdir()
    (disk / "real").mkdir()
    (disk / "real" / "old").write_text("0")
    (home / "out").symlink_to(disk / "real")
    (home / "later").symlink_to(disk / "later")  # dangling: its folder is made by the write
    for link in (home / "out", home / "later"):
        for content in ("1", "2"):
            with atomic.directory_writer(link, replaces=lambda p: True) as tmp:
                (tmp / "a").write_text(content)
            assert link.is_symlink() and _tree(link) == {"a": content.encode()}, link
        with pytest.raises(RuntimeError), atomic.directory_writer(link, replaces=lambda p: True) as tmp:
            (tmp / "a").write_text("half")
            raise RuntimeError("interrupted")
        assert link.is_symlink() and _tree(link) == {"a": b"2"}
    (disk / "f.json").write_text("old")
    (home / "f.json").symlink_to(disk / "f.json")
    atomic.write_text(home / "f.json", "new")
    with pytest.raises(RuntimeError), atomic.file_writer(home / "f.json") as f:
        f.write(b"half")
        raise RuntimeError("disk full")
    assert (home / "f.json").is_symlink() and (disk / "f.json").read_text() == "new"
    assert sorted(p.name for p in home.iterdir()) == ["f.json", "later", "out"]
    assert sorted(p.name for p in disk.iterdir()) == ["f.json", "later", "real"]
    (home / "loop").symlink_to(home / "loop")
    for write in (lambda: atomic.write_text(home / "loop", "x"), lambda: atomic.check_replaceable(home / "loop")):
        with pytest.raises(atomic.WriteError, match=f"cannot write {home / 'loop'}: .*"):
            write()
