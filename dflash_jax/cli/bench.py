"""``dflash-jax bench``: tau, tokens/s and speed-up of plain, MTP and DFlash decoding on the report's workloads.

A thin front end over ``dflash_jax.perf.bench``: it checks the flags, loads the models (or random-weight ones
from config files) and the workload's prompts, and writes bench.json and the plots. ``dflash:auto`` (in the
default methods) is the block ``--block-size auto`` picks per concurrency (``perf.step_cost.choose``);
``hf:ar`` and ``zlab:B`` are the peers on the same weights (``perf.peers``: PyTorch, optional).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_jax import frontend, parallel
from dflash_jax.cli import args as cli_args
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.decoding.workloads import WORKLOADS, load_turns
from dflash_jax.io import atomic, compile_cache
from dflash_jax.perf import peers, step_cost
from dflash_jax.perf.bench import (
    AUTO,
    TIMING,
    _batches,
    _machine,
    bench_workload,
    busy_note,
    format_goals,
    format_table,
    parse_methods,
    plot,
    random_models,
    random_prompts,
)


def cmd_bench(args) -> int:
    from tqdm.auto import tqdm

    methods = parse_methods(args.methods)
    peer_list = [m for m in methods if isinstance(m, peers.Peer)]
    peers.require(peer_list)  # torch before JAX compiles anything
    mesh = cli_args.mesh_from_args(args)  # joins the other processes; only process 0 prints and writes
    compile_cache.enable(args.compilation_cache_dir)  # before anything compiles: a rerun loads the programs
    if peer_list and args.random_config:
        raise ValueError(f"{', '.join(p.name for p in peer_list)} load the checkpoints: not with --random-config")
    if AUTO in methods and args.simulate_acceptance:
        raise ValueError(f"{AUTO} chooses from the drafter's real acceptance: not with --simulate-acceptance")
    trees = [m.name for m in methods if getattr(m, "tree", None) is not None]
    if trees and args.simulate_acceptance:
        raise ValueError(f"{', '.join(trees)}: a draft tree is grown from the drafter's distributions; "
                         "--simulate-acceptance replays chains only")
    # what the models are loaded for: the loop's methods, and a DFlash one for auto (its drafter)
    needed = [m for m in methods if isinstance(m, frontend.Method)] + ([frontend.Method("dflash", 2)]
                                                                      if AUTO in methods else [])
    workloads = [w.strip() for w in args.workload.split(",")]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workload: unknown {unknown}; expected some of {WORKLOADS}")
    if args.prompts and len(workloads) != 1:
        raise ValueError("--prompts gives the prompts of one workload: name exactly one --workload")
    for flag in ("num_prompts", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if min(args.concurrency) < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.profile_batches < 0:
        raise ValueError(f"--profile-batches must be >= 0, got {args.profile_batches}")
    if args.simulate_acceptance and args.temperature != 0:
        raise ValueError("--simulate-acceptance replays the greedy output: it needs --temperature 0")
    if args.random_prompt_len < 1:
        raise ValueError(f"--random-prompt-len must be >= 1, got {args.random_prompt_len}")
    args.dtype = args.dtype or frontend.default_dtype()
    out = Path(args.out)  # args.check_outputs proved it writable before any work
    if args.random_config:
        workloads = ["random"]
        target, drafter, model_dir, draft_dir = random_models(args, needed)
        drafters = {m: drafter for m in needed if m.kind == "dflash"}
        folders = {m: draft_dir for m in drafters}
        encoded = {"random": random_prompts(args.num_prompts, args.random_prompt_len, target.cfg.vocab_size,
                                            args.seed)}
        how = f"random token ids ({args.random_prompt_len} per prompt)"
    else:
        turns = {w: load_turns(w, args.prompts, args.num_prompts, args.prompt_format) for w in workloads}
        if args.prompts:  # the rows are the file's prompts: labelled by the file, not by --workload
            workloads = ["stdin" if args.prompts == "-" else Path(args.prompts).name]
            turns = {workloads[0]: next(iter(turns.values()))}
        model_dir, _ = frontend.model_dirs(args.model, None)
        folders = frontend.draft_dirs(needed, args.model, args.draft_model)  # each method its own default drafter
        target, drafters = frontend.load_target_and_drafters(
            model_dir, folders, needed, dtype=frontend.DTYPES[args.dtype], progress=not args.quiet, mesh=mesh,
            draft_window=getattr(args, "draft_window", None))
    if AUTO in methods:  # auto weighs DFlash chains: the stand-in's drafter
        drafters[AUTO], folders[AUTO] = drafters[needed[-1]], folders[needed[-1]]
    # the DFlash (not DFlash2) drafter, for the peers and the report: the first one asked for
    draft_dir = next((f for m, f in folders.items() if f is not None and not getattr(m, "dflash2", False)),
                     next(iter(folders.values()), None))
    notes = []
    mtp = [m for m in needed if m.kind == "mtp"]
    if mtp and not frontend.has_mtp(target):
        notes.append(f"skipped {', '.join(m.name for m in mtp)}: {model_dir} has no MTP head (mtp.* weights)")
        methods = [m for m in methods if m not in mtp]
    peer_models = peers.Models(model_dir, draft_dir, peer_list, args.dtype) if peer_list else None
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    key = (str(model_dir), str(folders.get(AUTO)), args.dtype)

    def choose(prompts, batch):
        return step_cost.choose(target, drafters[AUTO], prompts, batch=batch, key=key, draft_dir=folders[AUTO],
                                max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, mesh=mesh)[0]
    for note in notes:
        print(f"dflash-jax bench: {note}", file=sys.stderr)
    if not args.random_config:
        tokenizer = frontend.load_tokenizer(args.tokenizer or model_dir,
                                           "--tokenizer" if args.tokenizer else "--model")
        encoded = {w: [frontend.encode(tokenizer, t, args.chat_template, args.enable_thinking) for t in turns[w]]
                   for w in workloads}
        how = frontend.encoding_name(tokenizer, args.chat_template, args.enable_thinking)
    units = sum(args.repeats * len(methods) * len(_batches(len(encoded[w]), c)) for w in workloads
                for c in args.concurrency)
    results = []
    with tqdm(total=units, desc="bench", unit="run", disable=args.quiet, file=sys.stderr) as progress:
        for w in workloads:
            results += bench_workload(w, encoded[w], methods, target, drafters, args, progress, mesh, choose=choose,
                                      peer_models=peer_models)
    print(format_table(results))
    goals = format_goals(results)
    if goals:
        print(goals)
    busy = busy_note()
    if busy:
        notes.append(busy)
        print(f"dflash-jax bench: {busy}", file=sys.stderr)
    greedy = [r for r in results if r["matches_ar"] is not None]
    if greedy:
        bad = [f"{r['workload']}/c{r['concurrency']}/{r['method']}" for r in greedy if not r["matches_ar"]]
        print("greedy check: every method's text equals ar's" if not bad else
              f"greedy check: texts DIFFER from ar's for {', '.join(bad)}")
    report = dict(
        args={k: v for k, v in vars(args).items() if k != "func"}, machine=_machine(),
        models=dict(target=str(model_dir.resolve()), drafter=str(draft_dir.resolve()) if draft_dir else None,
                    drafters={m.name: str(Path(f).resolve()) for m, f in folders.items() if m != AUTO},
                    tokenizer=None if args.random_config else str(args.tokenizer or model_dir), dtype=args.dtype,
                    random_weights=bool(args.random_config)),
        settings=dict(workloads=workloads, methods=[m if m == AUTO else m.name for m in methods],
                      concurrency=args.concurrency,
                      num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      ignore_eos=args.ignore_eos, prompts_file=args.prompts, prompt_format=args.prompt_format,
                      chat_template=args.chat_template, enable_thinking=args.enable_thinking, encoding=how,
                      simulate_acceptance=args.simulate_acceptance, profile_batches=args.profile_batches),
        timing=TIMING, notes=notes, results=results, plots=[])
    if not parallel.is_writer():
        return 0
    atomic.write_text(out / "bench.json", json.dumps(report, indent=1))  # the numbers are safe before any plotting
    print(f"wrote {out / 'bench.json'}")
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("dflash-jax bench: no plots (matplotlib is not installed: pip install matplotlib)", file=sys.stderr)
        else:
            report["plots"] = plot(results, out)
            atomic.write_text(out / "bench.json", json.dumps(report, indent=1))
            print("wrote " + ", ".join(str(out / p) for p in report["plots"]))
    return 0


def add_parser(sub) -> None:
    """Registers ``bench`` on the ``dflash-jax`` subcommands."""
    b = sub.add_parser("bench")
    b.add_argument("--workload", default="humaneval", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    b.add_argument("--methods", default=f"ar,mtp:3,mtp:7,mtp:15,dflash:4,dflash:8,dflash:16,{AUTO}",
                   help="comma-separated ar, mtp:K (K drafts, block K+1), dflash:B (block B; dflash2:B "
                        "the same, refused unless the drafter is a DFlash2 one), dflash:auto (the "
                        "block --block-size auto picks per concurrency: expected tokens/s from the drafter's "
                        "acceptance and the step cost measured here), and the peers on the same weights hf:ar "
                        "(transformers' generate) and zlab:B (z-lab's dflash package, pip install --no-deps "
                        "dflash==0.1.0); ar is always run")
    b.add_argument("--prompts", help='JSONL for the one --workload, as generate reads it: {"prompt": "..."} or '
                   '{"turns": [...]} (z-lab format, the first turn) per line')
    b.add_argument("--prompt-format", choices=("zlab", "raw"), default="zlab",
                   help="zlab: z-lab's instruction wrappers; raw: the data set's text alone (completion models)")
    b.add_argument("--num-prompts", type=int, default=8, help="prompts taken from each workload")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (at most)")
    b.add_argument("--concurrency", type=cli_args.ints, default=[1], help="rows per generate call, e.g. 1,32")
    b.add_argument("--repeats", type=int, default=3, help="timed passes over all batches; figures are medians")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (1 = off)")
    b.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    b.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    b.add_argument("--ignore-eos", action="store_true", help="always emit max_new_tokens (no stop ids)")
    b.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    b.add_argument("--enable-thinking", action="store_true", help="chat template thinking mode (default off)")
    b.add_argument("--simulate-acceptance", type=cli_args.ints, metavar="A[,A...]",
                   help="drafts accepted per step, cycled (replays ar's output with an error at offset A; "
                        "the real proposer still runs): isolates kernel/loop cost from drafter quality")
    b.add_argument("--profile-batches", type=int, default=1,
                   help="batches whose steps are split into draft/verify/commit (0: none)")
    b.add_argument("--model", help="target checkpoint directory (default: the shipped small target)")
    b.add_argument("--draft-model", help="DFlash drafter directory (default: the shipped drafter with the "
                   "shipped target)")
    cli_args.add_draft_window_argument(b)
    compile_cache.add_argument(b)
    b.add_argument("--random-config", metavar="TARGET_CONFIG[,DRAFTER_CONFIG]",
                   help="random-weight target (and drafter) from config.json files alone, made on the device; "
                        "prompts are random token ids (pair with --simulate-acceptance to fix tau)")
    b.add_argument("--random-prompt-len", type=int, default=64, help="tokens per prompt with --random-config")
    b.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    b.add_argument("--dtype", choices=tuple(frontend.DTYPES), default=None,
                   help="parameter dtype (default: bfloat16 on GPU/TPU, float32 on CPU)")
    b.add_argument("--out", default="bench_out", help="directory for bench.json and the plots")
    b.add_argument("--no-plots", action="store_true", help="write bench.json only")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    cli_args.add_mesh_arguments(b)
    b.set_defaults(func=cmd_bench)
