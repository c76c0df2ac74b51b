"""The loop's runtime settings that must be in place before JAX first touches a device: libtpu's options.

Sits beside the loop (``loop.py``): the command line (``cli/args.py``) applies them before any program runs, and
the TPU compile report (``perf/compile_report.py``) compiles with the same ones. The front ends' own helpers
(model folders, tokenizer, methods) live in ``dflash_jax/frontend.py``.
"""

from __future__ import annotations

import os

# libtpu options for the loop's programs. Its memory-space assignment prefetches every weight small enough for
# VMEM (a 35B-A3B layer's projections are <= 34 MB) into it ahead of its matmul, and its own cost model charges
# that as more bytes and more time than reading the weight where it lies: with the prefetches off the 35B-A3B
# decode's bytes fall from 2.29x to 1.05x its floor and every program's time estimate falls or holds
# (docs/compile.md, "One libtpu option"). The compiler's estimate, not a TPU's clock.
TPU_XLA_FLAGS = {"xla_msa_max_outstanding_prefetches": "0"}


def use_tpu_xla_flags(environ=os.environ) -> list[str]:
    """Adds ``TPU_XLA_FLAGS`` to ``LIBTPU_INIT_ARGS`` (read once, when libtpu starts: call before JAX first uses a
    TPU), each unless the variable already names it, so a user's own value wins. Returns the flags added."""
    current = environ.get("LIBTPU_INIT_ARGS", "")
    named = {arg.lstrip("-").split("=", 1)[0] for arg in current.split()}
    added = [f"--{key}={value}" for key, value in TPU_XLA_FLAGS.items() if key not in named]
    if added:
        environ["LIBTPU_INIT_ARGS"] = " ".join([current, *added]).strip()
    return added
