"""One digest of a directory tree, for tests that prove a refused write touched nothing."""

from __future__ import annotations

import hashlib


def tree_hash(root) -> str:
    """One digest of every file's path and bytes under ``root`` (and of the folder names)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()
