"""Flag types, the help formatter, the scale-out flags and the running of one parsed command, shared by the
``dflash-jax`` subcommands.

Every subcommand's parser is a ``Parser`` (each option's default on its help line); ``add_mesh_arguments`` and
``mesh_from_args`` turn vLLM-style parallel sizes and JAX's process flags into a device mesh
(``dflash_jax.parallel.make_mesh``); ``run`` checks a parsed command's outputs and turns a bad input into one
error line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, NoReturn

from dflash_jax.cli import interrupt
from dflash_jax.decoding.runtime import use_tpu_xla_flags
from dflash_jax.io import atomic

if TYPE_CHECKING:  # JAX is imported where a command runs, not to build the parser (``dflash-jax --help``)
    from jax.sharding import Mesh

SEED_MAX = 2**31 - 1  # seeds become int32 keys


def seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= seed <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in 0..{SEED_MAX}, got {seed}")
    return seed


def int_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _no_default(value) -> bool:
    return value is None or value is False or value == argparse.SUPPRESS or value == []


class _Formatter(argparse.HelpFormatter):
    """Help text with each option's default appended (unless the help already says it, or there is none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or "default:" in text or _no_default(action.default):
            return text
        return f"{text} (default: %(default)s)".lstrip()

    def add_argument(self, action):
        super().add_argument(action)
        subcommands = [] if action.help == argparse.SUPPRESS else list(self._iter_indented_subactions(action))
        if subcommands:  # argparse measures a subcommand's name without its indent: one line each, help aligned
            self._action_max_length = max(self._action_max_length, self._current_indent + self._indent_increment
                                          + max(len(self._format_action_invocation(a)) for a in subcommands))


class Parser(argparse.ArgumentParser):
    """An ArgumentParser (subcommands too) whose --help shows every option's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if "help" not in kwargs and not _no_default(kwargs.get("default")):
            kwargs["help"] = "(default: %(default)s)"  # argparse prints no help line for an option without help
        action = super().add_argument(*args, **kwargs)
        writes = set(action.option_strings) & set(OUTPUT_FLAGS) or (
            set(action.option_strings) & set(OUTPUT_FILE_FLAGS) and action.nargs != 0)  # not a --json switch
        if writes and "overwrite" not in self._defaults and not any(
                a.dest == "overwrite" for a in self._actions):  # every writer of a directory or file: --overwrite
            super().add_argument("--overwrite", action="store_true",
                                 help="write into an existing, non-empty output directory that this command did "
                                      "not write (by default only a new or empty one, or this command's own)")
        return action


def version() -> str:
    try:
        return metadata.version("dflash-jax")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def positive(text: str) -> int:
    """An integer >= 1 (a size or a count), refused at parsing with the flag's name otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_draft_window_argument(parser) -> None:
    """``--draft-window N`` (generate, bench, serve, compile): ``frontend.load_models(draft_window=)``."""
    parser.add_argument("--draft-window", type=positive, metavar="N",
                        help="bound the drafter's context: each draft block sees at most the last N context "
                             "positions (N >= the drafter's block size), so its cost stops growing with the "
                             "context; decoding stays exact, acceptance may drop (default: the whole context)")


def add_mesh_arguments(parser) -> None:
    """The scale-out flags (vLLM's names for the sizes, JAX's for joining processes) on a CLI parser."""
    g = parser.add_argument_group("scale-out (a device mesh; several processes)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive, default=1,
                   help="devices on the model axis: heads, MLP width, vocabulary (and experts) split over them")
    g.add_argument("--data-parallel-size", "-dp", type=positive, default=1,
                   help="devices on the data axis: rows of a batch")
    g.add_argument("--expert-parallel-size", type=positive, default=1,
                   help="devices on the expert axis: MoE experts split over tensor x expert parallel devices")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-process run (jax.distributed.initialize): the flags below, else "
                        "JAX_COORDINATOR_ADDRESS, else detected (Slurm, Open MPI, TPU); implied by them")
    g.add_argument("--coordinator-address", metavar="HOST:PORT", help="process 0's address, the same on every process")
    g.add_argument("--num-processes", type=positive, help="processes in the run")
    g.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")


def mesh_from_args(args) -> Mesh | None:
    """Joins the processes the flags ask for, silences stdout on all but process 0, and returns the mesh
    of the parallel sizes (None when they are all 1 in one process: the unsharded, one-device path).

    The sizes' product must equal the global device count (every process's devices); a clear error
    names the flags otherwise. Call before any other JAX work (``jax.distributed.initialize``'s rule).
    """
    import jax

    from dflash_jax.parallel import make_mesh

    sizes = {flag: getattr(args, flag.replace("-", "_"))
             for flag in ("data-parallel-size", "tensor-parallel-size", "expert-parallel-size")}
    for flag, value in sizes.items():
        if value < 1:
            raise ValueError(f"--{flag} must be >= 1, got {value}")
    join = {k: getattr(args, k) for k in ("coordinator_address", "num_processes", "process_id")}
    if args.distributed or any(v is not None for v in join.values()) or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        if join["num_processes"] is not None and join["num_processes"] < 1:
            raise ValueError(f"--num-processes must be >= 1, got {join['num_processes']}")
        if join["process_id"] is not None and not 0 <= join["process_id"] < (join["num_processes"] or 2**31):
            raise ValueError(f"--process-id {join['process_id']} is outside 0 .. --num-processes - 1")
        jax.distributed.initialize(**join)
    if jax.process_index() != 0:  # only process 0 prints: the others' stdout (Python's and C++'s) is discarded
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    data, model, expert = sizes.values()
    if data * model * expert == 1 and jax.process_count() == 1:
        return None  # one device (of however many this process sees)
    if data * model * expert != jax.device_count():
        raise ValueError(f"--data-parallel-size {data} x --tensor-parallel-size {model} x --expert-parallel-size "
                         f"{expert} = {data * model * expert}, but the run has {jax.device_count()} devices "
                         f"({jax.process_count()} process(es) of {jax.local_device_count()}); the product must "
                         f"equal the device count")
    return make_mesh(data=data, model=model, expert=expert)


# Output directories (the flag's dest) and the input checkpoints (dests) no output may be, hold or lie in.
OUTPUT_FLAGS = ("--out", "--ckpt-dir")
OUTPUT_FILE_FLAGS = ("--json",)  # a tool's JSON file, when the flag takes a path
INPUT_DESTS = ("model", "draft_model", "target", "tokenizer")


def check_outputs(args) -> None:
    """Output folders are claimed (``atomic.claim_directory``: new, empty, this command's own, or ``--overwrite``;
    never an input model's), and checkpoint settings checked consistent, before any work starts."""
    inputs = [getattr(args, d) for d in INPUT_DESTS if isinstance(getattr(args, d, None), str | os.PathLike)]
    outputs = {flag: getattr(args, flag[2:].replace("-", "_"), None) for flag in OUTPUT_FLAGS}
    outputs = {flag: path for flag, path in outputs.items() if path is not None}
    if len(outputs) == 2:
        out, ckpt = (os.path.abspath(p) for p in outputs.values())
        if os.path.commonpath([out, ckpt]) in (out, ckpt):
            raise ValueError(f"--out {outputs['--out']} and --ckpt-dir {outputs['--ckpt-dir']} overlap (one is, holds "
                             "or lies in the other): the finished output would replace the checkpoints, or the "
                             "reverse; give separate directories")
    writer = f"dflash-jax {args.command}"
    for flag in OUTPUT_FILE_FLAGS:
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if isinstance(path, str | os.PathLike):
            atomic.check_output_file(path, writer=writer, flag=flag, overwrite=getattr(args, "overwrite", False),
                                     sources=inputs)
    # (path, existed): undone by ``run`` if the command fails before writing there (no folder left holding a marker)
    args.claimed_outputs = [(path, os.path.isdir(path)) for path in outputs.values()]
    for create in (False, True):  # every output checked before any is created
        for flag, path in outputs.items():
            atomic.claim_directory(path, writer=f"dflash-jax {args.command}", flag=flag, create=create,
                                   overwrite=getattr(args, "overwrite", False), sources=inputs)
    if getattr(args, "ckpt_dir", None) is not None and args.ckpt_every < 1:
        raise ValueError(f"--ckpt-every {args.ckpt_every} with --ckpt-dir would never save a checkpoint; "
                         f"give a step interval >= 1")
    if getattr(args, "repeats", 1) < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if getattr(args, "max_new_tokens", 1) < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def quiet_libtpu() -> None:
    """On a host without TPU chips, tells libtpu it is one worker on this host before anything loads it.

    libtpu is loaded there only to compile for named TPU topologies (``compile --platform tpu``), and without these
    it prints an ``E0000 ... unexpected worker hostname`` block (and a host-bounds warning) on every start, having
    found neither a TPU VM's metadata nor ``TPU_WORKER_HOSTNAMES``. Compile-only devices come from the topology
    named, so this changes no compiled program (checked: the same cost and memory analyses). On a TPU host (or with
    the variables set) nothing is touched: a pod's worker list is the runtime's to find."""
    if "TPU_WORKER_HOSTNAMES" in os.environ:
        return
    try:
        from jax._src import hardware_utils  # JAX's own check of the PCI bus for TPU chips

        chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    except Exception:  # noqa: BLE001 -- a JAX without it: say nothing, change nothing
        return
    if not chips:
        os.environ["TPU_WORKER_HOSTNAMES"] = "localhost"
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


def _release_claims(args) -> None:
    """A failed command's output folders that hold only its claim marker are put back as they were (``args``: None
    before the command line is parsed: none)."""
    for path, existed in getattr(args, "claimed_outputs", ()):
        atomic.release_claim(path, writer=f"dflash-jax {args.command}", existed=existed)


def run(parse: Callable[[], argparse.Namespace]) -> int:
    """Parses the command line (``parse()``: it imports the command's module, JAX and more, for seconds) and runs
    the command (``args.func``): its exit status, 2 with one ``dflash-jax: error:`` line on bad input, 128 + the
    signal (130, 143) after Ctrl-C or SIGTERM, from the parsing on (``interrupt.stop_on_signals``: within
    seconds)."""
    args = None  # the cleanup reads it as it is then: None until parsed
    with interrupt.stop_on_signals(lambda: _release_claims(args)) as stop:
        try:
            args = parse()
            quiet_libtpu()
            use_tpu_xla_flags()
        except KeyboardInterrupt:
            _interrupted(stop)
        return _run(args, stop)


def _interrupted(stop: interrupt.Stop) -> NoReturn:
    """Ctrl-C or SIGTERM (often during a compile): one line and the shell's status for the signal. os._exit, not a
    return: the interpreter's teardown with XLA's compile threads still running (or a half-imported JAX) can crash
    (SIGSEGV) or hang."""
    status = stop.take()
    print("\ndflash-jax: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(args, stop: interrupt.Stop) -> int:
    from dflash_jax.config import ConfigError
    from dflash_jax.io.checkpoint import CheckpointError

    try:
        try:
            check_outputs(args)
            status = args.func(args) or 0
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                stop.take()  # no further deliveries while the claims are undone
            _release_claims(args)
            raise
        if status:
            _release_claims(args)
        for flag in OUTPUT_FILE_FLAGS:  # the files written are marked as this command's: a rerun may replace them
            path = getattr(args, flag[2:].replace("-", "_"), None)
            if isinstance(path, str | os.PathLike) and os.path.isfile(path):
                atomic.mark_file(path, f"dflash-jax {args.command}")
        return status
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"dflash-jax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _interrupted(stop)
