"""Per-position acceptance of speculative sampling: what the loop accepted against what the rule promises.

Sits on ``decoding/loop.py``: it steps a ``SpeculativeLoop`` phase by phase (draft, check, settle) and, at
every draft position a row reached (all drafts before it accepted), records

- ``accepted``: whether the loop kept the draft (read from the state ``settle`` returns);
- ``rule``: the probability the acceptance rule should have kept it with, given the drafted token d:
  min(1, p(d) / q(d)) for sampled drafts, p(d) for greedy drafts (q one-hot), 1[d = argmax p] at
  temperature 0; p and q are the target's and the drafter's distributions after the same
  temperature / top-k / top-p (``sampling.probs``);
- ``overlap``: Σₓ min(p(x), q(x)) with q the drafter's distribution at those settings, i.e. what a
  position accepts in expectation with drafts sampled from q, whichever draft mode the loop runs;
- ``top``: max p, the most a greedy draft can accept with.

If the loop's acceptance is right, ``accepted`` and ``rule`` have the same mean at every position (up to
sampling noise: ``z`` compares them in standard errors). The means of ``rule`` and ``overlap`` then say
whether greedy or sampled drafts accept more on the same contexts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.loop import FinishReason, SpecConfig, SpeculativeLoop
from dflash_jax.decoding.proposers import TargetView
from dflash_jax.decoding.sampling import DRAFT_MODES, RowSampling, SamplingConfig, argmax, probs


@dataclasses.dataclass
class PositionStats:
    """Per draft position i = 0..k-1 (draft d_{i+1}), over every (row, step) that reached it."""

    reached: np.ndarray  # [k] int: positions reached
    accepted: np.ndarray  # [k] int: drafts the loop kept
    rule: np.ndarray  # [k] float: Σ of the rule's acceptance probabilities of the drafted tokens
    rule_var: np.ndarray  # [k] float: Σ of their Bernoulli variances r (1 - r)
    overlap: np.ndarray  # [k] float: Σ of Σₓ min(p, q) (q: the drafter's distribution at the same settings)
    top: np.ndarray  # [k] float: Σ of max p
    steps: int  # target steps measured (rows x steps)
    tokens: int  # tokens emitted by them
    row_tau: np.ndarray  # [B] ``GenerateOutput.tau`` of each row (what ``generate`` reports)

    @property
    def tau(self) -> float:
        """τ as the model card reports it: the mean over rows of each row's tokens per target step."""
        return float(np.mean(self.row_tau))

    def rate(self, name: str) -> np.ndarray:
        """Mean of ``name`` ("accepted", "rule", "overlap", "top") per position (NaN where none was reached)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return getattr(self, name) / self.reached

    def z(self) -> float:
        """(accepted - rule) over all positions, in standard errors of the accepted count."""
        return float((self.accepted.sum() - self.rule.sum()) / np.sqrt(max(self.rule_var.sum(), 1e-12)))

    def expected_tau(self, name: str) -> float:
        """τ of independent positions accepting at ``name``'s per-position rates: 1 + Σᵢ Πⱼ≤ᵢ rateⱼ."""
        rates = np.nan_to_num(self.rate(name), nan=0.0)
        return float(1 + np.cumprod(rates).sum())

    def summary(self) -> dict:
        return {"steps": self.steps, "tau": self.tau, "z": self.z(),
                "expected_tau": {n: self.expected_tau(n) for n in ("accepted", "rule", "overlap", "top")},
                "reached": self.reached.tolist(),
                **{n: np.round(self.rate(n), 4).tolist() for n in ("accepted", "rule", "overlap", "top")}}


def _position_terms(loop: SpeculativeLoop, params, state, draft, logits):
    """(rule [B, k], overlap [B, k], top [B, k]) of one step's drafts against the target's logits [B, k+1, V]."""
    rules = loop._rules(state)
    k = draft.tokens.shape[1]
    d = draft.tokens[..., None]
    hit = (draft.tokens == argmax(logits[:, :k])).astype(jnp.float32)  # the rule at temperature 0
    if isinstance(rules, SamplingConfig) and rules.greedy:
        return hit, hit, jnp.ones_like(hit)
    p = probs(logits[:, :k], rules)  # [B, k, V]
    p_d = jnp.take_along_axis(p, d, axis=-1)[..., 0]
    if draft.q is None:  # greedy drafts: q one-hot
        rule = p_d
    else:  # per-row rules give a one-hot q in their greedy-draft rows: the same p(d)
        rule = jnp.minimum(1.0, p_d / jnp.take_along_axis(draft.q, d, axis=-1)[..., 0])
    q = draft.q
    if isinstance(rules, RowSampling):  # every row's q, sampled or not (the keys do not change it)
        full = dataclasses.replace(rules, sampled_drafts=jnp.ones_like(rules.sampled_drafts))
    else:
        full = None if rules.sampled_drafts else dataclasses.replace(rules, draft_mode="sampled")
    if full is not None:  # the drafter's distribution at these settings, from the state the drafts came from
        _, q, _ = loop.proposer.propose(params=params[1], view=TargetView.of(params[0]), state=state.proposer,
                                        anchor=state.anchor, k=k, keys=state.keys, sampling=full)
    overlap = jnp.full_like(rule, jnp.nan) if q is None else jnp.minimum(p, q).sum(-1)  # None: no distribution
    top = p.max(-1)
    if isinstance(rules, RowSampling):  # greedy rows accept the argmax only
        greedy_row = (rules.temperature == 0)[:, None]
        rule, overlap, top = jnp.where(greedy_row, hit, rule), jnp.where(greedy_row, hit, overlap), jnp.where(
            greedy_row, 1.0, top)
    return rule, overlap, top


def measure(loop: SpeculativeLoop, params, prompts, prompt_lens, rng=0, rows: RowSampling | None = None,
            max_steps: int | None = None) -> PositionStats:
    """Runs ``loop`` on prompts [B, P] (right-padded, real up to prompt_lens [B]) step by step until every row
    finishes (or ``max_steps``) and returns its per-position acceptance against the rule's."""
    k = loop.spec.block_size - 1
    if k < 1:
        raise ValueError(f"block_size {loop.spec.block_size}: acceptance needs drafts (block_size >= 2)")
    prompts, prompt_lens = jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lens, jnp.int32)
    state = loop.init(params, prompts, prompt_lens, rng, rows)
    tree = loop.spec.tree_budget is not None  # a tree's τ only: its nodes are no chain of positions to rate
    nan = lambda: (np.full((prompts.shape[0], k), np.nan),) * 3  # noqa: E731
    terms = nan if tree else functools.partial(jax.jit(_position_terms, static_argnums=0), loop)
    totals = {n: np.zeros(k) for n in ("reached", "accepted", "rule", "rule_var", "overlap", "top")}
    steps = tokens = 0
    for _ in range(max_steps or 1 << 30):
        active = np.asarray(state.finish) == FinishReason.RUNNING
        if not active.any():
            break
        draft = loop.draft(params, state)
        verified = loop.check(params, state, draft)
        rule, overlap, top = map(np.asarray, terms() if tree else terms(params, state, draft, verified.out.logits))
        before, n_before = np.asarray(state.accepted), np.asarray(state.n_out)
        state = loop.settle(params, state, draft, verified)
        counted = (np.asarray(state.accepted) - before).sum(1) == 1  # active rows whose step was finite
        a = np.argmax(np.asarray(state.accepted) - before, axis=1)  # drafts accepted per row
        i = np.arange(k)[None, :]
        reached = (i <= a[:, None]) & counted[:, None]
        totals["reached"] += reached.sum(0)
        totals["accepted"] += ((i < a[:, None]) & reached).sum(0)
        for name, value in (("rule", rule), ("rule_var", rule * (1 - rule)), ("overlap", overlap), ("top", top)):
            totals[name] += np.where(reached, value, 0.0).sum(0)
        steps += int(counted.sum())
        tokens += int((np.asarray(state.n_out) - n_before)[counted].sum())
    return PositionStats(**{n: (v.astype(int) if n in ("reached", "accepted") else v) for n, v in totals.items()},
                         steps=steps, tokens=tokens, row_tau=np.asarray(loop.output(state).tau))


def table(assets: str | Path = Path(__file__).parents[1] / "assets", *, temperatures=(0.0, 0.7, 1.0),
          draft_modes=DRAFT_MODES, block_size: int = 16, n_prompts: int = 16, max_new_tokens: int = 128,
          seed: int = 0, drafter: str | Path | None = None, json_out: str | Path | None = None,
          per_row: bool = False, tree: int | None = None) -> list[dict]:
    """τ and per-position acceptance of the pair in ``assets`` (``target/``, ``drafter/``; ``drafter`` another
    drafter folder) on ``evaluate.eval_prompts`` (HumanEval/0..n-1), no stop ids, one row per (temperature,
    draft mode: "greedy", "sampled" or "auto", the default; greedy decoding once), printed as they come and
    written to ``json_out`` when given; ``per_row``: the settings as ``RowSampling`` (the server's path);
    ``tree``: draft trees of that budget (``SpecConfig.tree_budget``; τ only, no per-position rates)::

        python -c "from dflash_jax.perf.acceptance import table; table(temperatures=(0, 0.7))"
    """
    from dflash_jax.decoding.api import bucket_for, pad_prompts
    from dflash_jax.decoding.proposers import DFlashProposer
    from dflash_jax.models.drafter import load_drafter
    from dflash_jax.models.target import load_target
    from dflash_jax.train import tokenizer as tk
    from dflash_jax.train.evaluate import eval_prompts

    assets = Path(assets)
    target = load_target(assets / "target", jnp.float32, progress=False)
    draft = load_drafter(Path(drafter) if drafter else assets / "drafter", target, progress=False)
    source, prompts = eval_prompts(tk.load(assets / "target"), n_prompts)
    tokens, lens = pad_prompts(prompts, bucket_for(max(map(len, prompts))), vocab_size=target.cfg.vocab_size)
    proposer, params = DFlashProposer(draft.cfg, draft.graphdef), (target.params, draft.params)
    rows = []
    for t in temperatures:
        for mode in draft_modes if t > 0 else ("greedy",):
            cfg = SamplingConfig(temperature=t, draft_mode=mode)
            spec = SpecConfig(block_size=block_size, max_new_tokens=max_new_tokens, sampling=cfg, stop_ids=(),
                              tree_budget=tree)
            if per_row:
                spec = dataclasses.replace(spec, sampling=SamplingConfig())
            loop = SpeculativeLoop.of(target, proposer, spec)
            stats = measure(loop, params, tokens, lens, rng=seed,
                            rows=RowSampling.of([cfg] * len(prompts)) if per_row else None)
            rows.append({"prompts": source, "temperature": t, "draft_mode": mode, "block_size": block_size,
                         "tree": tree, "per_row": per_row, **stats.summary()})
            first = {n: np.round(stats.rate(n)[:4], 3).tolist() for n in ("accepted", "rule", "overlap", "top")}
            where = " per row" if per_row else ""
            print(f"T={t:g} drafts={mode}{where}: tau {stats.tau:.3f}  z {stats.z():+.2f}  positions 1-4: accepted "
                  f"{first['accepted']} rule {first['rule']} sum-min(p,q) {first['overlap']} max-p {first['top']}",
                  flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))
    return rows

