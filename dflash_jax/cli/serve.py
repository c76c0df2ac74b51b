"""``dflash-jax serve``: the OpenAI-compatible server's command line (flags as vLLM's ``serve``).

Checks the flags and the model configs before any weight loads (the method as ``generate`` chooses it:
``--method``, ``--speculative-config``, ``--draft-model``, ``--block-size``) and binds ``--host``/``--port`` (a
port in use is refused before anything loads), loads the target and proposer through ``frontend.py``, builds the
engine (``serve/engine.py``) over ``--max-num-seqs`` slots of ``--max-model-len`` tokens, which with
``--block-size auto`` (the default) chooses the block each step for the rows it runs (``serve/schedule.py``; a
draft tree as given unless ``--auto-candidates`` names budgets), compiles and times its programs (kept across starts in
``--compilation-cache-dir``: ``io/compile_cache.py``), saying what it does at each phase, and serves the app
(``serve/app.py``) with uvicorn (``serve/server.py``) on the bound socket until SIGINT or SIGTERM: then it stops
taking connections, finishes the requests in flight, and exits. An engine that fails ends it with status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

import jax

from dflash_jax import frontend, parallel
from dflash_jax.cli import args as cli_args
from dflash_jax.config import DrafterConfig, read_target_config
from dflash_jax.decoding import prefix as prefix_store
from dflash_jax.io import compile_cache
from dflash_jax.serve import cost_cache
from dflash_jax.serve.engine import DEFAULT_BATCHED_TOKENS

log = logging.getLogger("dflash_jax.serve")

DEFAULT_MAX_MODEL_LEN = 2048
SHIPPED_NAME = "dflash-jax-shipped"  # the model id of the shipped pair (no --model given)
KEEP_ALIVE_S = 5  # uvicorn's and vLLM's
HEARTBEAT_S = 5.0  # a start-up phase that lasts longer is logged again this often, with its seconds so far
READ_TIMEOUT_S = 60.0


def _settings(args):
    """(model dir, draft dir, method, max_model_len, target config): every check that needs no weights."""
    from dflash_jax.cli.generate import asks_dflash2, drafter_source, method_from_flags, parse_speculative_config

    spec = parse_speculative_config(args.speculative_config) if args.speculative_config else None
    draft_path, draft_flag = drafter_source(args, spec)
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1 (1 = plain decoding), got {args.block_size}")
    for flag in ("max_num_seqs", "max_queue_len", "max_model_len", "max_num_batched_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.distributed or args.coordinator_address or args.num_processes or args.process_id is not None:
        raise ValueError("serve runs in one process: its mesh is this process's devices (--tensor-parallel-size, "
                         "--data-parallel-size, --expert-parallel-size); --distributed and its flags are not supported")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    model_dir, draft_dir = frontend.model_dirs(args.model, draft_path, asks_dflash2(args, spec), draft_flag)
    cfg, _ = read_target_config(model_dir)
    draft_block = None
    if draft_dir is not None:
        draft_block = DrafterConfig.from_pretrained(draft_dir).block_size
    if spec is None and draft_dir is None and args.block_size is None and not args.method:  # nothing to draft with
        from dflash_jax.cli.generate import MTP_DEFAULT_STEPS

        has_mtp = cfg.mtp_num_hidden_layers and frontend.checkpoint_has_mtp(model_dir)  # as generate (and vLLM)
        method = frontend.Method("mtp", MTP_DEFAULT_STEPS + 1) if has_mtp else frontend.AR
    else:
        method = method_from_flags(args, spec, draft_block)
    if method.kind == "dflash" and method.block > draft_block:
        raise ValueError(f"{method.block - 1} drafts per step (block {method.block}) exceed the drafter's block "
                         f"size {draft_block} ({draft_dir})")
    if method.kind == "mtp" and not cfg.mtp_num_hidden_layers:
        raise ValueError(f"--speculative-config: method 'mtp' needs an MTP head; {model_dir} has none")
    limit = cfg.max_position_embeddings
    max_len = args.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
    if max_len > limit:
        raise ValueError(f"--max-model-len {max_len} exceeds the target's max_position_embeddings {limit} "
                         f"({model_dir})")
    if max_len < 2:
        raise ValueError(f"--max-model-len {max_len}: a request needs at least one prompt and one new token")
    return model_dir, draft_dir, method, max_len, cfg


class _Phases:
    """The start's log: ``say(note)`` logs a phase as it begins, and while it lasts a thread logs it again every
    ``HEARTBEAT_S`` seconds with the seconds it took so far (one compilation takes half a minute on a busy
    machine), so a start is never silent for long. A context manager: the thread ends with it."""

    def __init__(self):
        self._lock, self._done = threading.Lock(), threading.Event()
        self._note, self._since = None, 0.0
        self._thread = threading.Thread(target=self._beat, name="dflash-jax-start-log", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def __call__(self, note: str) -> None:
        with self._lock:
            self._note, self._since = note, time.perf_counter()
        log.info("%s", note)

    def _beat(self) -> None:
        while not self._done.wait(HEARTBEAT_S):
            with self._lock:
                note, took = self._note, time.perf_counter() - self._since
            if note is not None and took >= HEARTBEAT_S:
                log.info("%s (still at it: %.0f s)", note, took)


def build(args, mesh=None, settings=None, cache_dir=None):
    """(Served, the app) for the flags (``settings``: ``_settings(args)`` when already checked): models loaded,
    the engine built (and compiled unless --no-warmup), each phase logged (``_Phases``). ``cache_dir``: the
    compilation cache's folder, where the warm-up's step costs are kept for the next start of this configuration
    (``serve/cost_cache.py``; None: they are timed and not kept)."""
    with _Phases() as say:
        return _build(args, mesh, settings, say, cache_dir)


def _build(args, mesh, settings, say, cache_dir):
    from dflash_jax.decoding import blocksize
    from dflash_jax.decoding.loop import SpeculativeLoop
    from dflash_jax.serve.app import Served, create_app
    from dflash_jax.serve.engine import Engine, spec_for

    model_dir, draft_dir, method, max_len, cfg = settings or _settings(args)
    dtype = args.dtype or frontend.default_dtype()
    started = time.perf_counter()
    say(f"loading {model_dir}{'' if draft_dir is None else f' and {draft_dir}'} ({dtype}) ...")
    target, drafter = frontend.load_models(model_dir, draft_dir, [method], dtype=frontend.DTYPES[dtype],
                                          progress=False, mesh=mesh, draft_window=getattr(args, "draft_window", None))
    if method.kind == "mtp" and not frontend.has_mtp(target):
        raise ValueError(f"--speculative-config: method 'mtp' needs the mtp.* weights; {model_dir} has none")
    tokenizer = frontend.load_tokenizer(args.tokenizer or model_dir, "--tokenizer" if args.tokenizer else "--model")
    log.info("loaded in %.1f s", time.perf_counter() - started)
    if not getattr(tokenizer, "chat_template", None):
        log.warning("the tokenizer has no chat template: a chat request's messages are encoded as raw text (their "
                    "contents joined by newlines), as `generate --chat-template auto` encodes a prompt")
    options, rows = _speculation(args, method)
    if method.tree is not None and options is None:
        log.info("draft trees: %s, as given (--auto-candidates weighs budgets); %d tokens verified per row and "
                 "step, depth <= %d", method.name, method.tree + 1, method.block - 1)
    proposer, pparams = frontend.proposer_for(method, target, drafter)
    loop = SpeculativeLoop.of(target, proposer, spec_for(method.block, max_len, method.tree), mesh)
    params = (target.params, pparams)
    if mesh is not None:
        params = parallel.shard_params(params, mesh, target.cfg, proposer)
    card = blocksize.read_card(draft_dir) if draft_dir is not None and options else None
    say(f"building the engine: {args.max_num_seqs} empty slots (one prefill program) ...")
    engine = Engine(loop, params, slots=args.max_num_seqs, max_model_len=max_len,
                    max_queue=args.max_queue_len or 4 * args.max_num_seqs, options=options, rows=rows,
                    prior=card.acceptance if card is not None and card.fits(draft_dir) else None,
                    prefix_cache_bytes=_prefix_cache_bytes(args), max_num_batched_tokens=args.max_num_batched_tokens)
    cache = f"{engine.store.capacity_bytes / 2**30:.2f} GiB in blocks of {engine.prefix_block} tokens" if engine.store \
        else "off (--no-enable-prefix-caching)"
    log.info("prefix cache: %s; prompts prefilled in chunks of up to %d tokens", cache, engine.chunk)
    if options:
        log.info("speculation by load: each step runs %s over the running rows' bucket of %s; the step costs are "
                 "timed at warm-up", " or ".join(o.name for o in engine.schedule.options),
                 "/".join(map(str, engine.schedule.rows)))
    log.info("serving %s (%s, block %d) with %d slots of %d tokens on %s", model_dir, method.name, method.block,
             args.max_num_seqs, max_len, jax.default_backend())
    if not args.no_warmup:
        stamp = cache_dir and cost_cache.fingerprint(_engine_flags(args), [d for d in (model_dir, draft_dir) if d])
        costs = cost_cache.load(cache_dir, stamp, engine.schedule.programs(), engine.buckets()) if cache_dir else None
        if costs is not None:
            log.info("step costs: as an earlier start of this configuration measured them (%s), not timed again",
                     cost_cache.path(cache_dir, stamp))
        say(f"warm-up: compiling prefill (buckets {engine.buckets()}), insert and step ...")
        engine.warmup(progress=lambda note: say(f"warm-up: {note}"), costs=costs)
        if cache_dir and costs is None:
            cost_cache.save(cache_dir, stamp, (engine.schedule.costs, engine.schedule.copy, engine.chunk_costs))
    served = Served(engine=engine, tokenizer=tokenizer, model_name=model_name(args), eos_ids=tuple(cfg.eos_token_ids),
                    speculative=method.block > 1)
    return served, create_app(served)


# flags that change nothing the warm-up measures (the step costs are kept across starts without them)
_NOT_ENGINE = ("func", "command", "host", "port", "uvicorn_log_level", "timeout_keep_alive", "read_timeout",
               "served_model_name", "tokenizer", "compilation_cache_dir", "max_queue_len", "no_warmup")


def _engine_flags(args) -> dict:
    """The flags of ``args`` that set the engine (and so the step costs its warm-up measures)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_ENGINE}


def model_name(args) -> str:
    """The model id clients give: --served-model-name, else --model as given (vLLM's rule), else the shipped pair's."""
    return args.served_model_name or args.model or SHIPPED_NAME


def _speculation(args, method):
    """(options, rows buckets) of the engine's per-step choice (``serve/schedule.py``; None: the engine's defaults,
    one option, all slots): with ``--block-size auto`` (the default) a chain's block is chosen each step among
    ``--auto-candidates`` (default: plain decoding and the method's block); a draft tree is kept as given unless
    ``--auto-candidates`` names budgets; ``--auto-rows`` (default: powers of 4 and --max-num-seqs, when the choice
    is on) sets the rows buckets of any server."""
    from dflash_jax.cli.generate import auto_block
    from dflash_jax.serve import schedule

    on = method.block > 1 and (args.auto_candidates is not None or (method.tree is None and auto_block(args)))
    options = schedule.options_for(method.block, method.tree, args.auto_candidates) if on else None
    rows = args.auto_rows or (schedule.default_rows(args.max_num_seqs) if on else None)
    return options, rows


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` for uvicorn (listening starts with the server), so that a port in use
    is refused before any model loads; a one-line error naming --host/--port otherwise."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)  # claimed now: another server's bind or listen on it fails from here on
    except OSError as e:
        sock.close()
        raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                         f"running there? Give another --port") from None
    sock.set_inheritable(True)
    return sock


def memory_size(text: str) -> int | float:
    """``--prefix-cache-size``: bytes (an integer with an optional K, M, G or T suffix, powers of 1024), or a
    fraction in (0, 1) of the memory (``_memory_bytes``), kept as a float until the device is known."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = text.strip().upper().removesuffix("B").removesuffix("I"), ""
    if number[-1:] in units:
        number, unit = number[:-1], number[-1]
    try:
        if "." in number and not unit:
            fraction = float(number)
            if 0 < fraction < 1:
                return fraction
        elif int(number) >= 0:
            return int(number) * units[unit]
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected bytes (e.g. 512M, 2G, 1073741824) or a fraction of the memory in "
                                     f"(0, 1) (e.g. 0.1), got {text!r}")


def _memory_bytes() -> int:
    """The memory the prefix cache's fraction is of: the first device's (its allocator's limit), else the host's."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _prefix_cache_bytes(args) -> int:
    """The prefix cache's bytes (0: off) from ``--enable-prefix-caching`` and ``--prefix-cache-size``."""
    if not args.enable_prefix_caching:
        return 0
    size = args.prefix_cache_size
    return int(size * _memory_bytes()) if isinstance(size, float) else size


def server(app, args):
    """The uvicorn server of ``app`` with the flags' timeouts and log level (``serve/server.py``)."""
    from dflash_jax.serve import server

    return server.make(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                       timeout_keep_alive=args.timeout_keep_alive, read_timeout=args.read_timeout)


def cmd_serve(args) -> int:
    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    log.setLevel(logging.INFO)  # this server's notes; other libraries' (JAX's backend probing) only when warnings
    settings = _settings(args)  # every flag checked before processes are joined or weights loaded
    sock = bind(args.host, args.port)
    try:
        cache = compile_cache.enable(args.compilation_cache_dir)
        _, app = build(args, cli_args.mesh_from_args(args), settings, cache)
        compiled, loaded = compile_cache.tally()
        kept = f"{compiled} programs compiled, {loaded} loaded from {cache}" if cache else "no compilation cache"
        log.info("ready in %.1f s (%s)", time.perf_counter() - started, kept)
        server(app, args).run(sockets=[sock])
    finally:
        sock.close()
    if app.state.engine_failed:
        print("dflash-jax: error: the engine failed (its traceback is above); the server stopped", file=sys.stderr)
        return 1
    return 0


def _block_size_flag(text: str) -> int | None:
    from dflash_jax.cli.generate import block_size_flag

    return block_size_flag(text)


def add_parser(sub) -> None:
    s = sub.add_parser("serve")
    s.add_argument("--model", help="target checkpoint directory (default: the shipped small target)")
    s.add_argument("--draft-model", help="DFlash drafter directory (default: the shipped drafter with the shipped "
                   "target; none with --model)")
    s.add_argument("--speculative-config", help='vLLM-style JSON, e.g. \'{"method": "dflash", "model": DIR, '
                   '"num_speculative_tokens": 15}\', \'{"method": "mtp", "num_speculative_tokens": 3}\' or '
                   '\'{"method": "ddtree", "model": DIR, "num_speculative_tokens": 32}\' (a draft tree of 32 '
                   "nodes, depth up to the drafter's block - 1)")
    s.add_argument("--method", help="the method by name, in place of --block-size/--speculative-config: ar, mtp:K, "
                   "dflash:B, dflash2:B, or ddtree:N (a draft tree per row of the N best continuations, depth <= 15; "
                   "ddtree:N:B for block B)")
    s.add_argument("--block-size", type=_block_size_flag, default=None, metavar="{auto,N}",
                   help="tokens per verify step (1 = plain decoding); auto (the default): chosen each step among "
                   "--auto-candidates for the rows it runs, from step costs timed at warm-up and the acceptance seen "
                   "(/stats' \"speculation\")")
    s.add_argument("--auto-candidates", type=cli_args.ints, metavar="N,N,...",
                   help="what --block-size auto weighs each step: blocks of the chain (1: plain decoding; default: 1 "
                   "and the drafter's block), or with a draft tree its budgets (0: plain decoding; given, the tree's "
                   "budget is chosen each step too; default: the tree as given). Each is a compiled step per rows "
                   "bucket")
    s.add_argument("--auto-rows", type=cli_args.ints, metavar="R,R,...",
                   help="rows buckets: a step runs the smallest that holds the running requests (default with "
                   "--block-size auto: the powers of 4 below --max-num-seqs and --max-num-seqs; else "
                   "--max-num-seqs)")
    s.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    cli_args.add_draft_window_argument(s)
    s.add_argument("--served-model-name", help=f"the model id requests give (default: --model as given, else "
                   f"{SHIPPED_NAME!r})")
    s.add_argument("--max-num-seqs", type=int, default=32, help="slots: requests decoded together in one step")
    s.add_argument("--max-model-len", type=int, help=f"context per request, prompt + completion (default: the "
                   f"target's max_position_embeddings, at most {DEFAULT_MAX_MODEL_LEN})")
    s.add_argument("--max-queue-len", type=int, help="requests that may wait for a slot; more get 503 with "
                   "Retry-After (default: 4 x --max-num-seqs)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep prefilled prompts and resume a request from the longest stored prefix of its prompt "
                   "(vLLM's flag; --no-enable-prefix-caching turns it off)")
    s.add_argument("--prefix-cache-size", type=memory_size, default=prefix_store.DEFAULT_CAPACITY_BYTES,
                   metavar="SIZE", help="the prefix cache's bound: bytes (an integer, with K, M, G or T for powers of "
                   "1024) or a fraction of the device's memory (of the host's on a CPU), e.g. 0.1; the least recently "
                   "used prefixes go first (default: 1G)")
    s.add_argument("--max-num-batched-tokens", type=_block_size_flag, default=None, metavar="{auto,N}",
                   help="prefill a prompt in chunks of at most N tokens per engine iteration, between the running "
                   "requests' steps (vLLM's flag); auto (the default): while requests run, the widest chunk (16, 32, "
                   "64, ...) whose cost timed at warm-up is at most the step after it, so a stream waits about two "
                   f"steps while a prompt prefills; {DEFAULT_BATCHED_TOKENS} tokens while none runs (/stats' "
                   '"prefill")')
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--dtype", choices=tuple(frontend.DTYPES), default=None,
                   help="parameter dtype (default: bfloat16 on GPU/TPU, float32 on CPU)")
    s.add_argument("--no-warmup", action="store_true", help="compile each program at its first use instead of "
                   "before serving")
    s.add_argument("--uvicorn-log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S, metavar="S",
                   help="close a connection idle for S seconds after a response (uvicorn's, as vLLM's)")
    s.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S, metavar="S",
                   help="close a connection whose request headers are not whole S seconds after it opened (or after "
                   "its last response); a body not whole S seconds after its headers is a 408")
    compile_cache.add_argument(s)
    cli_args.add_mesh_arguments(s)
    s.set_defaults(func=cmd_serve)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
