"""``dflash-jax train ...`` subcommands: tokenizer, target, drafter and MTP head, one stage each.

Registered by ``dflash_jax/cli/__init__.py``. Each command is a thin argparse wrapper over the stage functions
(``ship.py`` chains the same functions with the shipped sizes), with every setting checked before any work.
The corpus is ``--corpus`` (a directory of text files or a JSONL of ``{"text": ...}``), else the Python standard
library's source. Drafter and MTP data are the target's greedy continuations of corpus snippets, regenerated on
the fly with the target's own tokenizer (the files next to its config.json). Each output directory is written
whole at the end (``atomic.directory_writer``, marked as this command's: ``args.check_outputs`` claimed it).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import jax.numpy as jnp

from dflash_jax.io import atomic
from dflash_jax.train import corpus, loop
from dflash_jax.train import tokenizer as tk


def _loop_args(p: argparse.ArgumentParser, *, steps: int, lr: float, batch: int) -> None:
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (warmup, then cosine decay to 10%%)")
    p.add_argument("--batch", type=int, default=batch, help="sequences per step")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="orbax checkpoints; a rerun resumes from the latest")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints (with --ckpt-dir)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order")


def _corpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", type=Path, default=None, help="training texts: a directory of text files (read "
                   'recursively) or a JSONL file of {"text": ...} objects (default: the Python standard library\'s '
                   "source)")


def _positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _tcfg(args, weight_decay: float = 0.0) -> loop.TrainConfig:
    _positive(args, "batch")
    try:
        return loop.TrainConfig(steps=args.steps, lr=args.lr, weight_decay=weight_decay,
                                ckpt_every=args.ckpt_every if args.ckpt_dir else 0)
    except ValueError as e:
        flags = {"steps": "--steps", "learning rate": "--lr", "ckpt_every": "--ckpt-every"}
        raise ValueError(f"{e} ({', '.join(f for k, f in flags.items() if k in str(e)) or 'a training flag'})") \
            from None


def _texts(args) -> list[str]:
    if args.corpus is None:
        return list(corpus.read_texts(corpus.stdlib_files("train")))
    return corpus.user_texts(args.corpus, "--corpus")


def _stream(args, tok, length: int):
    """The corpus as one token stream, long enough for windows of ``length`` tokens."""
    stream = corpus.text_stream(tok, _texts(args), tok.token_to_id(tk.EOS))
    if len(stream) <= length:
        where = f"--corpus {args.corpus}" if args.corpus else "the standard-library corpus"
        raise ValueError(f"{where} holds {len(stream)} tokens, too few for windows of {length} tokens")
    return stream


@contextlib.contextmanager
def _output(args, *inputs):
    """The output directory, written whole when the block ends (an interrupted run keeps what was there)."""
    with atomic.directory_writer(args.out, writer=f"dflash-jax {args.command}", overwrite=args.overwrite,
                                 sources=[p for p in inputs if p is not None], flag="--out") as tmp:
        yield tmp


def _check_data(args) -> None:
    _positive(args, "data_seqs", "prompt_len", "gen_batch")
    if args.seq <= args.prompt_len:
        raise ValueError(f"--seq {args.seq} must exceed --prompt-len {args.prompt_len}: the target continues each "
                         f"snippet by seq - prompt-len tokens, the training data")


def _regenerated(args, target):
    tok = tk.load(args.target, "--target")
    prompts = corpus.eval_windows(_stream(args, tok, args.prompt_len), args.prompt_len, args.data_seqs)
    from dflash_jax.train.drafter import regenerate
    return regenerate(target, prompts, args.seq - args.prompt_len, batch=args.gen_batch), tok


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, required=True, help="target directory (with its tokenizer files)")
    _corpus_arg(p)
    p.add_argument("--data-seqs", type=int, default=256, help="target-regenerated sequences")
    p.add_argument("--prompt-len", type=int, default=64, help="corpus snippet length the target continues")
    p.add_argument("--seq", type=int, default=256, help="prompt + continuation length")
    p.add_argument("--gen-batch", type=int, default=128, help="sequences the target continues at once")


def cmd_tokenizer(args) -> None:
    if args.vocab < tk.MIN_VOCAB:
        raise ValueError(f"--vocab {args.vocab}: must be at least {tk.MIN_VOCAB} (256 bytes and the special tokens)")
    tok = tk.train_tokenizer([], args.vocab, texts=_texts(args))
    with _output(args) as tmp:
        tk.save_hf(tok, tmp)
    print(f"tokenizer with {tok.get_vocab_size()} tokens -> {args.out}")


def cmd_target(args) -> None:
    from dflash_jax.train import lm
    tcfg = _tcfg(args, 0.01)
    _positive(args, "layers", "hidden", "intermediate")
    if args.seq < 2:
        raise ValueError(f"--seq must be >= 2 (next-token prediction needs two tokens), got {args.seq}")
    tok = tk.load(args.tokenizer, "--tokenizer")
    eos = tok.token_to_id(tk.EOS)
    cfg = lm.small_config(vocab_size=tok.get_vocab_size(), eos_id=eos, layers=args.layers, hidden=args.hidden,
                          intermediate=args.intermediate)
    batches = corpus.windows(_stream(args, tok, args.seq), args.seq, args.batch, seed=args.seed + 1)
    target, res = lm.train_target(cfg, batches, tcfg, seed=args.seed, ckpt_dir=args.ckpt_dir)
    with _output(args, args.tokenizer) as tmp:
        lm.save_target(tmp, target)
        tk.save_hf(tok, tmp)
    print(f"target ({lm.param_count(target.params)} params, loss {res.history[-1]['loss']:.4f}) -> {args.out}")


def default_taps(num_layers: int) -> tuple[int, ...]:
    """The shipped drafter's recipe (``ship.Sizes.drafter_taps``, layers 1, 4, 7 of its target's 8) for a target
    of ``num_layers``: as many taps, spread from layer 1 to the last layer."""
    from dflash_jax.train.ship import Sizes

    shipped = Sizes().drafter_taps
    if num_layers == (Sizes().grow_layers or Sizes().layers):
        return shipped
    n = min(len(shipped), num_layers)
    return tuple(sorted({round(1 + i * (num_layers - 2) / max(n - 1, 1)) if num_layers > 1 else 0
                         for i in range(n)}))


def _taps(text: str | None, num_layers: int) -> tuple[int, ...]:
    if text is None:
        return default_taps(num_layers)
    try:
        taps = tuple(int(i) for i in text.split(","))
    except ValueError:
        raise ValueError(f"--taps {text!r}: expected comma-separated layer ids, e.g. 1,2,3") from None
    bad = [i for i in taps if not 0 <= i < num_layers]
    if bad or not taps or len(set(taps)) != len(taps):
        raise ValueError(f"--taps {text!r}: expected distinct layer ids in 0..{num_layers - 1} (the target's layers)")
    return taps


def cmd_drafter(args) -> None:
    from dflash_jax.config import TargetConfig
    from dflash_jax.models.drafter import save_drafter
    from dflash_jax.models.target import load_target
    from dflash_jax.train import drafter as dt
    tcfg = _tcfg(args)
    _check_data(args)
    _positive(args, "layers")
    dt.check_data(args.seq, args.prompt_len, args.block_size, args.anchors)
    taps = _taps(args.taps, TargetConfig.from_pretrained(args.target).num_hidden_layers)
    target = load_target(args.target, jnp.float32, mtp=False)
    seqs, tok = _regenerated(args, target)
    cfg = dt.drafter_config(target.cfg, num_layers=args.layers, taps=taps, mask_token_id=tok.token_to_id(tk.MASK),
                            block_size=args.block_size, arch=args.arch)
    drafter, res = dt.train_drafter(target, cfg, seqs, args.prompt_len, tcfg, anchors=args.anchors,
                                    batch=args.batch, seed=args.seed, ckpt_dir=args.ckpt_dir)
    with _output(args, args.target) as tmp:
        save_drafter(tmp, drafter)
    print(f"drafter (taps {list(taps)}, loss {res.history[-1]['loss']:.4f}) -> {args.out}")


def cmd_mtp(args) -> None:
    from dflash_jax.models.target import load_target
    from dflash_jax.train import lm
    from dflash_jax.train import mtp as mt
    tcfg = _tcfg(args)
    _check_data(args)
    if args.seq - args.prompt_len < 2:
        raise ValueError(f"--seq {args.seq} leaves {args.seq - args.prompt_len} generated tokens after --prompt-len "
                         f"{args.prompt_len}; the MTP head needs at least 2 (it predicts the token after next)")
    mt.check_data(args.seq, args.prompt_len, args.unroll, args.anchors)
    target = load_target(args.target, jnp.float32, mtp=False)
    seqs, tok = _regenerated(args, target)
    with_mtp, res = mt.train_mtp(target, seqs, args.prompt_len, tcfg, batch=args.batch, seed=args.seed,
                                 unroll=args.unroll, anchors=args.anchors, ckpt_dir=args.ckpt_dir)
    with _output(args, args.target) as tmp:
        lm.save_target(tmp, with_mtp)
        tk.save_hf(tok, tmp)
    print(f"target with MTP head (loss {res.history[-1]['loss']:.4f}) -> {args.out}")


def add_parser(sub) -> None:
    """Registers ``train tokenizer``, ``train target``, ``train drafter`` and ``train mtp`` on the ``train``
    group's subcommands."""
    p = sub.add_parser("tokenizer")
    p.add_argument("--out", type=Path, required=True, help="tokenizer directory to write (Hugging Face files)")
    _corpus_arg(p)
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (bytes, special tokens and merges)")
    p.set_defaults(func=cmd_tokenizer)

    p = sub.add_parser("target")
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory (train tokenizer's --out)")
    p.add_argument("--out", type=Path, required=True, help="target checkpoint directory to write")
    _corpus_arg(p)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th is full attention)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--intermediate", type=int, default=512, help="MLP width")
    p.add_argument("--seq", type=int, default=256, help="training window in tokens")
    _loop_args(p, steps=120, lr=3e-3, batch=8)
    p.set_defaults(func=cmd_target)

    p = sub.add_parser("drafter")
    _data_args(p)
    p.add_argument("--out", type=Path, required=True, help="drafter checkpoint directory to write")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    p.add_argument("--taps", default=None, help="comma-separated target layer ids whose outputs feed the drafter "
                   "(default: the shipped recipe, 1,2,3 on a 4-layer target: that many spread from layer 1 to the "
                   "last, whose tap is the final-normed state)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per drafted block (anchor + drafts), >= 2")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    p.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash",
                   help="dflash2: add DFlash2's dynamic convolutions and candidate selector (z-lab's "
                        "DFlash2DraftModel layout; conv kernel 2, groups of 16, selector rank 256, top-16)")
    _loop_args(p, steps=180, lr=2e-3, batch=8)
    p.set_defaults(func=cmd_drafter)

    p = sub.add_parser("mtp")
    _data_args(p)
    p.add_argument("--out", type=Path, required=True, help="target directory written with its mtp.* head")
    p.add_argument("--unroll", type=int, default=7, help="steps the head is trained over, fed its own output from "
                   "step 2 on, as it drafts (the shipped recipe: 7)")
    p.add_argument("--anchors", type=int, default=16, help="chains per sequence per step for steps >= 2")
    _loop_args(p, steps=100, lr=2e-3, batch=8)
    p.set_defaults(func=cmd_mtp)
