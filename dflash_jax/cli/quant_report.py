"""``dflash-jax report quant``: MXFP4 against dense on one target + drafter pair (weight bytes, logit error, tau,
CPU tokens/s), printed as JSON (``dflash_jax.perf.quant_report``)."""

from __future__ import annotations

import json

from dflash_jax import frontend
from dflash_jax.perf import quant_report


def cmd_quant_report(args) -> int:
    if args.scale_rules:
        print(json.dumps(quant_report.scale_rules(args.assets, n_prompts=args.prompts), indent=1))
        return 0
    print(json.dumps(quant_report.report(args.assets, n_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                                         dtype=args.dtype, block=args.block, repeats=args.repeats,
                                         exclude=tuple(args.exclude)), indent=1))
    return 0


def add_parser(sub) -> None:
    """Registers ``report quant`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("quant", description=quant_report.__doc__.split("\n")[0])
    p.add_argument("assets", nargs="?", default=str(frontend.ASSETS), help="directory with target/ and drafter/")
    p.add_argument("--prompts", type=int, default=16, help="evaluation prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--dtype", choices=tuple(frontend.DTYPES), default="bfloat16", help="both targets' dtype")
    p.add_argument("--block", type=int, default=16, help="DFlash block size")
    p.add_argument("--repeats", type=int, default=3, help="timed, interleaved repeats; figures are medians")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="module pattern that stays dense, as dflash-jax quantize's (repeatable)")
    p.add_argument("--scale-rules", action="store_true", help="only the logit error of the scale rules (scale_rules)")
    p.set_defaults(func=cmd_quant_report)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
