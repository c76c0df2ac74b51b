"""``dflash-jax quantize``: an MXFP4 copy of a dense target checkpoint in AMD Quark's layout."""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.config import DEFAULT_EXCLUDE
from dflash_jax.kernels.mxfp4 import SCALE_MODES
from dflash_jax.models.quark import quantize_checkpoint


def add_parser(sub) -> None:
    """Registers ``quantize`` on the ``dflash-jax`` subcommands."""
    q = sub.add_parser("quantize")
    q.add_argument("--model", required=True, help="dense target checkpoint directory")
    q.add_argument("--out", required=True, help="output checkpoint directory")
    q.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="module pattern that stays dense, added to " + ", ".join(DEFAULT_EXCLUDE)
                   + " (repeatable; glob, or 're:REGEX' as in Quark; e.g. '*.self_attn.*')")
    q.add_argument("--input-scale-mode", choices=SCALE_MODES, default=None,
                   help="also record dynamic MXFP4 activations (Quark's input_tensors) with this scale rule; "
                   "default: weight-only")
    q.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the tensors left dense (default: the checkpoint's own, else bfloat16)")
    q.add_argument("--quiet", action="store_true", help="no loading progress bars")
    q.set_defaults(func=_cmd_quantize)


def _cmd_quantize(args) -> int:
    dtype = None if args.dtype is None else jnp.dtype(args.dtype)
    paths = quantize_checkpoint(args.model, args.out, exclude=tuple(args.exclude),
                                input_scale_mode=args.input_scale_mode, dtype=dtype, progress=not args.quiet,
                                overwrite=args.overwrite)
    print(f"{len(paths)} projections MXFP4 -> {args.out}")
    return 0
