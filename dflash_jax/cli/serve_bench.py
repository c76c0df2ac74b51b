"""``dflash-jax report serve-bench``: running servers (``dflash-jax serve``, one per configuration) timed side by
side with ``perf.serve_load``: output tokens/s, time to first token and per output token (p50/p99), acceptance length,
at each concurrency, over a workload's prompts (HumanEval by default), the servers interleaved round by round
and each figure the median over rounds. A 503 is retried after its Retry-After; a request that still fails is
counted in its row (``failed``), and the JSON is rewritten after every run, so what was measured is kept."""

from __future__ import annotations

import json
import statistics
import urllib.request

from dflash_jax import frontend
from dflash_jax.cli import args as cli_args
from dflash_jax.decoding import workloads
from dflash_jax.io import atomic
from dflash_jax.perf import serve_load

FIGURES = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "accept_length")


def _servers(items: list[str]) -> list[tuple[str, str, str]]:
    """(label, base URL, served model name) per ``--server LABEL=URL``; labels must differ."""
    out = []
    for item in items:
        label, sep, url = item.partition("=")
        if not sep or not label or not url.startswith("http://"):
            raise ValueError(f"--server {item!r}: expected LABEL=http://HOST:PORT")
        if any(label == seen for seen, _, _ in out):
            raise ValueError(f"--server {item!r}: the label {label!r} is given twice; each server needs its own label")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
                model = json.load(r)["data"][0]["id"]
        except OSError as e:
            raise ValueError(f"--server {item}: no server answers ({e})") from None
        out.append((label, url.rstrip("/"), model))
    return out


def cmd_serve_bench(args) -> int:
    if not args.server:
        raise ValueError("give at least one --server LABEL=URL")
    if args.rounds < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--rounds, --num-prompts and --max-tokens must be >= 1")
    if not args.concurrency or min(args.concurrency) < 1:
        raise ValueError(f"--concurrency: every value must be >= 1, got {','.join(map(str, args.concurrency))}")
    if len(set(args.concurrency)) != len(args.concurrency):
        raise ValueError(f"--concurrency: a value is given twice ({','.join(map(str, args.concurrency))})")
    if args.max_retries < 0:
        raise ValueError(f"--max-retries must be >= 0, got {args.max_retries}")
    servers = _servers(args.server)
    tokenizer = frontend.load_tokenizer(args.tokenizer or frontend.ASSETS / "target", "--tokenizer")
    texts = [t for t in workloads.load_turns(args.workload, args.prompts, None)
             if len(tokenizer.encode(t, add_special_tokens=False)) <= args.max_prompt_tokens]
    if not texts:
        raise ValueError(f"no {args.workload} prompt has at most --max-prompt-tokens {args.max_prompt_tokens} tokens")
    runs: dict[tuple[str, int], list[dict]] = {}
    load = dict(max_tokens=args.max_tokens, max_retries=args.max_retries)
    for c in args.concurrency:  # warm: each server's programs and connections, at each concurrency
        for label, url, model in servers:
            warm = serve_load.run(url, model, texts[:c], concurrency=c, **load)
            if warm["failed"]:
                print(f"[{label}: {warm['failed']} of {len(texts[:c])} warm-up requests failed: {warm['errors'][0]}]",
                      flush=True)
    for r in range(args.rounds):
        for c in args.concurrency:
            n = max(args.num_prompts, c)
            batch = [texts[(r * n + i) % len(texts)] for i in range(n)]
            for label, url, model in servers:
                runs.setdefault((label, c), []).append(serve_load.run(url, model, batch, concurrency=c, **load))
                if args.json:  # every run kept as soon as it is measured
                    atomic.write_text(args.json, json.dumps(_rows(runs), indent=1))
    rows = _rows(runs)
    print("| server | concurrency | tok/s | TTFT p50 / p99 (ms) | per token p50 / p99 (ms) | accept length | failed "
          "/ retried |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['server']} | {row['concurrency']} | {_fmt(row['tokens_per_s'], '.1f')} | "
              f"{_fmt(row['ttft_ms_p50'], '.0f')} / {_fmt(row['ttft_ms_p99'], '.0f')} | "
              f"{_fmt(row['tpot_ms_p50'], '.1f')} / {_fmt(row['tpot_ms_p99'], '.1f')} | "
              f"{_fmt(row['accept_length'], '.2f')} | {row['failed']} / {row['retries']} |", flush=True)
    if args.json:
        atomic.write_text(args.json, json.dumps(rows, indent=1))
    return 1 if any(row["failed"] for row in rows) else 0


def _rows(runs: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """One row per (server, concurrency): each figure's median over the rounds that measured it (None if none),
    the failed requests and 503 retries summed, every round's run."""
    rows = []
    for (label, c), results in runs.items():
        med = {}
        for k in FIGURES:
            values = [r[k] for r in results if r[k] is not None]
            med[k] = statistics.median(values) if values else None
        rows.append(dict(server=label, concurrency=c, failed=sum(r["failed"] for r in results),
                         retries=sum(r["retries"] for r in results), rounds=results, **med))
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_parser(sub) -> None:
    """Registers ``report serve-bench`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("serve-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", default=[], metavar="LABEL=URL",
                   help="a running server to time (repeatable), e.g. dflash=http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=cli_args.ints, default="1,32", help="comma-separated client concurrencies")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; figures are medians over them")
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="humaneval")
    p.add_argument("--prompts", metavar="FILE.jsonl", help="the workload's prompts from a file (z-lab's format)")
    p.add_argument("--tokenizer", help="tokenizer that sizes the prompts (default: the shipped target's)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="skip prompts longer than this")
    p.add_argument("--max-retries", type=int, default=serve_load.MAX_RETRIES, help="503s retried per request (each "
                   "after its Retry-After, at most 60 s)")
    p.add_argument("--json", metavar="OUT", help="also write every run as JSON to OUT (rewritten after each run)")
    p.set_defaults(func=cmd_serve_bench)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
