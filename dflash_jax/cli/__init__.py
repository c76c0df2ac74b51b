"""The ``dflash-jax`` command line: one module per subcommand, registered here.

``generate`` (the main job), ``bench``, ``quantize`` and the training stages (``train-*``). This package is
the only home of argparse; every subcommand is a thin front end over the library.
"""

from __future__ import annotations

import argparse
import sys

from dflash_jax.cli import bench, generate, quantize, train
from dflash_jax.cli.args import Parser, version
from dflash_jax.config import ConfigError
from dflash_jax.io import atomic
from dflash_jax.io.checkpoint import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dflash-jax", description="DFlash speculative decoding in JAX")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, bench, quantize, train):
        command.add_parser(sub)
    return parser


def check_outputs(args) -> None:
    """Output folders are proven writable, and checkpoint settings consistent, before any work starts."""
    for flag in ("out", "ckpt_dir"):
        path = getattr(args, flag, None)
        if path is not None:
            atomic.check_writable(path, "--" + flag.replace("_", "-"))
    if getattr(args, "ckpt_dir", None) is not None and args.ckpt_every < 1:
        raise ValueError(f"--ckpt-every {args.ckpt_every} with --ckpt-dir would never save a checkpoint; "
                         f"give a step interval >= 1")
    if getattr(args, "repeats", 1) < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if getattr(args, "max_new_tokens", 1) < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_outputs(args)
        return args.func(args) or 0
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"dflash-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
