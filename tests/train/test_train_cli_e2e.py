"""The train-* commands end to end at toy sizes on a corpus of one's own (issue 25): tokenizer -> target ->
drafter (default taps: the shipped recipe) and MTP head; each output loads, is marked as its command's, and the
data generation shows its progress."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from dflash_jax import cli
from dflash_jax.io import atomic


@pytest.mark.slow
def test_train_commands_on_a_corpus_of_ones_own(tmp_path, capsys):
    from dflash_jax.models.drafter import load_drafter
    from dflash_jax.models.target import load_target

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "def f{i}(x):\\n    return x * {i} + {i % 7}\\n"}}\n' for i in range(300)))
    tok, target, drafter, mtp = (tmp_path / n for n in ("tok", "target", "drafter", "mtp"))
    assert cli.main(["train", "tokenizer", "--corpus", str(corpus), "--vocab", "300", "--out", str(tok)]) == 0
    small = ["--steps", "2", "--batch", "2"]
    assert cli.main(["train", "target", "--tokenizer", str(tok), "--corpus", str(corpus), "--out", str(target),
                     "--layers", "4", "--hidden", "32", "--intermediate", "64", "--seq", "32", *small]) == 0
    data = ["--target", str(target), "--corpus", str(corpus), "--data-seqs", "4", "--prompt-len", "8", "--seq", "24",
            "--gen-batch", "4", *small]
    capsys.readouterr()
    assert cli.main(["train", "drafter", *data, "--out", str(drafter), "--layers", "1", "--block-size", "4",
                     "--anchors", "2"]) == 0
    out = capsys.readouterr()
    assert "drafter (taps [1, 2, 3]" in out.out  # the shipped recipe on a 4-layer target
    assert "data: the target continues 4 snippets by 16 tokens" in out.err
    assert cli.main(["train", "mtp", *data, "--out", str(mtp), "--unroll", "3", "--anchors", "2"]) == 0
    for path, command in ((tok, "train tokenizer"), (target, "train target"), (drafter, "train drafter"),
                          (mtp, "train mtp")):
        assert atomic.written_by(path) == f"dflash-jax {command}"
    t = load_target(mtp, jnp.float32, progress=False)
    assert t.module().mtp is not None
    assert load_drafter(drafter, t, progress=False).cfg.target_layer_ids == (1, 2, 3)
