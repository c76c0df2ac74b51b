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


def classify(data: bytes) -> tuple[str | None, str]:
    """(text, "") for UTF-8 text (a byte-order mark dropped); else (None, why it is not: "UTF-16", "binary",
    "not UTF-8")."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        return None, "UTF-16"
    if b"\x00" in data:
        half = max(len(data) // 2, 1)  # ASCII in UTF-16 without a mark: every other byte is zero
        if data[1::2].count(0) > 0.4 * half or data[0::2].count(0) > 0.4 * half:
            return None, "UTF-16"
        return None, "binary"
    try:
        return data.decode("utf-8-sig"), ""
    except UnicodeDecodeError:
        return None, "not UTF-8"


WHY = {"UTF-16": "UTF-16 (save them as UTF-8)", "binary": "binary (NUL bytes)",
       "not UTF-8": "not UTF-8 (latin-1 or another 8-bit encoding; save them as UTF-8)",
       "empty": "empty or whitespace only", "unreadable": "unreadable"}


def read_dir(path: Path) -> tuple[list[str], dict[str, list[Path]]]:
    """The texts of every file under ``path`` (sorted; hidden files and folders left out) and the files skipped,
    by reason (``WHY``'s keys)."""
    texts, skipped = [], {}
    for f in sorted(path.rglob("*")):
        if not f.is_file() or any(part.startswith(".") for part in f.relative_to(path).parts):
            continue
        try:
            text, why = classify(f.read_bytes())
        except OSError:
            text, why = None, "unreadable"
        if text is not None and not text.strip():
            text, why = None, "empty"
        if text is None:
            skipped.setdefault(why, []).append(f)
        else:
            texts.append(text)
    return texts, skipped


def skipped_summary(skipped: dict[str, list[Path]], root: Path) -> str:
    """"3 files skipped: 2 not UTF-8 (...): a.txt, b.txt; 1 binary (NUL bytes): c.bin" (five names per reason)."""
    parts = []
    for why, files in skipped.items():
        names = ", ".join(f.relative_to(root).as_posix() for f in files[:5]) + (", ..." if len(files) > 5 else "")
        parts.append(f"{len(files)} {WHY[why]}: {names}")
    n = sum(map(len, skipped.values()))
    return f"{n} file{'s' * (n != 1)} skipped: " + "; ".join(parts)


def user_texts(path: str | Path, flag: str = "--corpus") -> list[str]:
    """A corpus of one's own: a directory (every file under it, in sorted order, read as UTF-8; hidden files are
    left out, and files that are not UTF-8 text skipped, counted by reason on stderr) or a JSONL file with one
    ``{"text": ...}`` object per line (a ``"prompt"`` string is taken too). Errors name ``flag`` and the file."""
    import sys

    from dflash_jax.decoding.workloads import read_jsonl

    path = Path(path)
    if path.is_dir():
        texts, skipped = read_dir(path)
        if not texts:
            raise ValueError(f"{flag} {path}: no UTF-8 text files in the directory"
                             + (f" ({skipped_summary(skipped, path)})" if skipped else ""))
        if skipped:
            print(f"{flag} {path}: read {len(texts)} text files; {skipped_summary(skipped, path)}", file=sys.stderr)
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


ENCODE_CHUNK = 16  # texts per native encode call: Ctrl-C is taken between calls (one call over the stdlib: 5-10 s)


def text_stream(tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """Texts tokenised and joined into one int32 stream, each followed by EOS."""
    ids: list[int] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        for enc in tokenizer.encode_batch(texts[start:start + ENCODE_CHUNK]):
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
