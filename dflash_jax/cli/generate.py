"""The ``dflash-jax`` command line: ``generate`` (the main job), ``bench``, ``quantize`` and the training stages.

Top of the data flow: ``generate`` checks every flag and input, loads a target and a proposer
through ``frontend.py``, streams completions through ``decoding.api.stream`` (their text decoded as the
tokens arrive, ``TextStream``) and then times
speculative decoding against plain decoding with ``bench.py``'s measurement (the same compiled
on-device loop, warm, repeated, interleaved). With no flags it runs the small models shipped in
``dflash_jax/assets`` on whatever JAX backend is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path

import jax

from dflash_jax import frontend
from dflash_jax.cli import args as cli_args
from dflash_jax.config import read_target_config
from dflash_jax.decoding import workloads
from dflash_jax.decoding.api import PositionWarning, position_warning, stream
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.text import TextStream
from dflash_jax.io import compile_cache
from dflash_jax.perf import bench, step_cost

SPEC_KEYS = ("method", "model", "num_speculative_tokens")
MTP_DEFAULT_STEPS = 3


def method_from_flags(args, spec: dict | None, draft_block: int | None) -> frontend.Method:
    """The method generate's flags ask for: ``spec`` (the parsed ``--speculative-config``) or
    ``--draft-model``/``--block-size``. (``frontend.parse_method`` reads a method string such as ``mtp:3``.)

    ``draft_block`` is the drafter's block size (None without a drafter). Settings that disagree,
    or that the chosen method would not use, are refused rather than dropped. ``--block-size auto`` (None)
    reads as the drafter's block here; ``cmd_generate`` then picks the block by cost (``auto_block``).
    """
    if getattr(args, "method", None):
        if spec is not None or args.block_size is not None:
            raise ValueError("--method names the method itself: leave out --block-size and --speculative-config")
        method = frontend.parse_method(args.method, "--method")
        if method.kind == "dflash" and draft_block is None:
            raise ValueError(f"--method {args.method} needs a drafter: give --draft-model DIR")
        return method
    if spec is None:
        if args.block_size == 1:
            if args.draft_model:
                raise ValueError("--block-size 1 is plain decoding: --draft-model would be unused")
            return frontend.AR
        if draft_block is None:
            raise ValueError(f"--block-size {args.block_size} needs a drafter: give --draft-model DIR or "
                             f"--speculative-config (--model has no default drafter)")
        return frontend.Method("dflash", draft_block if args.block_size is None else args.block_size)
    steps = spec.get("num_speculative_tokens")
    if spec["method"] == "ddtree":  # num_speculative_tokens: the tree's N nodes; its depth: the drafter's block - 1
        if args.block_size is not None:
            raise ValueError(f"--block-size {args.block_size}: with --speculative-config method 'ddtree' the tree's "
                             f"depth is the drafter's block - 1; leave out --block-size (or use --method "
                             f"ddtree:{steps}:B for block B)")
        if draft_block < 2:
            raise ValueError(f"--speculative-config: method 'ddtree' needs a drafter block >= 2, the drafter's is "
                             f"{draft_block}")
        return frontend.Method("dflash", draft_block, tree=steps)
    if args.block_size is not None and steps is not None and args.block_size != steps + 1:
        raise ValueError(f"--block-size {args.block_size} disagrees with --speculative-config's "
                         f"num_speculative_tokens {steps} (block = drafts + 1 = {steps + 1})")
    if steps is None and args.block_size is not None:
        steps = args.block_size - 1
    if spec["method"] == "mtp":
        steps = MTP_DEFAULT_STEPS if steps is None else steps
        if not 1 <= steps <= 15:
            raise ValueError(f"--speculative-config: MTP num_speculative_tokens must be in 1..15, got {steps}")
        return frontend.Method("mtp", steps + 1)
    block = draft_block if steps is None else steps + 1
    if block < 2:
        raise ValueError(f"--speculative-config: DFlash num_speculative_tokens must be >= 1, got {block - 1}")
    return frontend.Method("dflash", block, dflash2=spec["method"] == "dflash2")


def parse_speculative_config(text: str) -> dict:
    """vLLM's ``--speculative-config`` JSON object, every key checked."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(spec).__name__} {text!r}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config: unknown keys {unknown}; expected some of {list(SPEC_KEYS)}")
    if "method" not in spec or spec["method"] is None:  # as vLLM: a "model" without a method is a draft model's
        if not spec.get("model"):
            raise ValueError('--speculative-config: give "method": "mtp" (the target\'s own MTP head) or "model": '
                             'a DFlash drafter directory ("method" is then "dflash")')
        spec = {**spec, "method": "dflash"}
    method = spec["method"]
    if method not in ("dflash", "dflash2", "ddtree", "mtp"):
        raise ValueError(f"--speculative-config: unknown method {method!r}; expected 'dflash', 'dflash2', 'ddtree' "
                         f"or 'mtp'")
    steps = spec.get("num_speculative_tokens")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer, got {steps!r}")
    if steps is not None and steps < 1:
        raise ValueError(f"--speculative-config: num_speculative_tokens {steps} drafts nothing; use "
                         f"--block-size 1 for plain decoding")
    if method == "ddtree" and steps is None:
        raise ValueError('--speculative-config: method "ddtree" needs "num_speculative_tokens": the tree budget N '
                         "(draft tokens verified per step besides the anchor, e.g. 32)")
    model = spec.get("model")
    if method in ("dflash", "dflash2", "ddtree") and not (isinstance(model, str) and model):
        raise ValueError(f'--speculative-config: method "{method}" needs "model": the drafter directory')
    if method == "mtp" and model is not None:
        raise ValueError('--speculative-config: method "mtp" drafts with the target\'s own head; drop "model"')
    return spec


def _utf8(text: str, where: str) -> str:
    """``text`` if it came from valid UTF-8 (argv and stdin decode bad bytes to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start].encode("utf-8", "surrogateescape")
        raise ValueError(f"{where} is not valid UTF-8 (byte 0x{bad.hex()} at character {e.start})") from None
    return text


def read_prompts(args) -> list[str]:
    """The prompt texts: the positional prompt ('-': all of stdin) or ``--prompts`` JSONL ('-': stdin)."""
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("give a prompt, or --prompts FILE.jsonl (not both)")
    if args.prompt is not None:
        if args.prompt == "-":
            return [_utf8(sys.stdin.buffer.read().decode("utf-8", "surrogateescape"), "the prompt on stdin")]
        return [_utf8(args.prompt, "the prompt")]
    return workloads.read_prompt_texts(args.prompts, "--prompts")


@dataclasses.dataclass(frozen=True)
class Request:
    """Everything ``generate`` was asked to do, checked against the configs before any weight is loaded."""

    model_dir: Path
    draft_dir: Path | None
    method: frontend.Method
    texts: list[str]
    sampling: SamplingConfig
    stop_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    note: str = ""  # how the method was chosen, when no flag chose it


def asks_dflash2(args, spec: dict | None) -> bool:
    """Whether ``--method`` or ``--speculative-config`` names a DFlash2 method (the shipped DFlash2 drafter is
    then the default drafter)."""
    if spec is not None:
        return spec.get("method") == "dflash2"
    return bool(args.method) and frontend.wants_dflash2([frontend.parse_method(args.method, "--method")])


def drafter_source(args, spec: dict | None) -> tuple[str | None, str]:
    """(the drafter folder the user gave or None, the flag it came from, for errors): ``--speculative-config``'s
    "model" or ``--draft-model`` (the same folder if both are given)."""
    spec_model = (spec or {}).get("model")
    if not spec_model:
        return args.draft_model, "--draft-model"
    if args.draft_model and Path(spec_model) != Path(args.draft_model):
        raise ValueError(f"--draft-model {args.draft_model} disagrees with --speculative-config's model {spec_model}")
    return spec_model, '--speculative-config "model"'


def check_request(args) -> Request:
    """Every check that needs no weights: flags, configs (sizes only), the prompts' text."""
    texts = read_prompts(args)
    spec = parse_speculative_config(args.speculative_config) if args.speculative_config else None
    draft_path, draft_flag = drafter_source(args, spec)
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1 (1 = plain decoding), got {args.block_size}")
    model_dir, draft_dir = frontend.model_dirs(args.model, draft_path, asks_dflash2(args, spec), draft_flag)
    cfg, _ = read_target_config(model_dir)  # an MXFP4 (Quark) checkpoint too
    draft_block = draft_cfg = None
    if draft_dir is not None:
        from dflash_jax.config import DrafterConfig

        draft_cfg = DrafterConfig.from_pretrained(draft_dir)
        draft_block = draft_cfg.block_size
    note = ""
    if spec is None and draft_dir is None and args.block_size is None and not args.method:  # nothing to draft with
        if cfg.mtp_num_hidden_layers and frontend.checkpoint_has_mtp(model_dir):  # as vLLM: the model's own head
            method = frontend.Method("mtp", MTP_DEFAULT_STEPS + 1)
            note = (f"no drafter given: {model_dir} has an MTP head, so it drafts ({method.name}); --block-size 1 "
                    "for plain decoding, --draft-model DIR for DFlash")
        else:
            method = frontend.AR
            note = "no drafter given: plain decoding (give --draft-model DIR for DFlash speculative decoding)"
    else:
        method = method_from_flags(args, spec, draft_block)
    if method.kind == "dflash" and method.block > draft_block:
        raise ValueError(f"{method.block - 1} drafts per step (block {method.block}) exceed the drafter's block "
                         f"size {draft_block} ({draft_dir})")
    if method.kind == "dflash":
        frontend.check_generation([method], draft_cfg, draft_dir)
        frontend.check_tree_fits([method], cfg, "--method" if args.method else "--speculative-config")
    if method.kind == "mtp" and not cfg.mtp_num_hidden_layers:
        raise ValueError(f"--speculative-config: method 'mtp' needs an MTP head; {model_dir} has none "
                         f"(mtp_num_hidden_layers is 0)")
    if method.kind != "dflash" and args.draft_model:
        raise ValueError(f"--draft-model is unused by {method.name}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.top_k <= cfg.vocab_size:
        raise ValueError(f"--top-k must be in 0..{cfg.vocab_size} (the vocabulary; 0 = off), got {args.top_k}")
    bad = [i for i in args.stop_ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ValueError(f"--stop-ids {bad}: outside the vocabulary 0..{cfg.vocab_size - 1}")
    if any(not s for s in args.stop):
        raise ValueError("--stop: an empty stop string would stop at once")
    eos = () if args.ignore_eos else tuple(cfg.eos_token_ids)
    return Request(model_dir, draft_dir, method, texts,
                   SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
                   tuple(dict.fromkeys(eos + tuple(args.stop_ids))), tuple(_utf8(s, "--stop") for s in args.stop),
                   note)


def _complete(args, req: Request, tokenizer, it) -> dict:
    """Drains one prompt's ``stream`` (printing unless --json): its tokens, text, tau and finish reason.

    A stop string ends the stream early: the tokens keep the one that completed it, the text ends before it.
    """
    text = TextStream(tokenizer, req.stop_strings)
    printed, steps, emitted, out = 0, -1, 0, None

    def show():
        nonlocal printed
        if not args.json:
            print(text.text[printed:text.settled], end="", flush=True)
        printed = text.settled

    try:
        while not text.stopped:
            chunk = next(it)[0]
            steps, emitted = steps + 1, emitted + len(chunk)
            text.extend(chunk)
            show()
        it.close()
    except StopIteration as done:
        out = done.value
    text.finish()
    show()
    if out is None:  # tokens committed per target step: all but the prefill's first token, over the steps taken
        return dict(tokens=text.tokens, text=text.text, tau=(emitted - 1) / max(steps, 1), steps=steps,
                    finish_reason="stop")
    return dict(tokens=text.tokens, text=text.text, tau=float(out.tau[0]), steps=int(out.steps[0]),
                finish_reason=out.finish_names()[0])


def cmd_generate(args) -> int:
    mesh = cli_args.mesh_from_args(args)  # first: joins the other processes; only process 0 prints from here on
    req = check_request(args)
    compile_cache.enable(args.compilation_cache_dir)  # a second run loads what the first compiled
    dtype = frontend.resolve_dtype(args.dtype, req.model_dir)
    # The tokenizer and the prompts first: a broken tokenizer or template is reported before weights are loaded.
    tokenizer = frontend.load_tokenizer(args.tokenizer or req.model_dir, "--tokenizer" if args.tokenizer else "--model")
    prompts = [frontend.encode(tokenizer, t, args.chat_template) for t in req.texts]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i + 1} encodes to no tokens")
    auto = req.method.kind == "dflash" and req.method.tree is None and not args.method and auto_block(args)
    folders = {req.method: req.draft_dir} if req.method.kind == "dflash" else {}
    if auto and not (args.model or args.draft_model or args.speculative_config):  # the shipped pair: auto weighs
        folders[frontend.Method("dflash", 2, dflash2=True)] = frontend.ASSETS / "dflash2"  # its DFlash2 drafter too
    target, drafters = frontend.load_target_and_drafters(
        req.model_dir, folders, [req.method, *folders], dtype=frontend.DTYPES[dtype], progress=not args.quiet,
        mesh=mesh, draft_window=getattr(args, "draft_window", None))
    drafter = drafters.get(req.method)
    if req.method.kind == "mtp" and not frontend.has_mtp(target):
        raise ValueError(f"--speculative-config: method 'mtp' needs the mtp.* weights; {req.model_dir} has none")
    if req.note and not args.quiet:
        print(f"[{req.note}]", file=sys.stderr, flush=True)
    warnings.filterwarnings("ignore", category=PositionWarning)  # said here, before any text is streamed
    for i, p in enumerate(prompts):
        if (message := position_warning(target.cfg, [len(p)], args.max_new_tokens)) is not None:
            print(f"dflash-jax: warning: prompt {i + 1}: {message}", file=sys.stderr, flush=True)
    choice = choices = None
    if auto:  # --block-size auto: the block (and with the shipped pair, the drafter) chosen by cost
        choice, choices, why = auto_choice(args, req, target, drafters, folders, prompts, dtype, mesh)
        weighed = list(folders)[choices.index(choice)]  # the drafter whose block won
        drafter = drafters[weighed]
        req = dataclasses.replace(req, method=frontend.AR if choice.block == 1 else frontend.Method(
            "dflash", choice.block, dflash2=weighed.dflash2))
        if not args.quiet:
            for each in choices:
                print(f"[{each.reason()}]", file=sys.stderr, flush=True)
            if len(choices) > 1:
                print(f"[{why}]", file=sys.stderr, flush=True)
    proposer, pparams = frontend.proposer_for(req.method, target, drafter)
    kw = dict(drafter=None if req.method == frontend.AR else (proposer, pparams), block_size=req.method.block,
              max_new_tokens=args.max_new_tokens, sampling=req.sampling, stop_ids=req.stop_ids, rng=args.seed,
              mesh=mesh, tree_budget=req.method.tree)
    note = (lambda m: None) if args.quiet else (lambda m: print(f"[{m}]", file=sys.stderr, flush=True))
    note(f"compiling {req.method.name} (prefill and one step) on {jax.default_backend()}…")
    records = []
    for text, prompt in zip(req.texts, prompts, strict=True):
        if not args.json:
            print(text, end="", flush=True)
        records.append(dict(prompt=text, prompt_tokens=len(prompt),
                            **_complete(args, req, tokenizer, stream(target, [prompt], **kw))))
        if not args.json:
            print()
            r = records[-1]
            print(f"[{len(r['tokens'])} tokens, finish {r['finish_reason']}, {req.method.name}, tau {r['tau']:.2f}]")
    timings = None
    if not args.no_compare:
        note(f"timing {req.method.name} against plain decoding: compiling the on-device loops…")
        timings = bench.compare(target, proposer, pparams, req.method, prompts, max_new_tokens=args.max_new_tokens,
                                sampling=req.sampling, stop_ids=req.stop_ids, seed=args.seed, repeats=args.repeats,
                                drafter_cfg=None if drafter is None else drafter.cfg, dtype=dtype, mesh=mesh)
        if not args.json:
            print(bench.format_comparison(timings))
    if args.json:
        print(json.dumps(dict(model=str(req.model_dir), drafter=None if drafter is None else str(req.draft_dir),
                              method=req.method.name, block=req.method.block, dtype=dtype,
                              backend=jax.default_backend(), completions=records, timings=timings,
                              block_choice=choice and choice.as_dict(),
                              block_choices=choices and [c.as_dict() for c in choices]), indent=1))
    bad = [i + 1 for i, r in enumerate(records) if r["finish_reason"] == "nonfinite"]
    if bad:
        print(f"dflash-jax: error: prompt {', '.join(map(str, bad))}: the target's logits became non-finite (NaN or "
              f"Inf), so decoding stopped there. Check the checkpoint's weights, and try --dtype float32 "
              f"(bfloat16 overflows sooner) or a larger --temperature.", file=sys.stderr)
        return 1
    return 0


def auto_choice(args, req: Request, target, drafters: dict, folders: dict, prompts, dtype: str, mesh):
    """(the choice, every drafter's choice, the line weighing them) of ``--block-size auto``: each drafter of
    ``drafters`` ({DFlash method: drafter}, folders ``folders``) weighs its chains (``step_cost.choose``; plain
    decoding timed once, with the first), within one ``step_cost.BUDGET`` in all; ``blocksize.weigh`` picks."""
    import time

    from dflash_jax.decoding import blocksize

    start, choices = time.perf_counter(), []
    for method, folder in folders.items():
        family = "dflash2" if drafters[method].cfg.dflash2 else "dflash"
        blocks = blocksize.candidate_blocks(drafters[method].cfg.block_size)
        choice, _ = step_cost.choose(
            target, drafters[method], prompts, batch=len(prompts), draft_dir=folder,
            key=(str(req.model_dir), str(folder), dtype), max_new_tokens=args.max_new_tokens, sampling=req.sampling,
            seed=args.seed, mesh=mesh, blocks=blocks if not choices else blocks[1:], family=family,
            size_smallest=not choices,
            spent_before=time.perf_counter() - start,
            progress=None if args.quiet else lambda m, f=family: print(
                f"[block size auto: {'' if f == 'dflash' else f + ': '}{m}…]", file=sys.stderr, flush=True))
        choices.append(choice)
    best, why = blocksize.weigh(choices)
    return best, choices, why


def block_size_flag(text: str) -> int | None:
    """``--block-size``: a number, or ``auto`` (None: chosen by cost, ``auto_block``)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer, got {text!r}") from None


def auto_block(args) -> bool:
    """Whether the DFlash block is left to ``--block-size auto``: no --block-size number, no --method, and no
    num_speculative_tokens in --speculative-config. ``auto`` weighs chains only (``decoding.blocksize``): a draft
    tree (``--method ddtree:N`` or method "ddtree") is kept as given."""
    spec = parse_speculative_config(args.speculative_config) if args.speculative_config else {}
    return args.block_size is None and not getattr(args, "method", None) and \
        spec.get("num_speculative_tokens") is None


def add_parser(sub) -> None:
    """Registers ``generate`` on the ``dflash-jax`` subcommands."""
    g = sub.add_parser("generate")
    g.add_argument("prompt", nargs="?", help="the prompt text; '-' reads it from stdin")
    g.add_argument("--prompts", metavar="FILE.jsonl", help='one JSON object per line with "prompt" (or "turns": '
                   "[first user turn, ...]); '-' reads them from stdin")
    g.add_argument("--model", help="target checkpoint directory (default: the shipped small target)")
    g.add_argument("--draft-model", help="DFlash drafter directory (default: the shipped drafter with the "
                   "shipped target; none with --model)")
    g.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    cli_args.add_draft_window_argument(g)
    compile_cache.add_argument(g)
    g.add_argument("--speculative-config", help='vLLM-style JSON, e.g. \'{"method": "dflash", "model": DIR, '
                   '"num_speculative_tokens": 15}\' or \'{"method": "mtp", "num_speculative_tokens": 3}\' '
                   f"(MTP default: {MTP_DEFAULT_STEPS}); method \"dflash2\" requires a DFlash2 drafter; method "
                   '"ddtree" drafts a tree of num_speculative_tokens nodes at the drafter\'s block')
    g.add_argument("--method", help="the method by name, in place of --block-size/--speculative-config: ar, mtp:K, "
                   "dflash:B, dflash2:B (dflash:B, refused unless the drafter is a DFlash2 one), or ddtree:N "
                   "(a draft tree of the N best continuations per step, depth <= 15; "
                   "ddtree:N:B for block B)")
    g.add_argument("--block-size", type=block_size_flag, default=None, metavar="{auto,N}",
                   help="tokens per verify step (1 = plain decoding; vLLM/SGLang's speculative tokens + 1); auto "
                        "(default): the block with the most expected tokens/s for this batch, from the drafter's "
                        "acceptance (its acceptance.json, or a short calibration run) and step costs measured here")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (at most)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: draw from the most likely tokens "
                   "that hold this much probability (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=cli_args.seed, default=0, help="random seed of the sampling")
    g.add_argument("--stop-ids", type=cli_args.int_list, default=[], metavar="ID[,ID...]",
                   help="token ids that end a completion, besides the target's EOS ids")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="a string that ends a completion (repeatable); the text ends before it")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the target's EOS ids")
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="wrap the prompt in the tokenizer's chat template (auto: when it has one)")
    g.add_argument("--dtype", choices=("auto", *frontend.DTYPES, "float16"), default=None,
                   help="parameter dtype; auto: the checkpoint's torch_dtype (float16 ones run in bfloat16); float16 "
                        "itself is refused: Qwen3.5's activations overflow it (default: bfloat16 on GPU/TPU, float32 "
                        "on CPU)")
    g.add_argument("--repeats", type=int, default=15, help="timed runs per method in the comparison")
    g.add_argument("--no-compare", action="store_true", help="skip the timed comparison with plain decoding")
    g.add_argument("--json", action="store_true", help="print one JSON document (completions with tokens, text, "
                   "tau, finish reason; timings) instead of streaming text")
    g.add_argument("--quiet", action="store_true", help="no loading progress bars or notes")
    cli_args.add_mesh_arguments(g)
    g.set_defaults(func=cmd_generate)
