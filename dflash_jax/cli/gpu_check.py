"""``dflash-jax report gpu-check --out DIR``: the one command for the first GPU (kernel tests, kernels against their
references and HBM peak, verify/decode step time, DFlash at a fixed tau; ``dflash_jax.perf.gpu_check``), results
in ``DIR/gpu_check.json`` and on stdout. ``--smoke`` runs it at tiny shapes on any backend; without it a CPU is
refused (exit 2)."""

from __future__ import annotations

import json
import sys

import jax

from dflash_jax.perf import gpu_check


def cmd_gpu_check(args) -> int:
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(gpu_check.PARTS))
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; expected some of {', '.join(gpu_check.PARTS)}")
    backend = jax.default_backend()
    if not args.smoke and backend not in ("gpu", "cuda", "rocm"):
        print(f"gpu_check: needs a GPU (jax's backend is {backend!r}); use --smoke to exercise it here",
              file=sys.stderr)
        return 2
    result = gpu_check.run(args.out, smoke=args.smoke, parts=parts, budget_s=args.budget_s)
    print(json.dumps(result, indent=1, default=float))
    return 0


def add_parser(sub) -> None:
    """Registers ``report gpu-check`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("gpu-check", description=gpu_check.__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any backend (tests the check itself)")
    p.add_argument("--parts", default=",".join(gpu_check.PARTS), help="comma-separated parts to run, in order")
    p.add_argument("--budget-s", type=float, default=540.0, help="total wall-clock budget in seconds")
    p.set_defaults(func=cmd_gpu_check)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
