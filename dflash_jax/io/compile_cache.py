"""JAX's persistent compilation cache for the commands that compile (``serve``, ``generate``, ``bench``).

A command calls ``enable(path)`` with its ``--compilation-cache-dir`` before it compiles anything: every
program XLA compiles from then on is written to that folder, keyed by its HLO, the compile options, the XLA
flags and the backend's version, and a later process that compiles the same program loads it instead (as
vLLM keeps its compiled graphs under ``~/.cache/vllm``). JAX writes only programs that took a second or more
to compile by default; here every program is kept (a serving start compiles dozens of sub-second ones too).
The default folder is ``$DFLASH_JAX_COMPILATION_CACHE_DIR`` when set, else ``dflash-jax/jax-compilation-cache``
under the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``); an empty path turns the cache off.
The folder is trusted as code is: a program found there runs as compiled, so it must not be writable by others.
``tally()`` counts, from ``enable`` on, the programs compiled and those loaded from the folder (JAX's monitoring
events), which a command can print when it is ready. JAX is imported by ``enable``, not here: a parser that adds
the flag loads nothing heavy.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

ENV = "DFLASH_JAX_COMPILATION_CACHE_DIR"
HELP = (f"where compiled programs are kept across runs (JAX's persistent compilation cache): a second start of "
        f"the same configuration loads what the first compiled; '' turns it off (default: ${ENV}, else "
        f"$XDG_CACHE_HOME or ~/.cache, then dflash-jax/jax-compilation-cache)")


_LOOKUPS, _HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
_counts: collections.Counter = collections.Counter()  # JAX's events since ``enable``, counted by ``_count``
_listening: list = []  # ``_count`` once it is registered with JAX (which cannot be asked)
_lock = threading.Lock()  # programs compile on several threads at once (``serve``'s warm-up)


def _count(event: str, **_) -> None:
    if event in (_LOOKUPS, _HITS):
        with _lock:
            _counts[event] += 1


def tally() -> tuple[int, int]:
    """(programs compiled, programs loaded from the cache) since ``enable`` turned the cache on (JAX counts
    nothing while it is off)."""
    return _counts[_LOOKUPS] - _counts[_HITS], _counts[_HITS]


def default_dir() -> str:
    """``$DFLASH_JAX_COMPILATION_CACHE_DIR`` when set (empty: off), else the folder under the user's cache dir."""
    if ENV in os.environ:
        return os.environ[ENV]
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return str(Path(root) / "dflash-jax" / "jax-compilation-cache")


def add_argument(parser) -> None:
    """``--compilation-cache-dir`` on a subcommand's parser (None: ``default_dir()`` when the command runs)."""
    parser.add_argument("--compilation-cache-dir", metavar="DIR", default=None, help=HELP)


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Keeps every program compiled from now on in ``path`` (None: ``default_dir()``; '': the cache off) and
    loads from there what an earlier run compiled. Returns the folder (created), or None when off; a folder that
    cannot be created is a ``ValueError`` naming the flag."""
    import jax
    from jax import monitoring
    from jax.experimental.compilation_cache import compilation_cache

    path = default_dir() if path is None else os.fspath(path)
    compilation_cache.reset_cache()  # a cache JAX already opened (another folder) is let go
    if not path:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--compilation-cache-dir {path}: cannot create it ({e.strerror or e})") from None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every program, not only the slow ones
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # and of any size
    if _count not in _listening:  # JAX's events counted from the first call on
        monitoring.register_event_listener(_count)
        _listening.append(_count)
    _counts.clear()
    return folder
