"""``dflash-jax report perf-model``: bytes and FLOPs of one verify, draft and commit at real shapes, from their HLO, and
the tokens/s they project (``dflash_jax.perf.perf_model``; about a minute of CPU, no accelerator)."""

from __future__ import annotations

import json

from dflash_jax.cli import args as cli_args
from dflash_jax.io import atomic
from dflash_jax.perf import perf_model, synthetic


def cmd_perf_model(args) -> int:
    unknown = [s for s in args.shapes.split(",") if s not in synthetic.REAL_SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown {unknown}; expected some of {', '.join(synthetic.REAL_SHAPES)}")
    if not 1 <= args.tau <= args.block:  # also refuses NaN
        raise ValueError(f"--tau must be in [1, --block {args.block}] (tokens per target step), got {args.tau}")
    rep = perf_model.report(tuple(args.shapes.split(",")), tuple(args.batches), args.block, args.context, args.tau)
    print(perf_model.format_report(rep))
    if args.json:
        atomic.write_text(args.json, json.dumps(rep, indent=1))
    return 0


def add_parser(sub) -> None:
    """Registers ``report perf-model`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("perf-model", description=perf_model.__doc__.split("\n")[0])
    p.add_argument("--shapes", default="27b,35b-a3b", help="comma-separated real shapes (synthetic.REAL_SHAPES)")
    p.add_argument("--batches", type=cli_args.ints, default="1,32", help="comma-separated batch sizes")
    p.add_argument("--block", type=cli_args.positive, default=16, help="DFlash block size")
    p.add_argument("--context", type=cli_args.positive, default=4096, help="tokens in the cache")
    p.add_argument("--tau", type=float, default=10.377, help="tokens per step (default: the report's 27B HumanEval "
                   "tau at block 16)")
    p.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    p.set_defaults(func=cmd_perf_model)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
