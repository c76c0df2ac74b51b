"""The training corpus every machine has offline: the Python standard library's own source.

Sits at the bottom of ``dflash_jax.train``: the tokenizer is trained on it, the target is pretrained
on it, and the drafter/MTP data are the target's continuations of its snippets. Files are sorted and
split into train / held-out by a hash of their relative path, so the split is the same everywhere.
``prompt_windows`` cuts training prompts out of other prompt sets (HumanEval problems the evaluation
never uses), so the drafter/MTP data also covers the prompts' style.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

# Test suites are large, repetitive and full of deliberately odd code; site-packages is not the stdlib.
SKIP_PARTS = {"test", "tests", "site-packages", "idle_test", "__pycache__", "lib2to3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _held_out(rel: str, fraction: float) -> bool:
    digest = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little")
    return digest / 2**64 < fraction


def stdlib_files(split: str, *, held_out: float = 0.05, root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library in ``split`` ("train" or "heldout")."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root() if root is None else root
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if SKIP_PARTS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if _held_out(rel.as_posix(), held_out) == (split == "heldout"):
            out.append(f)
    return out


def read_texts(files: list[Path]) -> Iterator[str]:
    for f in files:
        try:
            yield f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # a few stdlib files are latin-1 test fixtures
            continue


def user_texts(path: str | Path, flag: str = "--corpus") -> list[str]:
    """A corpus of one's own: a directory (every file under it, in sorted order, read as UTF-8; hidden files and
    files that are not UTF-8 text are skipped) or a JSONL file with one ``{"text": ...}`` object per line (a
    ``"prompt"`` string is taken too). Errors name ``flag`` and the file."""
    from dflash_jax.decoding.runtime import read_jsonl

    path = Path(path)
    if path.is_dir():
        files = [f for f in sorted(path.rglob("*")) if f.is_file()
                 and not any(part.startswith(".") for part in f.relative_to(path).parts)]
        texts = [t for t in read_texts(files) if t.strip()]
        if not texts:
            raise ValueError(f"{flag} {path}: no UTF-8 text files in the directory")
        return texts
    texts = []
    for i, row in enumerate(read_jsonl(str(path), flag), 1):
        text = row.get("text", row.get("prompt"))
        if not isinstance(text, str):
            raise ValueError(f'{flag} {path}: object {i} has no "text" string (keys: {sorted(row)[:5]})')
        texts.append(text)
    if not any(t.strip() for t in texts):
        raise ValueError(f"{flag} {path}: no texts in the file")
    return texts


def token_stream(tokenizer, files: list[Path], eos_id: int) -> np.ndarray:
    """All files tokenised and joined into one int32 stream, each file followed by EOS."""
    return text_stream(tokenizer, list(read_texts(files)), eos_id)


def text_stream(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """Texts tokenised and joined into one int32 stream, each followed by EOS."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, np.int32)


def windows(stream: np.ndarray, length: int, batch: int, *, seed: int) -> Iterator[np.ndarray]:
    """Endless batches [batch, length] of windows at random offsets of the stream (seeded, reproducible)."""
    if len(stream) <= length:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window of {length}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(stream) - length, size=batch)
        yield np.stack([stream[s:s + length] for s in starts])


def eval_windows(stream: np.ndarray, length: int, count: int) -> np.ndarray:
    """``count`` evenly spaced, non-random windows [count, length] (a fixed held-out set)."""
    starts = np.linspace(0, len(stream) - length - 1, count).astype(np.int64)
    return np.stack([stream[s:s + length] for s in starts])


def prompt_windows(prompts: list[list[int]], length: int, count: int, *, seed: int) -> np.ndarray:
    """``count`` windows [count, length], each the last ``length`` tokens of a prefix of a prompt.

    The first windows end where each prompt ends (where decoding starts); the rest end at random cut
    points (seeded) of randomly drawn prompts. Prompts shorter than ``length`` are skipped.
    """
    usable = [np.asarray(p, np.int32) for p in prompts if len(p) >= length]
    if not usable:
        raise ValueError(f"no prompt has the {length} tokens a window needs (longest: "
                         f"{max((len(p) for p in prompts), default=0)})")
    rng = np.random.default_rng(seed)
    ends = [(i, len(p)) for i, p in enumerate(usable)][:count]
    while len(ends) < count:
        i = int(rng.integers(len(usable)))
        ends.append((i, int(rng.integers(length, len(usable[i]) + 1))))
    return np.stack([usable[i][e - length:e] for i, e in ends])
