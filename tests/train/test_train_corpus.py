"""train/corpus.py: a stable disjoint stdlib split, seeded windows, prompt windows that end where they should."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_jax.train import corpus


def test_split_is_disjoint_and_covers_the_stdlib():
    train, held = corpus.stdlib_files("train"), corpus.stdlib_files("heldout")
    assert train and held and not set(train) & set(held)
    assert len(held) < len(train) / 10  # about 5% held out
    with pytest.raises(ValueError, match="split must be 'train' or 'heldout'"):
        corpus.stdlib_files("test")


def test_windows_are_seeded_and_in_bounds():
    stream = np.arange(100, dtype=np.int32)
    a, b = next(corpus.windows(stream, 10, 4, seed=3)), next(corpus.windows(stream, 10, 4, seed=3))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 10) and (np.diff(a, axis=1) == 1).all()  # contiguous slices of the stream
    with pytest.raises(ValueError, match="shorter than one window"):
        next(corpus.windows(stream, 100, 1, seed=0))


def test_prompt_windows_end_at_each_prompt_end_then_at_random_prefixes():
    prompts = [list(range(10)), [100, 101, 102], list(range(200, 220))]
    w = corpus.prompt_windows(prompts, 5, 8, seed=0)
    assert w.shape == (8, 5)
    np.testing.assert_array_equal(w[:2], [[5, 6, 7, 8, 9], [215, 216, 217, 218, 219]])  # the too-short one skipped
    for row in w:  # every window is a contiguous slice of one prompt
        src = next(p for p in prompts if row[0] in p)
        start = src.index(row[0])
        assert src[start:start + 5] == row.tolist()
    np.testing.assert_array_equal(w, corpus.prompt_windows(prompts, 5, 8, seed=0))
    with pytest.raises(ValueError, match="no prompt has the 50 tokens"):
        corpus.prompt_windows(prompts, 50, 2, seed=0)


def test_a_corpus_directory_says_how_many_files_it_skipped_and_why(tmp_path, capsys):
    text = "def café(x):\n    return x\n"
    files = {"a.py": text.encode(), "bom.py": b"\xef\xbb\xbf" + text.encode(), "latin.py": text.encode("latin-1"),
             "wide.py": text.encode("utf-16"), "wide_le.py": text.encode("utf-16-le"),
             "blob.bin": bytes(range(256)) * 4, "blank.txt": b"  \n", ".hidden.py": b"\xff"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert corpus.user_texts(tmp_path) == [text, text]  # a.py, bom.py (its mark dropped); hidden files unread
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--corpus {tmp_path}: read 2 text files; 5 files skipped: " in err, err
    assert "1 not UTF-8 (latin-1 or another 8-bit encoding; save them as UTF-8): latin.py" in err
    assert "2 UTF-16 (save them as UTF-8): wide.py, wide_le.py" in err
    assert "1 binary (NUL bytes): blob.bin" in err and "1 empty or whitespace only: blank.txt" in err
    for name in ("a.py", "bom.py"):
        (tmp_path / name).unlink()
    with pytest.raises(ValueError, match=r"no UTF-8 text files in the directory \(5 files skipped: .*latin\.py"):
        corpus.user_texts(tmp_path, "--corpus")
