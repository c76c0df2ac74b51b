"""``dflash-jax compile``: the loop's programs compiled for a TPU (libtpu) or a GPU (the CUDA plugin) on a host
without one, per program its memory against the chip's, FLOPs, bytes and the compiler's time estimate
(``dflash_jax.perf.compile_report``; the table and its reading: ``docs/compile.md``). A JSON row per program
and one summary row per configuration (verify / decode ratio, projected tokens/s per chip), then a table."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax

from dflash_jax.cli import args as cli_args
from dflash_jax.io import atomic

SHAPES = ("shipped", "27b", "35b-a3b")
DRAFTERS = ("dflash", "dflash2")  # compile_report.DRAFTERS (not imported here: it loads JAX's model code)


def compiler_option(text: str) -> tuple[str, object]:
    """KEY=VALUE, VALUE read as a bool, an int or a float where it is one (XLA's option types), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def check_args(args) -> None:
    """One ValueError naming the flag for a value no compile could use, raised before any compile starts."""
    for flag, values in (("--batch", args.batch), ("--tp", args.tp)):
        if not values or min(values) < 1:
            raise ValueError(f"{flag} {','.join(map(str, values))}: every value must be >= 1")
    if args.tree is not None and (not args.tree or min(args.tree) < 1):
        raise ValueError(f"--tree {','.join(map(str, args.tree))}: every budget must be >= 1")
    for flag, value in (("--block", args.block), ("--context", args.context)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    if args.tree is not None and args.block is not None and args.block < 2:
        raise ValueError(f"--block {args.block}: a tree needs depth block - 1 >= 1 (--block >= 2)")
    if args.drafter != "dflash" and args.shape == "shipped":
        raise ValueError(f"--drafter {args.drafter}: only for --shape 27b or 35b-a3b (the shipped drafter is DFlash)")
    if "walk" in args.programs and args.drafter != "dflash2":
        raise ValueError("--programs walk: the selector walk needs --drafter dflash2")
    if args.json:
        parent = Path(args.json).absolute().parent
        if not parent.is_dir():
            raise ValueError(f"--json {args.json}: the directory {parent} does not exist; create it first")


def cmd_compile(args) -> int:
    # The host traces on its CPU; the target devices are compile-only. Without this JAX would probe for a TPU
    # (libtpu installed) or a GPU (the CUDA plugin) as its default backend. Before JAX's first backend.
    check_args(args)  # every flag before the first (minutes-long) compile
    if "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")
    from dflash_jax import frontend
    from dflash_jax.perf import compile_report, synthetic

    if args.platform == "tpu":
        devices = compile_report.tpu_devices(args.topology)
    else:
        devices = compile_report.gpu_devices(args.gpu, max(args.tp))
    where = f"the {args.topology} topology" if args.platform == "tpu" else f"{max(args.tp)} x {args.gpu}"
    compile_report.check_tensor_parallel(args.tp, devices, where)
    if args.shape == "shipped":
        configs = (frontend.ASSETS / "target", frontend.ASSETS / "drafter")
    else:
        configs = compile_report.real_configs(args.shape, drafter=args.drafter)
    block = args.block or synthetic.drafter_config(configs[1]).block_size
    hbm = compile_report.HBM_BYTES.get(devices[0].device_kind)
    if args.tree and hbm:  # a tree whose verify cannot fit one chip even at batch 1: refused before compiling
        frontend.check_tree_fits([frontend.Method("dflash", block, tree=n) for n in args.tree],
                                 synthetic.target_config(configs[0]), "--tree", (hbm, f"one {devices[0].device_kind}"))
    if args.draft_window is not None and args.draft_window < block:
        raise ValueError(f"--draft-window {args.draft_window}: must be >= the drafter's block size {block}")
    name = args.shape if args.drafter == "dflash" else f"{args.shape}+{args.drafter}"
    options = dict(args.compiler_option)
    kernels = args.kernels if args.kernels != "auto" else "tpu" if args.platform == "tpu" else "pallas"
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for tp in args.tp:
        for batch in args.batch:
            for tree in args.tree or (None,):
                setup = compile_report.abstract_setup(*configs, devices, shape=name, kernels=kernels, model=tp,
                                                      batch=batch, block=block, context=args.context, tree=tree,
                                                      draft_window=args.draft_window)
                compile_report.report(setup, args.programs, compiler_options=options, tau=args.tau, on_row=emit)
    print(compile_report.format_rows(rows))
    if args.json:
        atomic.write_text(args.json, json.dumps(rows, indent=1))
    return 0


def _programs(text: str) -> tuple[str, ...]:
    from dflash_jax.perf.compile_report import PROGRAMS

    names = tuple(s for s in text.split(",") if s)
    bad = [n for n in names if n not in PROGRAMS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(PROGRAMS)}, got {text!r}")
    return names


def add_parser(sub) -> None:
    """Registers ``compile`` on the ``dflash-jax`` subcommands."""
    p = sub.add_parser("compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", choices=("tpu", "cuda"), default="tpu",
                   help="tpu: libtpu's compiler (pip install 'jax[tpu]==0.10.2'); cuda: XLA's GPU compiler "
                        "(the CUDA plugin alone: pip install --no-deps jax-cuda12-plugin==0.10.2 "
                        "jax-cuda12-pjrt==0.10.2)")
    p.add_argument("--topology", default="v5p:2x2x1",
                   help="TPU topology (chip:shape), e.g. v5p:2x2x1, v5e:2x4, v6e:2x2, v4:2x2x1")
    p.add_argument("--gpu", default="h200", choices=("h100", "h200"), help="GPU target (--platform cuda)")
    p.add_argument("--shape", choices=SHAPES, default="27b",
                   help="the models: the shipped pair's configs, or Qwen3.5-27B / 35B-A3B with their DFlash "
                        "drafters (abstract bf16 parameters: nothing is allocated)")
    p.add_argument("--tp", type=cli_args.ints, default=[1],
                   help="comma-separated tensor-parallel sizes (chips of the topology; 1 = one chip)")
    p.add_argument("--batch", type=cli_args.ints, default=[1], help="comma-separated batch sizes")
    p.add_argument("--block", type=int, default=None,
                   help="DFlash block: verify(block) against decode(1); a tree's depth is block - 1 "
                        "(default: the drafter's block, 16 for DFlash, 8 for the released DFlash2)")
    p.add_argument("--tree", type=cli_args.ints, default=None, metavar="N[,N...]",
                   help="comma-separated DDTree budgets: the drafts are a tree of N nodes, verify runs N + 1 "
                        "tokens (one configuration per budget; default: a chain)")
    p.add_argument("--drafter", choices=tuple(DRAFTERS), default="dflash",
                   help="the drafter of --shape 27b / 35b-a3b: its DFlash drafter, or DFlash2 with the released "
                        "Qwen3.8-27B-DFlash2 settings on its shape (block 8, five sliding layers of 2048, conv "
                        "kernel 2, groups of 16, selector rank 256, top-16)")
    p.add_argument("--context", type=int, default=4096,
                   help="cache positions attended (the cache holds context + 2 x max(block, tree + 1), rounded "
                        "up to 128)")
    cli_args.add_draft_window_argument(p)
    p.add_argument("--programs", type=_programs, default=("decode", "verify", "step"),
                   help="comma-separated: decode (plain step, T=1), verify (T=block, or tree + 1), settle, draft, "
                        "step, loop (the on-device while-loop), run (prefill + loop: the whole generate), walk "
                        "(a DFlash2 drafter's candidate-selector walk alone)")
    p.add_argument("--kernels", choices=("auto", "reference", "tpu", "pallas"), default="auto",
                   help="the models' kernel mode: auto = the platform's (tpu: the Mosaic kernels where an op has one; "
                        "cuda: pallas, the Triton kernels); reference = the XLA forms everywhere")
    p.add_argument("--compiler-option", type=compiler_option, action="append", default=[], metavar="KEY=VALUE",
                   help="an XLA compiler option (repeatable), e.g. xla_tpu_enable_dot_strength_reduction=false")
    p.add_argument("--tau", type=float, default=10.377, help="tokens per DFlash step for the tokens/s projection "
                   "(default: the report's 27B HumanEval tau at block 16)")
    p.add_argument("--json", metavar="OUT", help="also write the rows to this JSON file")
    p.set_defaults(func=cmd_compile)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
