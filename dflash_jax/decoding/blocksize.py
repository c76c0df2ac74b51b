"""The block size chosen by cost (``--block-size auto``): the block that maximises expected tokens per second.

Sits in the decoding layer beside the loop, below its front ends. Two measured inputs make the choice:
the drafter's per-position acceptance a_k (the probability that draft k is accepted given that drafts
1 .. k-1 were), and the cost of one loop step at each candidate block on this machine for this batch
(``dflash_jax.perf.step_cost`` measures it; this module only reads the numbers). A step at block B emits
the bonus token always and draft j while drafts 1 .. j are all accepted, so it emits
E[tokens | B] = 1 + sum_{j < B} prod_{k <= j} a_k per row, and the choice is argmax_B E[tokens | B] /
cost(B). Once verification is compute-bound (a large batch) the cost grows with B and a smaller block
wins, the report's concurrency-32 observation; vLLM and SGLang call B - 1 the number of speculative tokens.

The acceptance comes from the drafter's card (``acceptance.json`` in the drafter's folder, written by
``record_acceptance``, valid for the weights whose SHA-256 it records) or from ``calibrate``: a short run
of the loop at the drafter's own block, whose histogram of accepted drafts per step gives a_k. A block
shorter than the calibrated one is assumed to accept its first drafts as the long block does (DFlash
drafts a block at once, so a draft sees the masked positions after it: the approximation is that they
change little).

Each drafter weighs its own chains (``Choice.family``: ``dflash:B``, ``dflash2:B``); ``weigh`` takes the best
of several (``generate`` with the shipped pair weighs the DFlash and the DFlash2 drafter) and says, in one
line, what a step of each commits and what it costs in plain steps here, so a choice of plain decoding is
explained by the numbers. Draft trees (``ddtree:N``) are not among the candidates: a given tree is kept as
given. The chain's rule reads every block's E[tokens] from one calibration (a_k at the largest block); a
tree's depends on the drafter's whole per-depth distributions, so each budget N would need a calibration run
of its own besides the timing of its N + 1-token step: a compilation and a full run per budget, more than the
30 s the choice may take (the chains alone use ~21 s of it for the shipped pair on 2 quiet cores).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.loop import FinishReason, SpecConfig, SpeculativeLoop
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.io import atomic

CARD = "acceptance.json"
CARD_FORMAT = "dflash_jax.acceptance/1"


def acceptance_from_histogram(histogram) -> tuple[float, ...]:
    """a_k for k = 1 .. block-1 from ``histogram`` [block]: steps that accepted 0 .. block-1 drafts.

    a_k = (steps accepting >= k drafts) / (steps accepting >= k - 1); 0 where no step reached k - 1
    (no evidence: such a position is never worth drafting).
    """
    counts = np.asarray(histogram, dtype=np.int64)
    if counts.ndim != 1 or counts.size < 2 or (counts < 0).any() or counts.sum() == 0:
        raise ValueError(f"an acceptance histogram needs >= 2 non-negative counts, not all zero; got {counts.tolist()}")
    reach = counts[::-1].cumsum()[::-1]  # reach[k]: steps accepting >= k drafts; reach[0] = all steps
    return tuple(float(reach[k] / reach[k - 1]) if reach[k - 1] else 0.0 for k in range(1, counts.size))


def expected_tokens(acceptance, block: int) -> float:
    """E[tokens emitted per row per step] at ``block``: 1 (the bonus) + sum_{j < block} prod_{k <= j} a_k."""
    if not 1 <= block <= len(acceptance) + 1:
        raise ValueError(f"block {block} is outside 1..{len(acceptance) + 1} (the acceptance covers "
                         f"{len(acceptance)} draft positions)")
    return 1.0 + float(np.cumprod(np.asarray(acceptance[:block - 1], dtype=np.float64)).sum())


def candidate_blocks(max_block: int) -> tuple[int, ...]:
    """The blocks ``auto`` weighs: plain decoding (1), the powers of two below ``max_block``, and ``max_block``."""
    if max_block < 1:
        raise ValueError(f"max_block must be >= 1, got {max_block}")
    return tuple(sorted({1, max_block} | {2**i for i in range(1, max_block.bit_length()) if 2**i < max_block}))


@dataclasses.dataclass(frozen=True)
class Choice:
    """The chosen block and every number behind it (``choose_block``)."""

    block: int
    batch: int
    expected: dict[int, float]  # block -> E[tokens per row per step], every candidate (timed or not)
    costs: dict[int, float]  # block -> seconds per step (all rows), the timed candidates
    source: str  # where the acceptance came from, for the printout
    family: str = "dflash"  # the drafter's methods: dflash:B, or dflash2:B

    def name(self, block: int) -> str:
        """The method of ``block``: ar (1), else ``family:block``."""
        return "ar" if block == 1 else f"{self.family}:{block}"

    def tokens_per_s(self, block: int) -> float:
        """Expected output tokens per second at ``block`` (a timed one), over all rows."""
        return self.batch * self.expected[block] / self.costs[block]

    def reason(self) -> str:
        """One line: the choice, then each candidate's expected tokens/step, and where timed its ms/step and
        tokens/s."""
        each = ", ".join(f"{self.name(b)}: {self.expected[b]:.2f} tok/step / {self.costs[b] * 1e3:.2f} ms = "
                         f"{self.tokens_per_s(b):.0f} tok/s" if b in self.costs else
                         f"{self.name(b)}: {self.expected[b]:.2f} tok/step (not timed)" for b in sorted(self.expected))
        return (f"block size auto: {self.name(self.block)} ({self.block - 1} speculative tokens) at batch "
                f"{self.batch}, the most expected tokens/s [{each}]; acceptance {self.source}")

    def as_dict(self) -> dict:
        return dict(block=self.block, method=self.name(self.block), batch=self.batch, source=self.source,
                    expected={str(b): round(v, 4) for b, v in sorted(self.expected.items())},
                    step_ms={str(b): round(v * 1e3, 4) for b, v in sorted(self.costs.items())},
                    tokens_per_s={str(b): round(self.tokens_per_s(b), 2) for b in sorted(self.costs)})


def choose_block(acceptance, costs: dict[int, float], *, batch: int = 1, source: str = "given", blocks=(),
                 family: str = "dflash") -> Choice:
    """The block of ``costs`` (block -> measured seconds per step at this batch) with the most expected
    tokens per second under ``acceptance`` (a_k, k = 1 ..); a tie goes to the smaller block. ``blocks``: the
    candidates left untimed too, whose expected tokens the choice still reports."""
    if not costs:
        raise ValueError("no step costs to choose a block from")
    bad = {b: c for b, c in costs.items() if not (isinstance(c, float | int) and math.isfinite(c) and c > 0)}
    if bad:
        raise ValueError(f"step costs must be finite seconds > 0, got {bad}")
    expected = {b: expected_tokens(acceptance, b) for b in {*costs, *blocks}}
    best = min(costs, key=lambda b: (-expected[b] / costs[b], b))
    return Choice(block=best, batch=batch, expected=expected, costs=dict(costs), source=source, family=family)


def weigh(choices: list[Choice]) -> tuple[Choice, str]:
    """The choice with the most expected tokens/s among ``choices`` (one per drafter, each over its own blocks; a
    tie goes to the first), and one line with the numbers behind it: the most a step of each drafter commits
    (its largest block's expected tokens) and, where plain decoding was timed, what each drafter's best timed
    block costs in plain steps here. On a CPU whose caches hold the target a 16-token verify costs about 16
    plain steps, so plain decoding wins even where a step commits 6 tokens: the line shows it."""
    best = max(choices, key=lambda c: c.tokens_per_s(c.block))
    plain = next((c.costs[1] for c in choices if 1 in c.costs), None)
    commits = ", ".join(f"{c.name(top)} {c.expected[top]:.2f}" for c in choices if (top := max(c.expected)) > 1)
    line = (f"block size auto: {best.name(best.block)} at batch {best.batch}, {best.tokens_per_s(best.block):.0f} "
            f"tok/s expected; tokens a step commits: ar 1.00, {commits}")
    if plain is not None:
        timed = [(c, max(b for b in c.costs if b > 1)) for c in choices if any(b > 1 for b in c.costs)]
        if timed:
            line += "; a step costs " + ", ".join(f"{c.name(b)} {c.costs[b] / plain:.1f}x plain's "
                                                   f"({c.tokens_per_s(b):.0f} tok/s)" for c, b in timed)
    return best, line


@dataclasses.dataclass(frozen=True)
class Card:
    """A drafter's recorded acceptance (``acceptance.json``): how its drafts fared at its own block."""

    block_size: int
    histogram: tuple[int, ...]  # [block_size] steps that accepted 0 .. block_size-1 drafts
    temperature: float  # the sampling temperature of the recording (0: greedy)
    prompts: str  # which prompts, in words
    max_new_tokens: int
    weights: str = ""  # ``weights_digest`` of the drafter the card was recorded for

    def fits(self, draft_dir: str | Path) -> bool:
        """Whether the card was recorded for the weights now in ``draft_dir`` (a retrained drafter's is stale)."""
        return self.weights == weights_digest(draft_dir)

    @property
    def acceptance(self) -> tuple[float, ...]:
        return acceptance_from_histogram(self.histogram)

    @property
    def tau(self) -> float:
        return expected_tokens(self.acceptance, self.block_size)


def weights_digest(draft_dir: str | Path) -> str:
    """SHA-256 of the drafter's weights file (``model.safetensors``): which weights a card describes."""
    path = Path(draft_dir) / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def write_card(draft_dir: str | Path, card: Card) -> Path:
    """Writes ``card`` as ``draft_dir/acceptance.json`` (atomically); returns the path."""
    path = Path(draft_dir) / CARD
    doc = dict(format=CARD_FORMAT, block_size=card.block_size, histogram=list(card.histogram),
               acceptance=[round(a, 6) for a in card.acceptance], tau=round(card.tau, 4),
               temperature=card.temperature, prompts=card.prompts, max_new_tokens=card.max_new_tokens,
               weights_sha256=card.weights)
    atomic.write_text(path, json.dumps(doc, indent=1) + "\n")
    return path


def read_card(draft_dir: str | Path) -> Card | None:
    """The card in ``draft_dir`` (None where there is none); a clear error naming the file and key if malformed."""
    path = Path(draft_dir) / CARD
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != CARD_FORMAT:
        raise ValueError(f"{path}: \"format\" must be {CARD_FORMAT!r}")
    block, hist = doc.get("block_size"), doc.get("histogram")
    if not isinstance(block, int) or isinstance(block, bool) or block < 2:
        raise ValueError(f"{path}: \"block_size\" must be an integer >= 2, got {block!r}")
    if not (isinstance(hist, list) and len(hist) == block and all(isinstance(c, int) and c >= 0 for c in hist)
            and sum(hist) > 0):
        raise ValueError(f"{path}: \"histogram\" must be {block} non-negative integer counts (block_size), not all "
                         f"zero; got {hist!r}")
    temperature = doc.get("temperature", 0.0)
    if not isinstance(temperature, float | int) or temperature < 0:
        raise ValueError(f"{path}: \"temperature\" must be a number >= 0, got {temperature!r}")
    return Card(block_size=block, histogram=tuple(hist), temperature=float(temperature),
                prompts=str(doc.get("prompts", "")), max_new_tokens=int(doc.get("max_new_tokens", 0)),
                weights=str(doc.get("weights_sha256", "")))


@functools.partial(jax.jit, static_argnums=0)
def run_steps(loop, params, prompts, prompt_lens, rng, n, until_done):
    """The loop's own ``init``, then its ``step`` ``n`` times ([] int32, traced: one program for every n), or
    fewer where ``until_done`` ([] bool, traced) and every row finished: (histogram [block] of accepted drafts
    per step over the rows, steps run []). The one program that calibrates the acceptance (until done) and
    that ``perf.step_cost`` times (n steps exactly: a finished row's step does the same work)."""
    state = loop.init(params, prompts, prompt_lens, rng)
    running = lambda s: jnp.any(s.finish == FinishReason.RUNNING) | ~until_done  # noqa: E731
    state = jax.lax.while_loop(lambda s: (s.step < n) & running(s), functools.partial(loop.step, params), state)
    return state.accepted.sum(0), state.step


def calibrate(target, drafter, prompts: list[list[int]], *, max_new_tokens: int = 128, sampling=None,
              stop_ids=None, seed: int = 0) -> tuple[int, ...]:
    """The histogram [block] of accepted drafts per step of the real loop at the drafter's own block
    generating ``max_new_tokens`` (until the target's EOS ids or ``stop_ids``) for ``prompts`` (token
    ids, one batch): what ``acceptance_from_histogram`` reads."""
    from dflash_jax.decoding.api import bucket_for, pad_prompts
    from dflash_jax.decoding.proposers import DFlashProposer

    spec = SpecConfig(block_size=drafter.cfg.block_size, max_new_tokens=max_new_tokens,
                      sampling=sampling or SamplingConfig(), stop_ids=stop_ids)
    loop = SpeculativeLoop.of(target, DFlashProposer(drafter.cfg, drafter.graphdef), spec)
    tokens, lengths = pad_prompts(prompts, bucket_for(max(len(p) for p in prompts)), vocab_size=target.cfg.vocab_size)
    histogram, _ = run_steps(loop, (target.params, drafter.params), tokens, lengths, seed, jnp.int32(max_new_tokens),
                              jnp.bool_(True))
    return tuple(int(c) for c in np.asarray(histogram))


def record_acceptance(draft_dir: str | Path, target, drafter, prompts: list[list[int]], *, prompts_name: str,
                      max_new_tokens: int = 128, sampling=None, stop_ids=None, seed: int = 0) -> Card:
    """Calibrates the drafter loaded from ``draft_dir`` on ``prompts`` and writes its card there: run once
    per shipped drafter (e.g. on HumanEval's raw prompts, greedy, 128 new tokens) so ``auto`` needs no
    calibration run."""
    sampling = sampling or SamplingConfig()
    card = Card(block_size=drafter.cfg.block_size,
                histogram=calibrate(target, drafter, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    stop_ids=stop_ids, seed=seed),
                temperature=float(sampling.temperature), prompts=prompts_name, max_new_tokens=max_new_tokens,
                weights=weights_digest(draft_dir))
    write_card(draft_dir, card)
    return card
