"""``dflash-jax train-*`` subcommands: tokenizer, target, drafter and MTP head, one stage each.

Registered by the top-level ``dflash_jax/cli/generate.py`` through ``add_commands(subparsers)``. Each command
is a thin argparse wrapper over the stage functions (``ship.py`` chains the same functions with the
shipped sizes). Drafter and MTP data are the target's greedy continuations of corpus snippets,
regenerated on the fly with the target's own tokenizer (the files next to its config.json).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp

from dflash_jax.train import corpus, loop
from dflash_jax.train import tokenizer as tk


def _loop_args(p: argparse.ArgumentParser, *, steps: int, lr: float, batch: int) -> None:
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="orbax checkpoints; a rerun resumes from the latest")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)


def _tcfg(args, weight_decay: float = 0.0) -> loop.TrainConfig:
    return loop.TrainConfig(steps=args.steps, lr=args.lr, weight_decay=weight_decay,
                            ckpt_every=args.ckpt_every if args.ckpt_dir else 0)


def _regenerated(args, target):
    tok = tk.load(args.target)
    stream = corpus.token_stream(tok, corpus.stdlib_files("train"), tok.token_to_id(tk.EOS))
    prompts = corpus.eval_windows(stream, args.prompt_len, args.data_seqs)
    from dflash_jax.train.drafter import regenerate
    return regenerate(target, prompts, args.seq - args.prompt_len, batch=args.gen_batch), tok


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, required=True, help="target directory (with its tokenizer files)")
    p.add_argument("--data-seqs", type=int, default=256, help="target-regenerated sequences")
    p.add_argument("--prompt-len", type=int, default=64, help="corpus snippet length the target continues")
    p.add_argument("--seq", type=int, default=256, help="prompt + continuation length")
    p.add_argument("--gen-batch", type=int, default=128)


def cmd_tokenizer(args) -> None:
    tok = tk.train_tokenizer(corpus.stdlib_files("train"), args.vocab)
    tk.save_hf(tok, args.out)
    print(f"tokenizer with {tok.get_vocab_size()} tokens -> {args.out}")


def cmd_target(args) -> None:
    from dflash_jax.train import lm
    tok = tk.load(args.tokenizer)
    eos = tok.token_to_id(tk.EOS)
    cfg = lm.small_config(vocab_size=tok.get_vocab_size(), eos_id=eos, layers=args.layers, hidden=args.hidden,
                          intermediate=args.intermediate)
    batches = corpus.windows(corpus.token_stream(tok, corpus.stdlib_files("train"), eos), args.seq, args.batch,
                             seed=args.seed + 1)
    target, res = lm.train_target(cfg, batches, _tcfg(args, 0.01), seed=args.seed, ckpt_dir=args.ckpt_dir)
    lm.save_target(args.out, target)
    tk.save_hf(tok, args.out)
    print(f"target ({lm.param_count(target.params)} params, loss {res.history[-1]['loss']:.4f}) -> {args.out}")


def cmd_drafter(args) -> None:
    from dflash_jax.models.drafter import save_drafter
    from dflash_jax.models.target import load_target
    from dflash_jax.train import drafter as dt
    target = load_target(args.target, jnp.float32, mtp=False)
    seqs, tok = _regenerated(args, target)
    taps = tuple(int(i) for i in args.taps.split(","))
    cfg = dt.drafter_config(target.cfg, num_layers=args.layers, taps=taps, mask_token_id=tok.token_to_id(tk.MASK),
                            block_size=args.block_size)
    drafter, res = dt.train_drafter(target, cfg, seqs, args.prompt_len, _tcfg(args), anchors=args.anchors,
                                    batch=args.batch, seed=args.seed, ckpt_dir=args.ckpt_dir)
    save_drafter(args.out, drafter)
    print(f"drafter (loss {res.history[-1]['loss']:.4f}) -> {args.out}")


def cmd_mtp(args) -> None:
    from dflash_jax.models.target import load_target
    from dflash_jax.train import lm
    from dflash_jax.train import mtp as mt
    target = load_target(args.target, jnp.float32, mtp=False)
    seqs, tok = _regenerated(args, target)
    with_mtp, res = mt.train_mtp(target, seqs, args.prompt_len, _tcfg(args), batch=args.batch, seed=args.seed,
                                 ckpt_dir=args.ckpt_dir)
    lm.save_target(args.out, with_mtp)
    tk.save_hf(tok, args.out)
    print(f"target with MTP head (loss {res.history[-1]['loss']:.4f}) -> {args.out}")


def add_parser(sub) -> None:
    """Registers train-tokenizer, train-target, train-drafter and train-mtp on an argparse subparsers object."""
    p = sub.add_parser("train-tokenizer", help="byte-level BPE on the stdlib corpus (HF tokenizer dir)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", type=int, default=4096)
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("train-target", help="pretrain a small Qwen3.5 target on the stdlib corpus")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    _loop_args(p, steps=120, lr=3e-3, batch=8)
    p.set_defaults(func=cmd_target)

    p = sub.add_parser("train-drafter", help="train a DFlash drafter on a frozen target (the DFlash paper's recipe)")
    _data_args(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--taps", default="0,1,2", help="target layer ids whose outputs feed the drafter")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    _loop_args(p, steps=180, lr=2e-3, batch=8)
    p.set_defaults(func=cmd_drafter)

    p = sub.add_parser("train-mtp", help="train the target's MTP head on the frozen target")
    _data_args(p)
    p.add_argument("--out", type=Path, required=True, help="target directory written with its mtp.* head")
    _loop_args(p, steps=100, lr=2e-3, batch=8)
    p.set_defaults(func=cmd_mtp)
