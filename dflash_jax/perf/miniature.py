"""Servable miniatures: ``regime``'s bandwidth-bound random-weight pairs as checkpoint directories whose drafter's
drafts are accepted at a set rate, for measuring a server end to end (``dflash-jax serve --model DIR/target
--draft-model DIR/drafter``, driven by a real client).

Where it sits: in the measurement layer beside ``regime.py`` (whose ``MINIATURES`` shapes it takes) and
``serve_load.py``. Random weights alone accept no drafts, so the pair is given one rule both models follow up to
noise: every token's embedding shares a direction u (``share`` x the rows' own norm), and the LM head's row of
token ``token`` is ``margin`` x u, so both models emit ``token`` unless their random layers' contribution to the
final hidden state, which differs from position to position, outweighs it. ``margin`` sets how often the target
deviates and so the acceptance (``dflash-jax bench`` or the server's /stats report it; ``docs/serving.md`` gives
the values used). Vocabulary and tokenizer are the shipped target's, so any text prompt encodes and every
output decodes. The checkpoints are written in float32, as ``regime`` times them on a CPU.
``dflash-jax report miniature`` is its front end.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import frontend
from dflash_jax.perf import regime, synthetic

TOKEN = 300  # the token both models favour (a word piece of the shipped tokenizer)
SHARE = 4.0  # the shared direction's norm over an embedding row's own
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def pair(name: str, *, margin: float, token: int = TOKEN, share: float = SHARE, seed: int = 0):
    """(target, drafter) of ``regime.MINIATURES[name]``'s shapes at the shipped tokenizer's vocabulary, with the
    shared rule above (random weights otherwise)."""
    if name not in regime.MINIATURES:
        raise ValueError(f"miniature {name!r}: one of {', '.join(regime.MINIATURES)}")
    target_cfg, drafter_cfg = regime.MINIATURES[name]
    vocab = synthetic.target_config(frontend.ASSETS / "target").vocab_size
    if not 0 <= token < vocab:
        raise ValueError(f"token {token} is outside the shipped vocabulary of {vocab}")
    target = synthetic.random_target(dict(target_cfg, vocab_size=vocab), dtype=jnp.float32, seed=seed)
    params = jax.tree.map(lambda x: x, target.params)  # a new tree: the leaves are replaced, not mutated
    embed, head = params["model"]["embed_tokens"]["weight"], params["lm_head"]["weight"]
    u = jax.random.normal(jax.random.key(seed + 7), (target.cfg.hidden_size,), jnp.float32)
    u = u / jnp.linalg.norm(u)
    row = jnp.linalg.norm(embed.value, axis=-1).mean()
    embed.value = embed.value + share * row * u
    head.value = head.value.at[token].set(margin * u)
    target = dataclasses.replace(target, params=params)
    drafter = synthetic.random_drafter(dict(drafter_cfg, vocab_size=vocab), target, seed=seed + 1)
    return target, drafter


def write(out: str | Path, name: str, *, margin: float, token: int = TOKEN, share: float = SHARE,
          seed: int = 0) -> tuple[Path, Path]:
    """Writes ``pair(...)`` as ``out/target`` (with the shipped tokenizer) and ``out/drafter``; returns the two."""
    from dflash_jax.models.drafter import save_drafter
    from dflash_jax.train.lm import save_target

    target, drafter = pair(name, margin=margin, token=token, share=share, seed=seed)
    out = Path(out)
    save_target(out / "target", target)
    for file in TOKENIZER_FILES:
        shutil.copy(frontend.ASSETS / "target" / file, out / "target" / file)
    save_drafter(out / "drafter", drafter)
    return out / "target", out / "drafter"


def acceptance(target, drafter, *, block: int = 16, prompts: int = 4, new: int = 64, seed: int = 0) -> dict:
    """Greedy tau at ``block`` and the share of ``TOKEN`` among the emitted tokens, on random prompts: what
    ``margin`` gave."""
    from dflash_jax.decoding.api import generate

    rng = np.random.default_rng(seed)
    rows = [rng.integers(2, target.cfg.vocab_size, 24).tolist() for _ in range(prompts)]
    out = generate(target, rows, drafter=drafter, block_size=block, max_new_tokens=new, stop_ids=())
    tokens = np.asarray(out.tokens)
    return dict(tau=float(np.asarray(out.tau).mean()), token_share=float((tokens == TOKEN).mean()))
