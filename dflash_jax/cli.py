"""The ``dflash-jax`` command line: ``generate`` (the main job) and the training stages.

Top of the data flow: it loads a target and a proposer, streams a completion through
``generate.stream`` and then times speculative decoding against plain decoding with the on-device
loop (``generate.generate``), both compiled before timing. With no flags it runs the small models
shipped in ``dflash_jax/assets`` on whatever JAX backend is present.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax.checkpoint import CheckpointError
from dflash_jax.config import ConfigError
from dflash_jax.sampling import SamplingConfig
from dflash_jax.speculative import GenerateOutput, generate, stream

ASSETS = resources.files("dflash_jax") / "assets"
METHODS = ("dflash", "mtp")


@dataclasses.dataclass(frozen=True)
class Speculation:
    """What drafts: ``method`` "dflash" (a drafter directory) or "mtp" (the target's own head), or None."""

    method: str | None
    model: str | None
    num_speculative_tokens: int | None


def parse_speculation(args) -> Speculation:
    """Merges ``--speculative-config`` (vLLM's JSON) with ``--draft-model``/``--block-size``."""
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        method = spec.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: unknown method {method!r}; expected one of {METHODS}")
        if method == "dflash" and not spec.get("model"):
            raise ValueError('--speculative-config: method "dflash" needs "model": the drafter directory')
        return Speculation(method, spec.get("model"), spec.get("num_speculative_tokens"))
    if args.block_size == 1:
        return Speculation(None, None, None)
    draft = args.draft_model or (str(ASSETS / "drafter") if args.model is None else None)
    if draft is None:
        return Speculation(None, None, None)
    return Speculation("dflash", draft, None if args.block_size is None else args.block_size - 1)


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: no usable tokenizer ({e})") from None


def _encode(tokenizer, prompt: str, chat: str) -> list[int]:
    use_chat = chat == "on" or (chat == "auto" and getattr(tokenizer, "chat_template", None))
    if use_chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True))
    return tokenizer.encode(prompt)


def _timed(fn) -> tuple[GenerateOutput, float]:
    fn()  # compile (and warm up) first: the timing is of decoding alone
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out.tokens)
    return out, time.perf_counter() - start


def cmd_generate(args) -> int:
    from dflash_jax.drafter import load_drafter
    from dflash_jax.target import load_target

    model_dir = Path(args.model) if args.model else Path(str(ASSETS / "target"))
    spec = parse_speculation(args)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    target = load_target(model_dir, dtype=dtype, progress=not args.quiet, mtp=spec.method == "mtp" or None)
    tokenizer = _load_tokenizer(model_dir)
    prompt = _encode(tokenizer, args.prompt, args.chat_template)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    kw = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, rng=args.seed)
    if spec.method == "dflash":
        drafter = load_drafter(spec.model, target, progress=not args.quiet)
        block = drafter.cfg.block_size if spec.num_speculative_tokens is None else spec.num_speculative_tokens + 1
        kw.update(drafter=drafter, block_size=block)
    elif spec.method == "mtp":
        from dflash_jax.mtp import MTPProposer

        if target.module().mtp is None:
            raise ConfigError(f"{model_dir}: the checkpoint has no mtp.* weights, so method 'mtp' cannot draft")
        block = 1 + (spec.num_speculative_tokens or 3)
        kw.update(drafter=(MTPProposer(target.cfg, block - 1), target.params), block_size=block)
    else:
        block = 1

    print(args.prompt, end="", flush=True)
    it = stream(target, [prompt], **kw)
    shown: list[int] = []
    text_so_far = ""
    try:
        while True:
            shown += next(it)[0]
            text = tokenizer.decode(shown, skip_special_tokens=True)
            print(text[len(text_so_far):], end="", flush=True)
            text_so_far = text
    except StopIteration as done:
        out = done.value
    print()
    tau = float(out.tau[0])
    summary = f"[{len(shown)} tokens, block {block}, tau {tau:.2f}"
    if not args.no_compare:
        spec_out, t_spec = _timed(lambda: generate(target, [prompt], **kw))
        kw_ar = {k: v for k, v in kw.items() if k not in ("drafter", "block_size")}
        ar_out, t_ar = _timed(lambda: generate(target, [prompt], **kw_ar))
        n_spec, n_ar = int(spec_out.lengths[0]), int(ar_out.lengths[0])
        summary += (f", {n_spec / t_spec:.1f} tok/s vs {n_ar / t_ar:.1f} tok/s plain decoding: "
                    f"speed-up {(n_spec / t_spec) / (n_ar / t_ar):.2f}x on {jax.default_backend()}")
        if sampling.greedy and spec_out.texts() != ar_out.texts():
            summary += " (WARNING: greedy output differs from plain decoding)"
    print(summary + "]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-jax", description="DFlash speculative decoding in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion, then compare with plain decoding")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--model", help="target checkpoint directory (default: the shipped small target)")
    g.add_argument("--draft-model", help="DFlash drafter directory (default: the shipped drafter with the "
                   "shipped target; none with --model)")
    g.add_argument("--speculative-config", help='vLLM-style JSON, e.g. \'{"method": "dflash", "model": DIR, '
                   '"num_speculative_tokens": 15}\' or \'{"method": "mtp", "num_speculative_tokens": 3}\'')
    g.add_argument("--block-size", type=int, help="tokens per verify step (1 = plain decoding); default: the "
                   "drafter's block size")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat-template", choices=("auto", "on", "off"), default="auto",
                   help="wrap the prompt in the tokenizer's chat template (auto: when it has one)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    g.add_argument("--no-compare", action="store_true", help="skip the plain-decoding baseline")
    g.add_argument("--quiet", action="store_true", help="no loading progress bars")
    g.set_defaults(func=cmd_generate)
    from dflash_jax.bench import add_parser as add_bench

    add_bench(sub)
    try:
        from dflash_jax.train.cli import add_commands
    except ImportError:  # the training extras are optional at run time
        pass
    else:
        add_commands(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"dflash-jax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
