"""Throughput of several running servers across concurrencies with z-lab's benchmark client, interleaved.

Where it sits: in the measurement layer beside ``serve_load.py`` (our own load generator); this one drives
z-lab's (``dflash.benchmark``'s OpenAI runner, ``pip install --no-deps dflash``), unchanged but for its dataset
loader, which downloads from a hub: HumanEval's prompts come from the copy the package ships instead (formatted
by z-lab's own table), as ``tests/serve/test_zlab_client.py`` runs it. For each repeat and concurrency it runs
every server once, in rotating order, so the machine's drift hits all alike, and reads the client's printed
throughput; the table is the median per (server, concurrency) and each server's ratio to the best of the others.

``dflash-jax report serve-sweep`` is its front end.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics

from dflash_jax.decoding import workloads


def humaneval_loader(tokenizer=None, limit: int | None = None, chars: int | None = None):
    """z-lab's ``load_and_process_dataset`` for "humaneval" from the package's shipped copy (its rows as the hub's),
    those of at most ``limit`` tokens when a tokenizer is given; ``chars``: each cut to its first ``chars``
    characters (short prompts: decoding, not prefill, is what the sweep compares)."""
    from dflash import benchmark

    def load(name):
        if name != "humaneval":
            raise ValueError(f"only humaneval is available offline, not {name!r}")
        fmt = benchmark.DATASETS[name]["format"]
        rows = [{"turns": [fmt(row)[:chars]]} for row in workloads.humaneval_rows()]
        if tokenizer is None or limit is None:
            return rows
        return [r for r in rows if len(tokenizer.encode(r["turns"][0], add_special_tokens=False)) <= limit]
    return load


def zlab_throughput(base_url: str, model: str, *, concurrency: int, prompts: int, max_new_tokens: int,
                    loader) -> dict:
    """One run of z-lab's client (its warm-up requests, then ``prompts`` timed ones, greedy): what it printed."""
    from dflash import benchmark
    from dflash.cli import _parser

    args = _parser().parse_args([
        "benchmark", "openai", "--model", model, "--base-url", base_url, "--dataset", "humaneval",
        "--num-prompts", str(prompts), "--concurrency", str(concurrency), "--max-new-tokens", str(max_new_tokens),
        "--temperature", "0", "--timeout-s", "1200"])
    saved, benchmark.load_and_process_dataset = benchmark.load_and_process_dataset, loader
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            benchmark.run(args)
    finally:
        benchmark.load_and_process_dataset = saved
    printed = dict(re.findall(r"^([A-Za-z ]+):\s+([\d.,]+)", out.getvalue(), re.M))
    return dict(tokens_per_s=float(printed["Throughput"].replace(",", "")), tokens=int(printed["Output tokens"]),
                seconds=float(printed["Latency"]), accept_length=float(printed.get("Accept length", "nan")))


def sweep(servers: dict[str, str], model: str, *, concurrency, repeats: int, max_new_tokens: int, prompts_per,
          loader, say=print) -> dict:
    """{name: {c: [tokens/s per repeat]}}: each repeat runs every concurrency, every server in rotating order."""
    runs = {name: {c: [] for c in concurrency} for name in servers}
    names = list(servers)
    for r in range(repeats):
        for c in concurrency:
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                got = zlab_throughput(servers[name], model, concurrency=c, prompts=prompts_per(c),
                                      max_new_tokens=max_new_tokens, loader=loader)
                runs[name][c].append(got["tokens_per_s"])
                say(json.dumps(dict(repeat=r, concurrency=c, server=name, **got)))
    return runs


def table(runs: dict) -> str:
    """Median tokens/s per server and concurrency, and each server over the best of the others."""
    names = list(runs)
    levels = list(next(iter(runs.values())))
    med = {n: {c: statistics.median(runs[n][c]) for c in levels} for n in names}
    head = "| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " | " + \
        " | ".join(f"{n} / best other" for n in names) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names))]
    for c in levels:
        ratio = [med[n][c] / max(med[m][c] for m in names if m != n) for n in names]
        lines.append(f"| {c} | " + " | ".join(f"{med[n][c]:.1f}" for n in names) + " | " +
                     " | ".join(f"{x:.2f}" for x in ratio) + " |")
    return "\n".join(lines)
