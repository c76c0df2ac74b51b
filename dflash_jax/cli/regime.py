"""``dflash-jax report regime``: speed-up of DFlash over plain decoding at a fixed acceptance length on random-weight
miniatures (``dflash_jax.perf.regime``); prints a markdown table row by row (several minutes on 2 CPU cores)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

from dflash_jax.cli import args as cli_args
from dflash_jax.io import atomic
from dflash_jax.perf import regime, synthetic


def cmd_regime(args) -> int:
    models = args.models.split(",")
    unknown = [m for m in models if m not in regime.MINIATURES]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; expected some of {', '.join(regime.MINIATURES)}")
    blocks = tuple(args.blocks)
    results = []
    print("| target | params | drafter share | tau | AR tok/s | " + " | ".join(
        f"block {b}: tau, speed-up (ceiling)" for b in blocks) + " |")
    print("|---|---|---|---|---|" + "---|" * len(blocks))
    for name in models:
        raw_target, raw_drafter = regime.MINIATURES[name]
        target = synthetic.random_target(raw_target, dtype=jnp.float32)
        drafter = synthetic.random_drafter(raw_drafter, target)
        params = sum(x.size for x in jax.tree.leaves(target.params))
        share = regime.drafter_share(target.cfg, drafter.cfg)
        for tau in args.taus:
            r = regime.fixed_tau(target, drafter, blocks=blocks, tau=tau, max_new=args.max_new_tokens,
                                 repeats=args.repeats)
            results.append(dict(model=name, params=params, drafter_share=share, tau_target=tau, **r))
            cells = [f"{b['tau']:.2f}, {b['speedup']['median']:.2f}x ({b['speedup']['min']:.2f}-"
                     f"{b['speedup']['max']:.2f}) ({b['ceiling']:.2f}x)" for b in r["blocks"]]
            print(f"| {name} | {params / 1e6:.0f}M | {share:.1%} | {tau} | {r['ar_decode_tok_s']:.1f} | "
                  + " | ".join(cells) + " |", flush=True)
    if args.json:
        atomic.write_text(args.json, json.dumps(results, indent=1))
    return 0


def add_parser(sub) -> None:
    """Registers ``report regime`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("regime", description=regime.__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(regime.MINIATURES),
                   help=f"comma-separated miniature targets, of {', '.join(regime.MINIATURES)}")
    p.add_argument("--taus", type=cli_args.ints, default="6,10", help="comma-separated fixed acceptance lengths")
    p.add_argument("--blocks", type=cli_args.ints, default="4,6,8,16",
                   help="comma-separated block sizes (6: the block that just holds tau 6)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per run")
    p.add_argument("--repeats", type=int, default=3, help="timed, interleaved repeats; figures are medians")
    p.add_argument("--json", metavar="OUT", help="also write every row as JSON to OUT")
    p.set_defaults(func=cmd_regime)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
