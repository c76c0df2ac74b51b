"""The regime DFlash is for, in miniature: speed-up at a fixed acceptance length on random-weight models.

Where it sits: on top of the loop and the bench's measurement (``bench.measure``, ``bench.SimulatedProposer``),
beside ``roofline.py``. Speculation pays when plain decoding is bound by reading the weights and the
drafter is cheap next to the target. ``MINIATURES`` are random-weight targets too large for a CPU's
caches (~37M and ~140M parameters in f32) with one-layer drafters of 3-4% of the target's per-token
FLOPs. ``fixed_tau`` times plain decoding against DFlash at several block sizes, with the drafts
replaced by plain decoding's own output corrupted at a fixed offset (``SimulatedProposer``: the real
drafter still runs), so tau is fixed and only the step costs differ; the GPU check's end-to-end part
uses it at 27B shapes.

``dflash-jax report regime`` prints the table of ``docs/performance.md`` (several minutes on 2 CPU cores).
"""

from __future__ import annotations

import functools
import statistics

import jax.numpy as jnp
import numpy as np

from dflash_jax.perf import roofline


def _hybrid(D: int, L: int, F: int, heads: tuple[int, int, int], gdn: tuple[int, int, int]) -> dict:
    N, K, H = heads
    hk, hv, dk = gdn
    return dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=4096, hidden_size=D, num_hidden_layers=L,
                intermediate_size=F, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                linear_value_head_dim=dk)


def _drafter(D: int, L: int, heads: tuple[int, int, int], F: int) -> dict:
    N, K, H = heads
    return dict(hidden_size=D, num_hidden_layers=1, num_attention_heads=N, num_key_value_heads=K, head_dim=H,
                intermediate_size=F, vocab_size=4096, block_size=16, num_target_layers=L,
                dflash_config=dict(mask_token_id=1, target_layer_ids=[L // 2]))


MINIATURES = {
    "37m": (_hybrid(512, 8, 2048, (4, 2, 128), (2, 4, 128)), _drafter(512, 8, (4, 1, 64), 512)),
    "140m": (_hybrid(1024, 8, 4096, (8, 2, 128), (4, 8, 128)), _drafter(1024, 8, (4, 1, 128), 512)),
}


def fixed_tau(target, drafter, *, blocks=(4, 8, 16), tau: int = 10, prompt_len: int = 64, max_new: int = 96,
              repeats: int = 3, seed: int = 0) -> dict:
    """Plain decoding vs DFlash at each block with min(tau, block) - 1 drafts accepted per step.

    All methods are timed warm, interleaved, repeated (``bench.measure``) on one random prompt.
    Returns {"ar_decode_tok_s", "blocks": [{block, tau, decode_tok_s, speedup {median,min,max},
    ceiling (roofline.measured_ceiling), compile_s, same_tokens}]}.
    """
    from dflash_jax import frontend
    from dflash_jax.decoding.loop import SpecConfig
    from dflash_jax.perf import bench

    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(2, target.cfg.vocab_size, (1, prompt_len)), jnp.int32)
    lengths = jnp.full((1,), prompt_len, jnp.int32)
    spec = lambda block: SpecConfig(block_size=block, max_new_tokens=max_new, stop_ids=())
    ar, ar_params = bench.method_loop(target, *frontend.proposer_for(frontend.AR, target, None), spec(1))
    ar_tokens = ar.run(ar_params, tokens, lengths, 0).tokens
    runs = {"ar": functools.partial(bench._run_one, ar, ar_params, [(tokens, lengths)], 0)}
    for block in blocks:
        method = frontend.Method("dflash", block)
        loop, params = bench.method_loop(target, *frontend.proposer_for(method, target, drafter), spec(block),
                                         simulate=True)
        params = bench.with_oracle(params, ar_tokens, block, (tau - 1,))  # min(tau, block) - 1 accepted
        runs[block] = functools.partial(bench._run_one, loop, params, [(tokens, lengths)], 0)
    timing = bench.measure(runs, 1, repeats)
    per_s = lambda t: [(max_new - 1) / d for d in t.decode_s]
    ar_t = timing.pop("ar")
    result = dict(ar_decode_tok_s=statistics.median(per_s(ar_t)), ar_compile_s=ar_t.compile_s, blocks=[])
    dtype = target.dtype
    for block, t in timing.items():
        out = t.outputs[0]
        measured = float(np.asarray(out.tau)[0])
        ratios = [a / b for a, b in zip(per_s(t), per_s(ar_t), strict=True)]
        result["blocks"].append(dict(
            block=block, tau=measured, decode_tok_s=statistics.median(per_s(t)),
            speedup=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios)),
            ceiling=roofline.measured_ceiling(target.cfg, drafter.cfg, block=block, tau=measured,
                                              context=prompt_len + max_new // 2, dtype=dtype),
            compile_s=t.compile_s, same_tokens=out.token_lists() == ar_t.outputs[0].token_lists()))
    return result


def drafter_share(target_cfg, drafter_cfg) -> float:
    """The drafter's FLOPs per block position over the target's per token (its LM-head rows excluded)."""
    one = roofline.target_cost(target_cfg, tokens=1, dtype=jnp.float32).flops
    return roofline.drafter_cost(drafter_cfg, target_cfg, block=1, dtype=jnp.float32).flops / one
