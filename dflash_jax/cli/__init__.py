"""The ``dflash-jax`` command line: one module per subcommand, registered here, grouped as users meet them.

The verbs a user starts with come first: ``generate`` (the main job), ``serve``, ``bench``, ``compile``,
``quantize``, ``train {tokenizer,target,drafter,mtp}`` and ``ship`` (the shipped models' pipeline); the measurement
tools follow under ``report`` (``perf-model``, ``regime``, ``scaling``, ``step-profile``, ``quant``, ``sharding``,
``kernels``, ``kernel-bench``, ``serve-bench``, ``gpu-check``): each measures something (kernels on a GPU, running
servers, a first GPU's kernels, steps and tau) rather than doing a user's job. The names before this grouping
(``train-drafter``, ``perf-model``, ``quant-report``, ...) still run, with a one-line notice, for one release.

``main`` imports only the module of the command it runs (``--help`` and the one-line listing come from the table
below), so ``dflash-jax --help`` loads neither JAX nor transformers. This package is the only home of argparse;
every subcommand is a thin front end over the library, and ``python -m dflash_jax.cli.<module>`` runs one alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dflash_jax.cli.args import Parser, run, version

# name -> (module under dflash_jax/cli, one line of help), in the order --help lists them. A group's table (GROUPS)
# names its members; a module may register several of them (train.py: every stage).
COMMANDS = {
    "generate": ("generate", "stream completions, then time them against plain decoding"),
    "serve": ("serve", "an OpenAI-compatible server with continuous batching"),
    "bench": ("bench", "tau, tokens/s and speed-up of each method on a workload"),
    "compile": ("compile", "compile the loop for a TPU or GPU on this host: memory, cost"),
    "quantize": ("quantize", "write an MXFP4 copy of a target (AMD Quark's layout)"),
    "train": (None, "train a tokenizer, target, drafter or MTP head"),
    "ship": ("ship", "rebuild the shipped target, drafter and MTP head from scratch"),
    "report": (None, "measurements: perf-model, regime, scaling, step-profile, ..."),
}
GROUPS = {
    "train": {
        "tokenizer": ("train", "byte-level BPE on a corpus (HF tokenizer dir)"),
        "target": ("train", "pretrain a small Qwen3.5 target on a corpus"),
        "drafter": ("train", "a DFlash or DFlash2 drafter on a frozen target"),
        "mtp": ("train", "the target's MTP head, on the frozen target"),
    },
    "report": {
        "perf-model": ("perf_model", "bytes, FLOPs and projected tokens/s of a step at real shapes"),
        "regime": ("regime", "DFlash speed-up at a fixed tau on random-weight miniatures"),
        "scaling": ("scaling", "prefill time by prompt length, compile time by depth"),
        "step-profile": ("step_profile", "where a decoding step's time goes (per-op trace by scope)"),
        "quant": ("quant_report", "MXFP4 against dense: bytes, logit error, tau, tokens/s"),
        "sharding": ("sharding_report", "collectives of one decode step, sharded vs one device"),
        "kernels": ("kernel_report", "registers, spills, LDS and MFMA of each kernel (AMD)"),
        "kernel-bench": ("kernel_bench", "each kernel timed against its reference (GPU only)"),
        "serve-bench": ("serve_bench", "running servers side by side: tok/s, TTFT, latency"),
        "serve-sweep": ("serve_sweep", "running servers' tok/s by concurrency with z-lab's client"),
        "serve-prefix": ("serve_prefix", "prefix cache reuse, chunked prefill stalls, store memory"),
        "miniature": ("miniature", "write a servable random-weight pair with a set acceptance"),
        "gpu-check": ("gpu_check", "a first GPU's check: kernels, step times, DFlash at tau 10"),
    },
}
# The flat names of earlier releases -> the command they now are (kept for one release, with a notice).
OLD_NAMES = {
    **{f"train-{stage}": f"train {stage}" for stage in GROUPS["train"]},
    **{name: f"report {name}" for name in ("perf-model", "regime", "scaling", "step-profile", "kernel-bench",
                                           "serve-bench", "gpu-check")},
    "quant-report": "report quant", "sharding-report": "report sharding", "kernel-report": "report kernels",
}


class _Commands:
    """One level's subcommands: registers a command with its line of help from the table and its full name
    (``args.command``, e.g. "train drafter": what output folders are marked as written by)."""

    def __init__(self, sub, table: dict, prefix: str = ""):
        self.sub, self.table, self.prefix = sub, table, prefix

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        parser = self.sub.add_parser(name, help=self.table[name][1], **kwargs)
        parser.set_defaults(command=self.prefix + name)
        return parser


def _register(sub, table: dict, chosen: list[str] | None, prefix: str = "") -> None:
    """Each command of ``table`` on ``sub``: in full where ``chosen`` (the command line's path; None: all) leads,
    else as a name with its help line only (its module not imported)."""
    commands = _Commands(sub, table, prefix)
    wanted = {name for name in table if chosen is None or chosen[:1] == [name]}
    modules = {table[name][0] for name in wanted}  # each registers all its commands, where its first one is listed
    for name, (module, _) in table.items():
        if name in sub.choices:
            continue
        if name in GROUPS:
            parser = commands.add_parser(name, description=table[name][1])
            group = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
            _register(group, GROUPS[name], None if chosen is None else chosen[1:] if name in wanted else [],
                      f"{prefix}{name} ")
        elif module in modules:
            importlib.import_module(f"dflash_jax.cli.{module}").add_parser(commands)
        else:
            commands.add_parser(name, add_help=False)


def _path(argv: list[str]) -> list[str]:
    """The command named on a command line: its first words (a group's name and its member's)."""
    words = [a for a in argv if not a.startswith("-")]
    return words[:2] if words and words[0] in GROUPS else words[:1]


def module_command(module: str) -> list[str]:
    """The command that ``dflash_jax.cli.<module>`` registers (its one), as words: ["report", "perf-model"]."""
    module = module.rpartition(".")[2]
    (path,) = [[name] for name, (m, _) in COMMANDS.items() if m == module] + [
        [group, name] for group, table in GROUPS.items() for name, (m, _) in table.items() if m == module]
    return path


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``dflash-jax`` parser: every command in full, or with ``argv`` only the one it names (the rest listed)."""
    parser = Parser(prog="dflash-jax", description="DFlash speculative decoding in JAX")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _register(sub, COMMANDS, None if argv is None else _path(argv))
    return parser


def renamed(argv: list[str]) -> list[str]:
    """``argv`` with an earlier release's command name replaced by its new one (a one-line notice on stderr)."""
    i = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if i is None or argv[i] not in OLD_NAMES:
        return argv
    new = OLD_NAMES[argv[i]]
    print(f"dflash-jax: note: `dflash-jax {argv[i]}` is now `dflash-jax {new}`; the old name goes in the next "
          f"release", file=sys.stderr)
    return [*argv[:i], *new.split(), *argv[i + 1:]]


def main(argv=None) -> int:
    argv = renamed(list(sys.argv[1:] if argv is None else argv))
    return run(lambda: build_parser(argv).parse_args(argv))


def script(module: str) -> None:
    """``python -m dflash_jax.cli.<module>``: the module's one command on this process's arguments, run as
    ``dflash-jax <command>`` runs it (the other commands are not loaded); exits with its status."""
    sys.exit(main([*module_command(module), *sys.argv[1:]]))
