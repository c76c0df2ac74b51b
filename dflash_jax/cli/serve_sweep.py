"""``dflash-jax report serve-sweep``: running servers' throughput across concurrencies with z-lab's benchmark client,
interleaved (``dflash_jax.perf.serve_sweep``); prints each run as a JSON line on stderr, then the markdown table."""

from __future__ import annotations

import sys

from dflash_jax.cli import args as cli_args
from dflash_jax.perf import serve_sweep


def cmd_serve_sweep(args) -> int:
    servers = {}
    for item in args.server:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith("http"):
            raise ValueError(f"--server {item}: expected NAME=URL, e.g. auto=http://127.0.0.1:8000")
        servers[name] = url
    sink = open(args.jsonl, "a") if args.jsonl else None  # noqa: SIM115

    def say(line):
        print(line, file=sys.stderr, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    runs = serve_sweep.sweep(servers, args.model, concurrency=args.concurrency, repeats=args.repeats,
                             max_new_tokens=args.max_new_tokens,
                             prompts_per=lambda c: max(args.min_prompts, args.prompts * c),
                             loader=serve_sweep.humaneval_loader(chars=args.prompt_chars), say=say)
    print(serve_sweep.table(runs))
    return 0


def add_parser(sub) -> None:
    """Registers ``report serve-sweep`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("serve-sweep", description=serve_sweep.__doc__.split("\n")[0])
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL",
                   help="a running server, by the name the table gives it (repeat the flag, two or more)")
    p.add_argument("--model", default="m", help="the model id the servers answer to (their --served-model-name)")
    p.add_argument("--concurrency", type=cli_args.ints, default="1,2,4,8,16,32", help="comma-separated levels")
    p.add_argument("--repeats", type=cli_args.positive, default=3, help="interleaved repeats; the table gives medians")
    p.add_argument("--max-new-tokens", type=cli_args.positive, default=64, help="tokens per request (z-lab's flag)")
    p.add_argument("--prompts", type=cli_args.positive, default=2,
                   help="timed requests per run: this x the concurrency, at least --min-prompts")
    p.add_argument("--min-prompts", type=cli_args.positive, default=4,
                   help="timed requests per run at the lowest concurrencies (more: longer, steadier runs there)")
    p.add_argument("--prompt-chars", type=int, help="cut each HumanEval prompt to its first N characters")
    p.add_argument("--jsonl", metavar="FILE", help="also append every run as a JSON line here")
    p.set_defaults(func=cmd_serve_sweep)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
