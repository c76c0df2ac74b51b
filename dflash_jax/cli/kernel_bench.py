"""``dflash-jax report kernel-bench``: GPU timing of every shipped kernel case against its jnp reference, as a fraction
of the device's HBM peak (``dflash_jax.perf.kernel_bench``). It needs a GPU and refuses a CPU (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax

from dflash_jax.io import atomic
from dflash_jax.perf import kernel_bench, kernel_report


def cmd_kernel_bench(args) -> int:
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda", "rocm"):
        print(f"bench: needs a GPU (ROCm or CUDA); jax's default backend is {backend!r}. Run it on an "
              "MI355X / H200 host; for CPU-side checks use `dflash-jax report kernels`.", file=sys.stderr)
        return 2
    device = jax.devices()[0].device_kind
    peak = args.peak_bw or kernel_bench.peak_bandwidth(device)
    cases, notes = kernel_report.collect_cases(tuple(args.modules.split(",")))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    rows = []
    for case in (c for c in cases if args.filter in c.name):
        rows.append(kernel_bench.bench_case(case, peak, warmup=args.warmup, runs=args.runs, reps=args.reps,
                                            reference=not args.no_reference))
        print(kernel_bench.format_table(rows[-1:], device, peak).splitlines()[-1], file=sys.stderr, flush=True)
    print(kernel_bench.format_table(rows, device, peak))
    if args.json:
        atomic.write_text(args.json, json.dumps(
            {"device": device, "peak_bw": peak, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 0


def add_parser(sub) -> None:
    """Registers ``report kernel-bench`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("kernel-bench", description=kernel_bench.__doc__.split("\n")[0])
    p.add_argument("--modules", default=",".join(kernel_report.KERNEL_MODULES),
                   help="comma-separated kernel modules of dflash_jax.kernels")
    p.add_argument("--filter", default="", help="only cases whose name contains this")
    p.add_argument("--peak-bw", type=float, help="HBM peak in bytes/s (default: by device name)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (compilation and autotuning)")
    p.add_argument("--runs", type=int, default=7, help="timed runs; the median is reported")
    p.add_argument("--reps", type=int, default=10, help="back-to-back calls per timed run")
    p.add_argument("--no-reference", action="store_true", help="time only the kernels")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    p.set_defaults(func=cmd_kernel_bench)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
