"""``dflash-jax ship``: reproduces the models shipped in ``dflash_jax/assets`` from scratch with fixed seeds,
stage by stage, resuming where an interrupted run stopped (``dflash_jax.train.ship``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflash_jax.train import ship


def cmd_ship(args) -> int:
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(ship.STAGES))
    if unknown:
        raise ValueError(f"--stages: unknown stages {unknown}; expected {list(ship.STAGES)}")
    t0 = time.time()
    sizes = ship.with_overrides(ship.TINY if args.tiny else ship.Sizes(), args.set)
    log = ship.run(args.work, sizes, stages, install=ship.ASSETS if args.install else None, overwrite=args.overwrite)
    brief = {k: {f: x for f, x in v.items() if f != "files"} if isinstance(v, dict) else v for k, v in log.items()}
    print(f"[ship] done in {time.time() - t0:.0f} s; log (the results' checksums: {args.work / 'ship_log.json'}): "
          f"{json.dumps(brief)}", flush=True)
    return 0


def add_parser(sub) -> None:
    """Registers ``ship`` on the ``dflash-jax`` subcommands."""
    p = sub.add_parser("ship", description=ship.__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("ship_work"),
                   help="stage outputs and checkpoints: a new or empty directory, or one ship wrote (a rerun resumes "
                        "there)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an existing, non-empty --work that ship did not write (its files of ship's "
                        "names are replaced, its ship_log.json too; nothing there is taken as a finished stage)")
    p.add_argument("--install", action="store_true",
                   help=f"copy the exported models over the package's assets ({ship.ASSETS})")
    p.add_argument("--tiny", action="store_true", help="toy sizes: a fast end-to-end check of the pipeline")
    p.add_argument("--stages", default=",".join(ship.STAGES), help="comma-separated stages to run, of the default")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="override a size of ship.Sizes, e.g. --set grow_stop=45 (stop a training stage after that "
                        "step; a later run without it resumes from the checkpoint)")
    p.set_defaults(func=cmd_ship)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
