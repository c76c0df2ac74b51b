"""``dflash-jax report kernels``: register, spill, LDS and MFMA figures of every shipped kernel config compiled for
an AMD arch on the CPU (``dflash_jax.perf.kernel_report``; needs the ``triton`` extra, no GPU). Exits 1 when a
kernel spills or overflows the arch's LDS."""

from __future__ import annotations

import dataclasses
import json

from dflash_jax.perf import kernel_report


def cmd_kernel_report(args) -> int:
    report = kernel_report.run_report(args.arch, tuple(args.modules.split(",")), name_filter=args.filter,
                                      dump_ir=args.dump_ir)
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=1))
    else:
        print(kernel_report.format_table(report))
    limit = kernel_report.LDS_LIMIT.get(args.arch)
    return 1 if any(kernel_report.problems(r, limit) for r in report.rows) else 0


def add_parser(sub) -> None:
    """Registers ``report kernels`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("kernels", description=kernel_report.__doc__.split("\n")[0])
    p.add_argument("--arch", default="gfx950", help="AMD target, e.g. gfx950 (MI355X), gfx942 (MI300X)")
    p.add_argument("--modules", default=",".join(kernel_report.KERNEL_MODULES),
                   help="comma-separated kernel modules of dflash_jax.kernels")
    p.add_argument("--filter", default="", help="only cases whose name contains this")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--dump-ir", metavar="DIR", help="also write each kernel's TTIR text into DIR")
    p.set_defaults(func=cmd_kernel_report)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
