"""``dflash-jax report miniature``: writes a servable random-weight pair of ``regime``'s shapes whose drafts are
accepted at a rate set by ``--margin`` (``dflash_jax.perf.miniature``), for serving measurements."""

from __future__ import annotations

from dflash_jax.perf import miniature, regime


def cmd_miniature(args) -> int:
    target, drafter = miniature.write(args.out, args.size, margin=args.margin)
    print(f"wrote {target} and {drafter}: dflash-jax serve --model {target} --draft-model {drafter}")
    if args.check:
        print(miniature.acceptance(*miniature.pair(args.size, margin=args.margin)))
    return 0


def add_parser(sub) -> None:
    """Registers ``report miniature`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("miniature", description=miniature.__doc__.split("\n")[0])
    p.add_argument("out", help="folder to write target/ and drafter/ into")
    p.add_argument("--size", default="37m", choices=tuple(regime.MINIATURES), help="regime's miniature shapes")
    p.add_argument("--margin", type=float, required=True,
                   help="the LM head's weight on the direction every embedding shares (0.28: tau ~5 at block 16)")
    p.add_argument("--check", action="store_true", help="also print the greedy tau at block 16 on random prompts")
    p.set_defaults(func=cmd_miniature)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
