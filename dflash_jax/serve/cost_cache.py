"""The warm-up's step-cost table kept across starts, beside the compilation cache (``io/compile_cache.py``).

``dflash-jax serve`` times every step program at warm-up for speculation by load (``schedule.measure``: each
(rows bucket, option) three times, plus the host copy) and every prompt chunk width, interleaved with them, for
the chunks' size while requests run (``Engine._budget``). A second start of the same configuration on the same
machine would measure the same table, so the first writes it to a file in ``--compilation-cache-dir`` and the
second loads it instead of timing the steps; the served steps then move it toward their own times as always
(``Schedule.timed``). The file is named by a digest of its ``fingerprint``: the start's configuration (the
flags and resolved settings the caller gives), each model folder's files (names, sizes, modification times),
this package's source files (the same), the JAX and jaxlib versions, the backend and its devices, ``XLA_FLAGS``
and the host's name and cores. A change to any of them names another file, so a table is never used across
configurations; one that cannot be read, or whose fingerprint or programs differ from this start's, is ignored
with a log line (and the steps are timed again). Files are written atomically (``io/atomic.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path

from dflash_jax.io import atomic
from dflash_jax.serve.schedule import Option

log = logging.getLogger("dflash_jax.serve")

Table = tuple[dict[tuple[int, Option], float], float, dict[int, float]]
# (seconds per step by (rows, option), the host copy's, seconds per prompt chunk by width)


def _files(folder: Path, pattern: str = "*") -> list[list]:
    """[name, size, modification time in ns] of every file under ``folder`` whose name matches ``pattern``."""
    stamps = []
    for path in sorted(p for p in folder.rglob(pattern) if p.is_file()):
        st = path.stat()
        stamps.append([path.relative_to(folder).as_posix(), st.st_size, st.st_mtime_ns])
    return stamps


def fingerprint(config: Mapping, model_dirs: Iterable[str | os.PathLike]) -> dict:
    """What a start's step costs depend on: ``config`` (JSON-able: the flags and settings of the engine), the files
    of ``model_dirs``, this package's sources, JAX, the backend and devices, ``XLA_FLAGS`` and the host."""
    import jax
    import jaxlib

    package = Path(__file__).resolve().parents[1]
    code = hashlib.sha256(json.dumps(_files(package, "*.py")).encode()).hexdigest()
    return dict(config=json.loads(json.dumps(config, sort_keys=True, default=str)),
                models={str(Path(d).resolve()): _files(Path(d)) for d in model_dirs},
                code=code, jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
                devices=[d.device_kind for d in jax.devices()], xla_flags=os.environ.get("XLA_FLAGS", ""),
                host=platform.node(), cores=os.cpu_count())


def path(folder: str | os.PathLike, fingerprint: Mapping) -> Path:
    """The file of the table of ``fingerprint`` in ``folder``."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:24]
    return Path(folder) / f"dflash-jax-step-costs-{digest}.json"


def save(folder: str | os.PathLike, fingerprint: Mapping, table: Table) -> Path | None:
    """Writes ``table`` for ``fingerprint`` into ``folder`` (atomically); returns its file, or None (logged) where
    it cannot be written: the start goes on."""
    costs, copy, chunks = table
    file = path(folder, fingerprint)
    text = json.dumps(dict(fingerprint=fingerprint, copy=copy,
                           costs=[[r, o.block, o.budget, c] for (r, o), c in costs.items()],
                           chunks=[[w, c] for w, c in chunks.items()]), indent=1)
    try:
        atomic.write_text(file, text)
    except OSError as e:
        log.warning("could not keep the step costs in %s (%s); the next start times them again", file, e)
        return None
    return file


def load(folder: str | os.PathLike, fingerprint: Mapping, programs: Iterable[tuple[int, Option]],
         widths: Iterable[int]) -> Table | None:
    """The table an earlier start of ``fingerprint`` wrote into ``folder``, if it holds a positive, finite cost for
    exactly ``programs`` ((rows, option) pairs) and the prompt chunks of ``widths``; else None (a file that exists
    but does not fit, one written before chunks were timed included: logged)."""
    file = path(folder, fingerprint)
    if not file.exists():
        return None
    try:
        data = json.loads(file.read_text())
        costs = {(int(r), Option(int(b), None if t is None else int(t))): float(c) for r, b, t, c in data["costs"]}
        chunks = {int(w): float(c) for w, c in data["chunks"]}
        copy = float(data["copy"])
        if data["fingerprint"] != json.loads(json.dumps(fingerprint)):
            raise ValueError("it was measured for another configuration")
        if set(costs) != set(programs) or set(chunks) != set(widths):
            raise ValueError("its programs are not this start's")
        if not all(math.isfinite(c) and c > 0 for c in [*costs.values(), *chunks.values()]) or not 0 <= copy < math.inf:
            raise ValueError("a cost is not a positive number")
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("ignoring the step costs in %s (%s); the steps are timed again", file, e)
        return None
    return costs, copy, chunks
