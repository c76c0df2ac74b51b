"""``dflash-jax report scaling``: prefill time against prompt length and the DFlash loop's compile time against depth
(``dflash_jax.perf.scaling``); prints both tables (a few minutes on 2 CPU cores with the defaults)."""

from __future__ import annotations

import json

import jax

from dflash_jax.cli import args as cli_args
from dflash_jax.io import atomic
from dflash_jax.perf import scaling, synthetic


def cmd_scaling(args) -> int:
    if args.shape not in synthetic.REAL_SHAPES:
        raise ValueError(f"--shape {args.shape!r}: expected one of {', '.join(synthetic.REAL_SHAPES)}")
    out = dict(backend=jax.default_backend())
    if args.lengths:
        out["prefill"] = dict(model=args.prefill_model, rows=scaling.prefill_seconds(
            scaling.prefill_target(args.prefill_model), args.lengths, repeats=args.repeats))
        print(f"prefill of one row, {args.prefill_model} target (random f32 weights), {jax.default_backend()}, "
              f"median of {args.repeats}:")
        print(scaling.format_prefill(out["prefill"]["rows"]), flush=True)
    if args.layers:
        rows = []
        print(f"\nDFlash loop (decode: the while_loop of draft, verify, commit) at {args.shape} widths, abstract "
              f"bf16 parameters, block 16, compiled for {jax.default_backend()}:")
        for n in args.layers:
            rows.append(scaling.loop_compile_seconds(*scaling.depth_configs(*synthetic.REAL_SHAPES[args.shape], n)))
            table = scaling.format_compile(rows)
            print(table.splitlines()[-1] if len(rows) > 1 else table, flush=True)
        out["compile"] = dict(shape=args.shape, rows=rows)
    if args.json:
        atomic.write_text(args.json, json.dumps(out, indent=1))
    return 0


def add_parser(sub) -> None:
    """Registers ``report scaling`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("scaling", description=scaling.__doc__.split("\n")[0])
    p.add_argument("--prefill-model", default="shipped", help="shipped or a regime miniature (37m, 140m)")
    p.add_argument("--lengths", type=cli_args.int_list, default="128,256,512,1024,2048,4096,8192",
                   help="prefill: comma-separated prompt lengths ('' skips the prefill table)")
    p.add_argument("--repeats", type=int, default=3, help="prefill: timed repeats per length; figures are medians")
    p.add_argument("--shape", default="27b", help=f"compile: one of {', '.join(synthetic.REAL_SHAPES)}")
    p.add_argument("--layers", type=cli_args.int_list, default="4,8,16,32,64",
                   help="compile: comma-separated target depths ('' skips the compile table)")
    p.add_argument("--json", metavar="OUT", help="also write both tables as JSON to OUT")
    p.set_defaults(func=cmd_scaling)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
