"""The ``dflash-jax`` command line: one module per subcommand, registered here.

``generate`` (the main job), ``bench``, ``quantize`` and the training stages (``train-*``), then the developer
tools: ``ship`` (the shipped models' pipeline), the performance measurements and reports (``perf-model``,
``regime``, ``scaling``, ``step-profile``, ``quant-report``, ``sharding-report``, ``kernel-report``,
``kernel-bench``) and ``gpu-check``. This package is the only home of argparse; every subcommand is a thin
front end over the library, and ``python -m dflash_jax.cli.<module>`` runs one of them alone.
"""

from __future__ import annotations

import argparse

from dflash_jax.cli.args import Parser, run, version


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: ``python -m dflash_jax.cli.<module>`` imports this package first, and a
    # subcommand module already loaded by it would run twice (runpy's warning).
    from dflash_jax.cli import (
        bench,
        compile,
        generate,
        gpu_check,
        kernel_bench,
        kernel_report,
        perf_model,
        quant_report,
        quantize,
        regime,
        scaling,
        serve,
        serve_bench,
        sharding_report,
        ship,
        step_profile,
        train,
    )

    parser = Parser(prog="dflash-jax", description="DFlash speculative decoding in JAX")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, serve, bench, quantize, train):
        command.add_parser(sub)
    # then the developer tools: the shipped models' pipeline, the performance measurements and reports
    for tool in (ship, perf_model, regime, scaling, step_profile, quant_report, sharding_report, kernel_report,
                 kernel_bench, gpu_check, compile, serve_bench):
        tool.add_parser(sub)
    return parser


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))

