"""``dflash-jax report sharding``: the collectives of one compiled decode step at real shapes, sharded against one
device, a JSON row per (tensor-parallel size, batch) (``dflash_jax.perf.sharding_report``). It needs as many
devices as the mesh: on a CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``."""

from __future__ import annotations

import json

import jax

from dflash_jax.cli import args as cli_args
from dflash_jax.perf import sharding_report, synthetic


def cmd_sharding_report(args) -> int:
    for tp in args.tp:
        ep = args.ep if tp > 1 else 1
        if tp * ep > jax.device_count():
            raise SystemExit(f"TP {tp} x EP {ep} needs {tp * ep} devices, {jax.device_count()} present: set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * ep} (CPU)")
        for batch in args.batch:
            row = sharding_report.step_collectives(args.config, model=tp, expert=ep, batch=batch, block=args.block,
                                                   prompt=args.prompt, max_new=args.max_new)
            print(json.dumps(row), flush=True)
    return 0


def add_parser(sub) -> None:
    """Registers ``report sharding`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("sharding", description=sharding_report.__doc__.split("\n")[0])
    p.add_argument("--config", default="27b", choices=tuple(synthetic.REAL_SHAPES), help="the real shape")
    p.add_argument("--tp", type=cli_args.ints, default="1,8",
                   help="comma-separated tensor-parallel sizes to compare (1 = one device)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    p.add_argument("--batch", type=cli_args.ints, default="1", help="comma-separated batch sizes")
    p.add_argument("--block", type=int, default=16, help="DFlash block (1 = plain decoding)")
    p.add_argument("--prompt", type=int, default=512, help="prompt bucket (the cache holds prompt + max-new)")
    p.add_argument("--max-new", type=int, default=256, help="tokens the cache has room to generate")
    p.set_defaults(func=cmd_sharding_report)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
