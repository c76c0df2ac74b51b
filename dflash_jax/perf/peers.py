"""Peers on the same weights: transformers' ``generate`` and z-lab's own ``dflash`` package as ``bench`` methods.

Sits in the measurement layer beside ``bench.py``, whose ``measure`` times these runs exactly as it times
the loop's (warm, interleaved, repeated, median): each peer here is a ``run(batch, clock) -> (output,
prefill seconds, decode seconds)``. ``hf:ar`` is transformers' ``generate`` (PyTorch, greedy or sampled)
on the target loaded by ``AutoModelForCausalLM`` from the same folder; ``zlab:B`` is z-lab's
``dflash.model.dflash_generate`` at block B with its ``DFlashDraftModel`` (a DFlash2 checkpoint: its
``DFlash2DraftModel``, whose selector z-lab's loop walks) loaded from the drafter's folder
(``pip install --no-deps dflash==0.1.0``). What z-lab 0.1.0 cannot run is said, not worked around: its DFlash2
convolution fails on the short blocks its loop verifies last when the kernel is 4 or more
(``_reported_convolve``). Both decode one row at a time (z-lab's loop has no
batch; transformers' would need left padding, which Gated DeltaNet's recurrent state reads as tokens),
so a batch's time is the sum of its rows'. The split into prefill and decode: the moment the first new
token exists (transformers' streamer is handed it; z-lab's own ``return_stats`` clock, made to read
``clock`` instead of synchronizing CUDA). Texts are compared with plain decoding's by ``bench``; a peer
that differs is reported there (z-lab crops the target's cache after a rejection; under transformers < 5.25
that rolls back attention K/V but not Gated DeltaNet's state, so its greedy output may differ there; from
5.25 the states of the last ``block`` tokens are kept and the rollback is exact, see ``_cache_maker``).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from unittest import mock

import numpy as np

KINDS = ("hf", "zlab")
INSTALL = {"torch": "pip install torch (CPU wheels: --index-url https://download.pytorch.org/whl/cpu)",
           "transformers": "pip install transformers",
           "dflash": "pip install --no-deps dflash==0.1.0"}


@dataclasses.dataclass(frozen=True)
class Peer:
    """``hf:ar`` (transformers' generate, block 1) or ``zlab:B`` (z-lab's dflash_generate at block B)."""

    kind: str
    block: int

    @property
    def name(self) -> str:
        return "hf:ar" if self.kind == "hf" else f"zlab:{self.block}"


def parse_peer(item: str, flag: str = "--methods") -> Peer | None:
    """``hf:ar`` or ``zlab:B`` (B >= 2) -> Peer; None for an item of another kind; errors name ``flag``."""
    kind, _, arg = item.strip().partition(":")
    if kind not in KINDS:
        return None
    if kind == "hf" and arg == "ar":
        return Peer("hf", 1)
    if kind == "zlab" and arg.isdigit() and int(arg) >= 2:
        return Peer("zlab", int(arg))
    raise ValueError(f"{flag}: cannot parse {item.strip()!r}; the peers are hf:ar (transformers' generate) and "
                     f"zlab:B, B >= 2 (z-lab's dflash_generate at block B)")


def require(peers) -> None:
    """Imports what ``peers`` need (before JAX compiles anything: torch loaded later has crashed XLA's CPU
    compiler); a clear error naming each missing package and how to install it."""
    needed = ["torch", "transformers"] + (["dflash"] if any(p.kind == "zlab" for p in peers) else [])
    missing = []
    for name in needed if peers else ():
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ValueError(f"{', '.join(p.name for p in peers)} need {', '.join(missing)}: "
                         + "; ".join(INSTALL[m] for m in missing))


@dataclasses.dataclass
class PeerOutput:
    """A peer's rows as ``bench`` reads them: tokens per row (the stop id kept), target steps per row."""

    tokens: list[list[int]]
    steps: list[int]

    def token_lists(self) -> list[list[int]]:
        return self.tokens

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(t) for t in self.tokens])

    @property
    def tau(self) -> np.ndarray:
        """Tokens per target step after the first (prefill's), per row, as the loop's tau."""
        return np.asarray([(len(t) - 1) / max(s, 1) for t, s in zip(self.tokens, self.steps, strict=True)])


class Models:
    """The target (``AutoModelForCausalLM``) and, for ``zlab`` peers, z-lab's drafter, in PyTorch on the CPU."""

    def __init__(self, model_dir: Path, draft_dir: Path | None, peers, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        try:
            self.target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
        except (OSError, ValueError) as e:
            raise ValueError(f"hf/zlab peers: transformers cannot load the target {model_dir} ({e})") from None
        self.drafter = None
        if any(p.kind == "zlab" for p in peers):
            from dflash import model as zlab

            if draft_dir is None:
                raise ValueError("zlab peers need a drafter: give --draft-model DIR")
            # z-lab's class by the checkpoint's config (a DFlash2DraftModel's adds convolutions and the selector;
            # its dflash_generate then walks the selector); our loader's reading, so the two agree on the arch
            from dflash_jax.config import DrafterConfig
            try:
                self.dflash2 = DrafterConfig.from_pretrained(draft_dir).dflash2
            except (OSError, ValueError) as e:
                raise ValueError(f"zlab peers: cannot read the drafter config in {draft_dir} ({e})") from None
            cls = zlab.DFlash2DraftModel if self.dflash2 else zlab.DFlashDraftModel
            try:
                self.drafter = cls.from_pretrained(str(draft_dir), dtype=torch_dtype).eval()
            except (OSError, ValueError) as e:
                raise ValueError(f"zlab peers: z-lab's {cls.__name__} cannot load {draft_dir} ({e})") from None
            too_big = [p.name for p in peers if p.kind == "zlab" and p.block > self.drafter.block_size]
            if too_big:
                raise ValueError(f"{', '.join(too_big)}: larger than the drafter's block size "
                                 f"{self.drafter.block_size} ({draft_dir})")


def _hf_row(models: Models, prompt: list[int], *, max_new_tokens, stop_ids, sampling, clock):
    """(tokens, steps, prefill s, decode s) of transformers' generate on one row."""
    from transformers import GenerationConfig

    torch = models.torch
    marks = []

    class FirstToken:  # generate hands a streamer the prompt, then each new token as it exists
        def put(self, value):
            marks.append(clock())

        def end(self):
            pass

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not sampling.greedy,
                              temperature=sampling.temperature or None, top_k=sampling.top_k or None,
                              top_p=sampling.top_p, eos_token_id=list(stop_ids) or None,
                              pad_token_id=models.target.config.pad_token_id or 0)
    start = clock()
    with torch.inference_mode():
        out = models.target.generate(torch.tensor([prompt]), generation_config=config, streamer=FirstToken())
    end = clock()
    tokens = out[0, len(prompt):].tolist()
    return tokens, len(tokens) - 1, marks[1] - start, end - marks[1]


def _cache_maker(block: int):
    """z-lab's ``_make_cache`` with the depth of rollback made explicit.

    z-lab calls ``DynamicCache.activate_past_recording()`` with no argument. Since transformers 5.25 a Gated
    DeltaNet layer that records its past keeps the recurrent states of its last ``recurrent_states_to_keep``
    tokens so ``crop`` can roll them back, and the default (None) fails in Qwen3.5's forward with
    ``min(int, None)``, at the prefill (so at every block). A verify step of ``block`` tokens is cropped by at
    most ``block - 1``; ``crop(-r)`` reads the state ``r`` tokens back from a history that starts with the state
    before the step, so keeping ``block`` states rolls back every rejection exactly. Older transformers (no such
    argument) get z-lab's own call."""
    from transformers import DynamicCache

    def make_cache(config):
        cache = DynamicCache(config=config)
        if hasattr(cache, "get_recurrent_states_to_keep"):  # transformers >= 5.25
            cache.activate_past_recording(recurrent_states_to_keep=block)
        else:
            cache.activate_past_recording()
        return cache
    return make_cache


def _reported_convolve(convolve, block: int):
    """z-lab's ``_grouped_dynamic_convolve``, run as it is, its failure on a short block said in one line.

    dflash 0.1.0 pads each shifted copy to the tap offset instead of cutting it to the block, so a block of T
    tokens with T < kernel - 1 raises a shape mismatch; its ``dflash_generate`` verifies blocks of
    min(B, tokens left) and so reaches T = 2 in its last steps whenever the kernel is 4 or more (the released
    kernel 2 never fails). This project's convolution is exact at every length (zero-padded on the left); the
    peer reports z-lab's limit instead of working around it, since the row would no longer be z-lab's code."""
    def checked(hidden, dynamic, base, group_size):
        try:
            return convolve(hidden, dynamic, base, group_size)
        except RuntimeError as e:
            T, K = hidden.shape[1], base.shape[0]
            if T >= K - 1:
                raise
            raise ValueError(f"zlab:{block}: z-lab's dflash 0.1.0 cannot run this DFlash2 drafter to the end: its "
                             f"_grouped_dynamic_convolve fails on a block of {T} tokens, shorter than conv_kernel_size "
                             f"{K} - 1 (dflash_generate verifies shorter blocks in its last steps; a kernel of at "
                             f"most 3 runs) [{e}]") from None
    return checked


def _zlab_row(models: Models, prompt: list[int], *, block, max_new_tokens, stop_ids, sampling, clock):
    """(tokens, steps, prefill s, decode s) of z-lab's dflash_generate on one row."""
    from dflash import model as zlab

    torch = models.torch
    start = clock()
    # return_stats reads a clock that synchronizes CUDA; on the CPU it reads ``clock``. The caches are made
    # with the rollback depth transformers >= 5.25 needs (see _cache_maker)
    with mock.patch.object(zlab, "_cuda_time", clock), mock.patch.object(zlab, "_make_cache", _cache_maker(block)), \
            mock.patch.object(zlab, "_grouped_dynamic_convolve", _reported_convolve(zlab._grouped_dynamic_convolve,
                                                                                 block)):
        stats = zlab.dflash_generate(models.drafter, models.target, torch.tensor([prompt]), max_new_tokens,
                                     list(stop_ids) or None, temperature=sampling.temperature, top_p=sampling.top_p,
                                     top_k=sampling.top_k, block_size=block, return_stats=True)
    end = clock()
    tokens = stats.output_ids[0, stats.num_input_tokens:].tolist()
    return tokens, len(stats.acceptance_lengths), stats.time_to_first_token, end - start - stats.time_to_first_token


def runner(peer: Peer, models: Models, batches: list[list[list[int]]], *, max_new_tokens: int, stop_ids,
           sampling, seed: int = 0):
    """``run(b, clock) -> (PeerOutput, prefill s, decode s)`` of ``peer`` on batch b of ``batches`` (token-id
    rows), as ``bench.measure`` calls it; rows run one after another, seeded alike each run."""
    def run(b, clock):
        models.torch.manual_seed(seed)
        rows = [(_hf_row(models, p, max_new_tokens=max_new_tokens, stop_ids=stop_ids, sampling=sampling, clock=clock)
                 if peer.kind == "hf" else
                 _zlab_row(models, p, block=peer.block, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                           sampling=sampling, clock=clock)) for p in batches[b]]
        out = PeerOutput(tokens=[r[0] for r in rows], steps=[r[1] for r in rows])
        return out, sum(r[2] for r in rows), sum(r[3] for r in rows)
    return run
