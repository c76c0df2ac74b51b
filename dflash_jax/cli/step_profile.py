"""``dflash-jax report step-profile``: where a decoding step's time goes on the CPU, per JAX scope, from XLA:CPU's
per-op trace of one ``SpeculativeLoop.decode`` of the shipped models (``dflash_jax.perf.step_profile``)."""

from __future__ import annotations

import json
import os

import jax

from dflash_jax import frontend
from dflash_jax.decoding.api import bucket_for, pad_prompts
from dflash_jax.decoding.loop import SpecConfig
from dflash_jax.decoding.workloads import load_turns
from dflash_jax.io import atomic
from dflash_jax.perf import bench, step_profile


def cmd_step_profile(args) -> int:
    if step_profile.TRACE_FLAG not in os.environ.get("XLA_FLAGS", ""):  # read when the backend starts: not yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {step_profile.TRACE_FLAG}".strip()
    method = frontend.parse_method(args.method, "--method")
    target_dir, draft_dir = frontend.model_dirs(None, None)
    target, drafter = frontend.load_models(target_dir, draft_dir, [method], dtype="float32", progress=False)
    proposer, pparams = frontend.proposer_for(method, target, drafter)
    spec = SpecConfig(block_size=method.block, max_new_tokens=args.max_new_tokens, stop_ids=())
    loop, params = bench.method_loop(target, proposer, pparams, spec)
    tokenizer = frontend.load_tokenizer(target_dir)
    chat = "always" if args.prompt_format == "chat" else "never"
    prompt = frontend.encode(tokenizer, load_turns(args.workload, None, 1, args.prompt_format)[0], chat)
    tokens, lengths = pad_prompts([prompt], bucket_for(len(prompt)))
    rng = jax.random.key(0)

    p = step_profile.trace_decode(loop, params, tokens, lengths, rng)
    print(step_profile.format_profile(p, args.top))
    print(step_profile.untraced(loop, params, tokens, lengths, rng, method, target, drafter,
                                bench.mean_context([prompt], args.max_new_tokens)))
    if args.json:
        atomic.write_text(args.json, json.dumps({"steps": p.steps, "ops": p.ops}, indent=1))
        print(f"wrote {args.json}")
    return 0


def add_parser(sub) -> None:
    """Registers ``report step-profile`` on the ``dflash-jax report`` commands."""
    p = sub.add_parser("step-profile", description=step_profile.__doc__.split("\n")[0])
    p.add_argument("--method", default="dflash:16", help="ar, dflash:B or mtp:K")
    p.add_argument("--workload", default="humaneval", help="the workload whose first prompt is decoded")
    p.add_argument("--prompt-format", default="raw", choices=("raw", "chat"),
                   help="raw: the data set's text alone; chat: in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded")
    p.add_argument("--top", type=int, default=15, help="slowest ops to list")
    p.add_argument("--json", metavar="OUT", help="write every op's row here")
    p.set_defaults(func=cmd_step_profile)


if __name__ == "__main__":
    from dflash_jax.cli import script

    script(__spec__.name)
