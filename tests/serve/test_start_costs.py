"""The warm-up's step costs kept across starts (``serve/cost_cache.py``): a second start of one configuration
loads the table the first measured, and no other configuration does (another flag, a model file changed); a
file that cannot be read, or that holds other programs, is ignored with a log line. (That a real second start
logs the same table and times nothing: ``test_serve_cli.py``'s second start, marked slow.)"""

import json
import logging
import os

import pytest

from dflash_jax import frontend
from dflash_jax.cli import build_parser
from dflash_jax.cli import serve as cli_serve
from dflash_jax.serve import cost_cache
from dflash_jax.serve.engine import Engine
from dflash_jax.serve.schedule import Option

PROGRAMS = [(1, Option(1)), (1, Option(16)), (4, Option(16, 32))]
WIDTHS = [16, 32]  # prompt chunks
TABLE = ({PROGRAMS[0]: 0.004, PROGRAMS[1]: 0.012, PROGRAMS[2]: 0.03}, 0.0002, {16: 0.005, 32: 0.007})


@pytest.fixture
def models(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def _stamp(models, **config):
    return cost_cache.fingerprint({"max_num_seqs": 32, **config}, [models])


def test_a_table_is_loaded_for_its_own_configuration_only(tmp_path, models):
    cache = tmp_path / "cache"
    cache.mkdir()
    stamp = _stamp(models)
    assert cost_cache.load(cache, stamp, PROGRAMS, WIDTHS) is None  # a first start
    assert cost_cache.save(cache, stamp, TABLE) == cost_cache.path(cache, stamp)
    assert cost_cache.load(cache, _stamp(models), PROGRAMS, WIDTHS) == TABLE
    assert cost_cache.load(cache, _stamp(models, max_num_seqs=8), PROGRAMS, WIDTHS) is None  # another flag
    os.utime(models / "model.safetensors", ns=(1, 1))  # the model's file replaced
    assert cost_cache.load(cache, _stamp(models), PROGRAMS, WIDTHS) is None
    assert [p.name for p in cache.iterdir()] == [cost_cache.path(cache, stamp).name]  # nothing else written


@pytest.mark.parametrize("damage, why", [
    (lambda text: text[:len(text) // 2], "timed again"),  # cut short
    (lambda text: text.replace('"costs"', '"cost"'), "'costs'"),
    (lambda text: text.replace("0.012", "-1"), "not a positive number"),
    (lambda text: text.replace("0.007", "0"), "not a positive number"),  # a chunk's
    (lambda text: text.replace('"chunks"', '"before_chunks_were_timed"'), "'chunks'"),  # an older file
    (lambda text: text.replace('"max_num_seqs": 32', '"max_num_seqs": 33'), "another configuration"),
])
def test_a_damaged_or_foreign_file_is_ignored_with_a_log_line(tmp_path, models, caplog, damage, why):
    stamp = _stamp(models)
    file = cost_cache.save(tmp_path, stamp, TABLE)
    file.write_text(damage(file.read_text()))
    with caplog.at_level(logging.WARNING, "dflash_jax.serve"):
        assert cost_cache.load(tmp_path, stamp, PROGRAMS, WIDTHS) is None
    assert f"ignoring the step costs in {file}" in caplog.text and why in caplog.text


@pytest.mark.parametrize("programs, widths", [(PROGRAMS[:2], WIDTHS), (PROGRAMS, WIDTHS + [64])])
def test_a_table_of_other_programs_is_ignored(tmp_path, models, caplog, programs, widths):
    stamp = _stamp(models)
    cost_cache.save(tmp_path, stamp, TABLE)
    with caplog.at_level(logging.WARNING, "dflash_jax.serve"):
        assert cost_cache.load(tmp_path, stamp, programs, widths) is None
    assert "its programs are not this start's" in caplog.text


def test_serve_keeps_the_table_and_a_second_start_uses_it(tmp_path, monkeypatch):
    """``serve``'s build: the first start times the steps (here a stand-in warm-up) and keeps the table in the
    compilation cache's folder; the same flags load it (a port of their own changes nothing); another engine
    flag times them again."""
    warmups, loaded = [], {}
    load_models = frontend.load_models

    def load_once(*args, **kwargs):  # the models load once for the three builds
        if "pair" not in loaded:
            loaded["pair"] = load_models(*args, **kwargs)
        return loaded["pair"]

    def warmup(self, progress=None, costs=None):
        warmups.append(costs)
        steps = {p: 0.01 * k for k, p in enumerate(self.schedule.programs(), 1)}
        self.schedule.costs, self.schedule.copy, self.chunk_costs = costs or (steps, 0.001,
                                                                              dict.fromkeys(self.buckets(), 0.02))

    monkeypatch.setattr(frontend, "load_models", load_once)
    monkeypatch.setattr(Engine, "warmup", warmup)

    def build(*flags):
        args = build_parser().parse_args(["serve", "--max-model-len", "32", "--max-num-seqs", "2", "--block-size",
                                          "1", *flags])
        served, _ = cli_serve.build(args, cache_dir=tmp_path)
        return served.engine

    first = build()
    (file,) = tmp_path.glob("dflash-jax-step-costs-*.json")
    assert warmups == [None] and json.loads(file.read_text())["costs"] == [[2, 1, None, 0.01]]
    assert json.loads(file.read_text())["chunks"] == [[16, 0.02], [32, 0.02]]  # --max-model-len 32
    second = build("--port", "9")
    assert warmups[1] == (first.schedule.costs, first.schedule.copy, first.chunk_costs)
    assert second.schedule.costs == first.schedule.costs and second.chunk_costs == first.chunk_costs
    build("--max-num-batched-tokens", "16")
    assert warmups[2] is None and len(list(tmp_path.glob("dflash-jax-step-costs-*.json"))) == 2
