"""Writes of user files that appear whole or not at all: converted checkpoints, training checkpoints,
exports, benchmark results.

Everything is written into a fresh hidden sibling (``.NAME.tmp-<pid>-<random>``), flushed to disk, then
moved over ``NAME`` in one rename (for a directory that replaces an existing one: an atomic exchange,
then the old content is removed); a symlinked ``NAME`` is written through (what it points to is
replaced, the link kept). An interrupted writer therefore leaves the previous ``NAME`` untouched, plus
at most a stray hidden temporary. A directory writer holds an exclusive lock
(``.NAME.lock`` beside it) for the whole write: a second concurrent writer fails at once with
``WriteError`` instead of mixing its files with the first one's, and a write refuses an output that is
or holds the checkpoint it reads (``source``: replacing the output would delete it). ``write_manifest`` /
``verify_manifest`` give a directory a list of its files with sizes and SHA-256s: the sizes are checked
before every read (a truncated or missing file), the checksums when asked (a full extra read of the data).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

MANIFEST = "dflash_jax.manifest.json"
# Left in every directory a dflash-jax command writes, naming the command: a later run of that command may replace
# or add to the directory, any other writer only when told to (``--overwrite``).
MARKER = "dflash_jax.output.json"
_CHUNK = 1 << 24


class WriteError(OSError):
    """An output that cannot be written (unwritable location, another writer, not a directory)."""


class IntegrityError(ValueError):
    """A written directory that is incomplete or whose files no longer match their manifest."""


def _resolved(path: str | Path) -> Path:
    """The path a write replaces: ``path`` absolute, its symlinks resolved. A write through a symlinked
    output replaces what the link points to (beside it, in its folder) and keeps the link; replacing the
    link itself would leave the old link behind as a temporary and the old content where it points."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise WriteError(f"cannot write {path}: {e}") from e


def _temp_sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def check_writable(directory: str | Path, what: str = "output directory") -> Path:
    """Creates ``directory`` if needed and proves a file can be written there now, before long work whose
    result goes there; else ``WriteError`` naming ``what`` (a flag such as ``--out``) and the folder."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise WriteError(f"{what} {directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = _temp_sibling(directory / "probe", "tmp")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise WriteError(f"{what} {directory}: not writable ({e.strerror or e})") from e
    return directory


def write_bytes(path: str | Path, data: bytes) -> None:
    """Writes a file atomically (unique temporary + fsync + rename): readers see the old or the new bytes."""
    with file_writer(path) as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


@contextlib.contextmanager
def file_writer(path: str | Path) -> Iterator[BinaryIO]:
    """``with file_writer(p) as f: f.write(...)``: the file at ``p`` (a symlink: the file it points to)
    appears, whole, only if the block ends."""
    path = _resolved(path)
    tmp = _temp_sibling(path, "tmp")
    try:
        f = open(tmp, "wb")
    except OSError as e:
        raise WriteError(f"cannot write {path}: {e.strerror or e}") from e
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two existing paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def written_by(directory: str | Path) -> str | None:
    """The writer recorded in ``directory``'s marker (``MARKER``); None where there is none."""
    try:
        writer = json.loads((Path(directory) / MARKER).read_text()).get("writer")
    except (OSError, ValueError, AttributeError):
        return None
    return writer if isinstance(writer, str) else None


def mark(directory: str | Path, writer: str) -> None:
    """Records ``writer`` as the writer of ``directory`` (``written_by``)."""
    write_text(Path(directory) / MARKER, json.dumps({"writer": writer}))


def _check_sources(given: Path, path: Path, sources, name: str) -> None:
    """Refuses an output that is, holds or lies inside one of the checkpoints it reads (symlinks resolved)."""
    for source in sources:
        source = Path(source).absolute()
        real_source = source.resolve()
        links = "" if (path, real_source) == (given, source) else \
            f" (with symlinks resolved: {path} and {real_source})"
        if real_source.is_relative_to(path):
            raise WriteError(f"{name} is or holds the source checkpoint {source}{links}; replacing it "
                             "would delete the source: write to another directory")
        if path.is_relative_to(real_source):
            raise WriteError(f"{name} is inside the source checkpoint {source}{links}; a command never writes "
                             "into the model it reads: write to another directory")


def claim_directory(path: str | Path, *, writer: str, flag: str = "--out", overwrite: bool = False,
                    sources=(), create: bool = True) -> Path:
    """An output directory a command fills file by file (results, plots, training checkpoints): created and marked
    as ``writer``'s when new or empty; an existing one only if ``writer`` marked it (a rerun) or with ``overwrite``.
    Never one that is, holds or is inside a checkpoint in ``sources``. Refusals (``WriteError``) name the flag and
    both paths; nothing is written then (nor ever with ``create`` false: the checks alone)."""
    given, real = Path(path).absolute(), _resolved(path)
    _check_sources(given, real, sources, f"{flag} {given}")
    if real.exists() and not real.is_dir():
        raise WriteError(f"{flag} {given}: exists and is not a directory")
    if real.is_dir() and any(real.iterdir()) and written_by(real) != writer and not overwrite:
        raise WriteError(f"{flag} {given}: a non-empty directory that {writer} did not write ({_marked(real)}); "
                         "refusing to write into it: give a new or empty directory, or --overwrite")
    if not create:
        return real
    check_writable(real, flag)
    if written_by(real) != writer:
        mark(real, writer)
    return real


def release_claim(path: str | Path, *, writer: str, existed: bool) -> bool:
    """Undoes a ``claim_directory`` that nothing followed (the command failed before writing there): when ``path``
    holds only ``writer``'s marker, the marker is removed, and the directory too unless it ``existed`` before the
    claim (an empty folder of the user's stays, empty). Anything else in it is left alone. True if undone."""
    path = Path(path)
    try:
        entries = [e.name for e in os.scandir(path)]
    except OSError:
        return False
    if entries != [MARKER] or written_by(path) != writer:
        return False
    with contextlib.suppress(OSError):
        (path / MARKER).unlink()
        if not existed:
            path.rmdir()
    return True


@contextlib.contextmanager
def claimed(path: str | Path, *, writer: str, flag: str = "--out", overwrite: bool = False,
            sources=()) -> Iterator[Path]:
    """``claim_directory`` for the length of a block: if the block raises (or is interrupted) before anything but the
    marker was written into the directory, the claim is undone (``release_claim``), so a failed run leaves no
    directory holding only its marker."""
    existed = Path(path).is_dir()
    real = claim_directory(path, writer=writer, flag=flag, overwrite=overwrite, sources=sources)
    try:
        yield real
    except BaseException:
        release_claim(real, writer=writer, existed=existed)
        raise


_XATTR = "user.dflash_jax.writer"  # a written file's marker, in its metadata (its content is the user's format)


def file_written_by(path: str | Path) -> str | None:
    """The writer recorded on a file by ``mark_file``; None where there is none (or the file system keeps no
    extended attributes)."""
    try:
        return os.getxattr(path, _XATTR).decode()
    except (OSError, AttributeError, UnicodeDecodeError):
        return None


def mark_file(path: str | Path, writer: str) -> None:
    """Records ``writer`` on the file ``path`` (``file_written_by``); silently nothing where unsupported."""
    with contextlib.suppress(OSError, AttributeError):
        os.setxattr(path, _XATTR, writer.encode())


def check_output_file(path: str | Path, *, writer: str, flag: str, overwrite: bool = False, sources=()) -> Path:
    """An output file (a tool's JSON): new, or one ``writer`` wrote before (``mark_file``), or ``overwrite``;
    never a directory, nor in an input model's directory. Refusals (``WriteError``) name the flag and the path."""
    given, real = Path(path).absolute(), _resolved(path)
    _check_sources(given, real, sources, f"{flag} {given}")
    if real.is_dir():
        raise WriteError(f"{flag} {given}: is a directory; give a file name")
    if real.exists() and not overwrite and file_written_by(real) != writer:
        raise WriteError(f"{flag} {given}: an existing file that {writer} did not write; refusing to replace it: "
                         "give a new file name, or --overwrite")
    return real


def _marked(path: Path) -> str:
    writer = written_by(path)
    return f"{writer} wrote it" if writer else f"no {MARKER} in it"


def check_replaceable(path: str | Path, *, replaces: Callable[[Path], bool] | None = None, what: str = "output",
                      source: str | Path | None = None, sources=(), writer: str | None = None,
                      overwrite: bool = False, flag: str | None = None) -> Path:
    """The checks ``directory_writer`` makes before it writes, on their own (a long job makes them first, so
    that an output it may not write fails before the work, not after); returns the path written: ``path``
    absolute, its symlinks resolved (a symlinked output is written through, the link kept).

    Raises ``WriteError`` when ``path`` is, holds or lies inside a checkpoint (``source``, ``sources``) that the
    write reads (symlinks resolved: replacing ``path`` would delete it), ``path`` is a file, a non-empty
    directory that is not replaceable (a folder of the user's that a ``what`` must not wipe), or in a parent that
    cannot be written. Replaceable: ``writer`` recorded in its marker (``written_by``), or ``replaces(path)``
    true, or ``overwrite``; with neither ``writer`` nor ``replaces`` any directory is.
    """
    given, path = Path(path).absolute(), _resolved(path)
    name = f"{flag} {given}" if flag else f"the {what} {given}"
    _check_sources(given, path, [s for s in (source, *sources) if s is not None], name)
    if path.exists() and not path.is_dir():
        raise WriteError(f"{path} exists and is not a directory")
    guarded = writer is not None or replaces is not None
    if guarded and not overwrite and path.is_dir() and any(path.iterdir()) and written_by(path) != writer and not (
            replaces is not None and replaces(path)):
        whose = f"that {writer} did not write ({_marked(path)})" if replaces is None else f"that is not a {what}"
        raise WriteError(f"{name} is a non-empty directory {whose}; refusing to replace it: write to a new or empty "
                         "directory" + (", or pass --overwrite" if writer else ""))
    check_writable(path.parent)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_dead_temporaries(path: Path) -> None:
    """Temporaries beside ``path`` (``.NAME.tmp-<pid>-...``, ``.NAME.old-<pid>-...``) whose writer is no longer
    running: a killed writer's leftovers, removed by the next writer (which holds the lock)."""
    for stray in path.parent.glob(f".{glob.escape(path.name)}.*-*-*"):
        kind, _, rest = stray.name[len(path.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind in ("tmp", "old") and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            if stray.is_dir() and not stray.is_symlink():
                shutil.rmtree(stray, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    stray.unlink()


@contextlib.contextmanager
def directory_writer(path: str | Path, *, replaces: Callable[[Path], bool] | None = None,
                     what: str = "output", source: str | Path | None = None, sources=(), writer: str | None = None,
                     overwrite: bool = False, flag: str | None = None) -> Iterator[Path]:
    """Yields an empty temporary directory to fill; when the block ends it replaces ``path`` (a symlink: the
    directory it points to) whole.

    On an exception (or a kill) the previous ``path`` stays as it was. Refuses (``WriteError``) what
    ``check_replaceable`` refuses, before anything is written, and while another process is writing
    ``path``. A write that reads a checkpoint directory passes it as ``source``. With ``writer`` the new
    directory carries its marker (``written_by``). Temporaries of earlier writers that died are removed.
    """
    path = check_replaceable(path, replaces=replaces, what=what, source=source, sources=sources, writer=writer,
                             overwrite=overwrite, flag=flag)
    lock_file = path.with_name(f".{path.name}.lock")
    with open(lock_file, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WriteError(f"another process is writing {path} (it holds {lock_file}); "
                             "wait for it to finish or write elsewhere") from None
        _remove_dead_temporaries(path)
        tmp = _temp_sibling(path, "tmp")
        tmp.mkdir()
        try:
            if writer is not None:
                mark(tmp, writer)
            yield tmp
            _fsync_tree(tmp)
            if path.exists():
                if not _exchange(tmp, path):  # no atomic exchange here: move the old copy aside first
                    old = _temp_sibling(path, "old")
                    os.rename(path, old)
                    os.rename(tmp, path)
                    tmp = old
            else:
                os.rename(tmp, path)
            _fsync(path.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            # Removed while still held. A writer that opened it just before may then lock the removed
            # file while a third locks a new one; both still end with one whole copy (the swap is atomic).
            lock_file.unlink(missing_ok=True)


def sha256(file: str | Path) -> str:
    """The SHA-256 (hex) of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def _sha256s(files: list[Path]) -> list[str]:
    """SHA-256 of each file, several at once (hashlib releases the GIL; a 27B copy is tens of GB)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, files))


def write_manifest(root: str | Path) -> None:
    """Records the size and SHA-256 of every file under ``root`` in ``root/MANIFEST`` (write it last)."""
    root = Path(root)
    found = _files(root)
    files = {rel: {"size": p.stat().st_size, "sha256": digest}
             for (rel, p), digest in zip(found.items(), _sha256s(list(found.values())), strict=True)}
    write_text(root / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1))


def verify_manifest(root: str | Path, what: str = "directory", *, checksums: bool = False) -> None:
    """Raises ``IntegrityError`` unless every file listed in ``root``'s manifest is there with its size and,
    with ``checksums``, its SHA-256 (which reads every byte: tens of GB for a 27B copy)."""
    root = Path(root)
    try:
        listed = json.loads((root / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise IntegrityError(f"incomplete {what} at {root}: no {MANIFEST} (the write did not finish, or a "
                             "dflash_jax without manifests wrote it; write it again)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"{root / MANIFEST}: unreadable manifest ({e})") from e
    if not isinstance(listed, dict):
        raise IntegrityError(f"{root / MANIFEST}: unreadable manifest (files is not an object)")
    real_root = root.resolve()
    for rel, want in listed.items():
        p = root / rel
        # A listed path is confined to the directory before anything at it is touched.
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not p.resolve().is_relative_to(real_root):
            raise IntegrityError(f"{root / MANIFEST}: lists {rel!r}, which is outside {root}; refusing to read it")
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            raise IntegrityError(f"{root / MANIFEST}: unreadable manifest entry for {rel!r}: {want!r}")
        if not p.is_file():
            raise IntegrityError(f"incomplete {what} at {root}: {rel} is missing")
        if p.stat().st_size != want["size"]:
            raise IntegrityError(f"corrupt {what} at {root}: {rel} has {p.stat().st_size} bytes, its manifest "
                                 f"says {want['size']}")
    if not checksums:
        return
    for (rel, want), digest in zip(listed.items(), _sha256s([root / rel for rel in listed]), strict=True):
        if digest != want["sha256"]:
            raise IntegrityError(f"corrupt {what} at {root}: {rel} does not match its checksum in {MANIFEST}")
