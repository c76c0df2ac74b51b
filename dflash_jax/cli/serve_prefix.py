"""``dflash-jax report serve-prefix``: what the engine's prefix cache and chunked prefill buy, measured on an
in-process engine (``dflash_jax.serve.measure``): ``reuse`` (multi-turn time to first token and hit rate),
``stall`` (the longest gap of running streams while a long prompt prefills) and ``memory`` (resident memory
while distinct prompts pass through a small store); one JSON line on stdout."""

from __future__ import annotations

import json

from dflash_jax.cli import args as cli_args
from dflash_jax.serve import measure


def cmd_serve_prefix(args) -> int:
    if args.what == "reuse":
        result = measure.reuse(args.method, args.conversations, reply=args.reply_tokens, chunk=args.chunk or 256)
    elif args.what == "stall":
        result = measure.stall(chunk=args.chunk)
    else:
        result = measure.memory(args.method, args.requests)
    print(json.dumps(result), flush=True)
    return 0


def add_parser(sub) -> None:
    """Registers ``report serve-prefix`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("serve-prefix", description=measure.__doc__.split("\n")[0])
    p.add_argument("what", choices=("reuse", "stall", "memory"), help="which measurement")
    p.add_argument("--method", default="dflash:16", help="reuse and memory: the method served (shipped pair)")
    p.add_argument("--conversations", type=cli_args.positive, default=8, metavar="N",
                   help="reuse: conversations of 6 turns")
    p.add_argument("--reply-tokens", type=cli_args.positive, default=32, metavar="N",
                   help="reuse: each assistant reply's tokens (greedy)")
    p.add_argument("--chunk", type=int, default=None,
                   help="prefill chunk (--max-num-batched-tokens N); default 256 for reuse, the server's (auto: "
                   "sized by the steps' cost) for stall")
    p.add_argument("--requests", type=int, default=1000, help="memory: distinct requests")
    p.set_defaults(func=cmd_serve_prefix)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
