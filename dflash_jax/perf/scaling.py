"""Prefill and compile at real sizes: prefill time against prompt length, compile time against depth.

Where it sits: on top of the target, the proposers and the loop, beside ``perf_model.py`` (bytes at real
shapes) and ``regime.py`` (decode speed-up at fixed tau). Two measurements:

* ``prefill_seconds``: ``target.prefill`` of one row at each prompt length P (cache capacity P + 256), a
  random-weight target (``synthetic``), every length compiled first (timed apart), then timed warm,
  the lengths alternating order from repeat to repeat; the median per length with its spread. Beside
  each, the FLOPs and the f32 score bytes of one attention layer as the XLA path spends them: up to
  256 queries, every query against the whole capacity; beyond, 256-query chunks, each against the
  keys up to its own end (``kernels.attention.prefill_keys_scored``).
* ``loop_compile_seconds``: the DFlash loop's ``decode`` (the whole on-device ``while_loop``: draft,
  verify, commit) at a real shape with abstract parameters, timed in its three stages: trace, lower,
  XLA compile for this process's backend. ``depth_configs`` keeps a shape's widths and varies its
  number of layers, so the growth of compile time with depth shows.

``dflash-jax report scaling`` prints both tables (``--json OUT`` writes them); the defaults take a few
minutes on 2 CPU cores.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop
from dflash_jax.decoding.proposers import DFlashProposer
from dflash_jax.frontend import ASSETS
from dflash_jax.kernels.attention import prefill_keys_scored
from dflash_jax.perf import roofline, synthetic

EXTRA = 256  # cache positions beyond the prompt in the prefill measurement (room to decode)


def prefill_seconds(target, lengths, *, repeats: int = 3, seed: int = 0, clock=time.perf_counter) -> list[dict]:
    """Per prompt length: {length, compile_s, median_s, min_s, max_s, ms_per_token, flops, scores_bytes};
    flops: ``roofline.target_cost`` of the prompt's matmuls with attention over the keys the XLA path
    scores; scores_bytes: the f32 scores one attention layer computes (all chunks)."""
    rng = np.random.default_rng(seed)
    cfg = target.cfg
    calls = {}
    for P in lengths:
        tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, P)), jnp.int32)
        lens = jnp.full((1,), P, jnp.int32)
        calls[P] = lambda tokens=tokens, lens=lens, P=P: target.prefill(tokens, lens, capacity=P + EXTRA)
    compile_s, times = {}, {P: [] for P in lengths}
    for P, call in calls.items():
        start = clock()
        jax.block_until_ready(call())
        first = clock() - start
        start = clock()
        jax.block_until_ready(call())
        compile_s[P] = max(first - (clock() - start), 0.0)
    for r in range(repeats):
        for P in (lengths if r % 2 == 0 else lengths[::-1]):
            start = clock()
            jax.block_until_ready(calls[P]())
            times[P].append(clock() - start)
    # FLOPs as the XLA path spends them: the roofline's count has every query against all P + EXTRA cache
    # rows (masked, not skipped); its attention term is replaced by the (query, key) pairs actually scored.
    attn_layers = cfg.layer_types.count("full_attention")
    per_pair = 2 * 2 * cfg.num_attention_heads * cfg.head_dim  # QK and PV
    scored = {P: prefill_keys_scored(P, P + EXTRA) for P in lengths}
    flops = {P: roofline.target_cost(cfg, tokens=P, context=EXTRA, dtype=target.dtype, logits_rows=1).flops
             + attn_layers * per_pair * (scored[P] - P * (P + EXTRA)) for P in lengths}
    return [dict(length=P, compile_s=compile_s[P], median_s=statistics.median(times[P]), min_s=min(times[P]),
                 max_s=max(times[P]), ms_per_token=1e3 * statistics.median(times[P]) / P, flops=flops[P],
                 scores_bytes=4 * cfg.num_attention_heads * scored[P]) for P in lengths]


def depth_configs(raw_target: dict, raw_drafter: dict, layers: int) -> tuple[dict, dict]:
    """A shape's config.json pair at ``layers`` target layers (a multiple of the attention interval), the
    drafter tapping layers spread like the original's (the first tap 1, the last ``layers - 3``)."""
    interval = raw_target.get("full_attention_interval", 4)
    if layers < interval or layers % interval:
        raise ValueError(f"layers {layers}: must be a positive multiple of the attention interval {interval}")
    taps = len(raw_drafter["dflash_config"]["target_layer_ids"])
    ids = sorted({round(1 + i * (layers - 4) / max(taps - 1, 1)) for i in range(taps)})
    target = dict(raw_target, num_hidden_layers=layers)
    target.pop("layer_types", None)  # derived from the interval
    drafter = dict(raw_drafter, num_target_layers=layers,
                   dflash_config=dict(raw_drafter["dflash_config"], target_layer_ids=ids))
    return target, drafter


def loop_compile_seconds(raw_target, raw_drafter, *, block: int = 16, prompt_len: int = 128, max_new: int = 64,
                         dtype=jnp.bfloat16, clock=time.perf_counter) -> dict:
    """{layers, trace_s, lower_s, compile_s, total_s, cpu_s, stablehlo_ops} of the DFlash loop's ``decode``
    at this shape, parameters abstract, kernels as this backend runs them (the XLA path on a CPU).

    The stages are wall-clock seconds; ``cpu_s`` is the process's CPU seconds over all three, which
    other processes sharing the machine barely change (tracing, lowering and XLA's compile of one
    program run on one thread at a time)."""
    target = synthetic.abstract_target(raw_target, dtype=dtype)
    drafter = synthetic.abstract_drafter(raw_drafter, dtype=dtype)
    loop = SpeculativeLoop.of(target, DFlashProposer(drafter.cfg, drafter.graphdef),
                              SpecConfig(block_size=block, max_new_tokens=max_new, stop_ids=()))
    params = (target.params, drafter.params)
    prompts = jax.ShapeDtypeStruct((1, prompt_len), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    cpu, start = time.process_time(), clock()
    state = jax.eval_shape(lambda p, t, n: SpeculativeLoop.init(loop, p, t, n, 0), params, prompts, lens)
    traced = SpeculativeLoop.decode.trace(loop, params, state)
    t_trace = clock()
    lowered = traced.lower()
    t_lower = clock()
    lowered.compile()
    t_compile = clock()
    ops = sum(1 for line in lowered.as_text().splitlines() if " = " in line)
    return dict(layers=target.cfg.num_hidden_layers, trace_s=t_trace - start, lower_s=t_lower - t_trace,
                compile_s=t_compile - t_lower, total_s=t_compile - start, cpu_s=time.process_time() - cpu,
                stablehlo_ops=ops)


def prefill_target(name: str, dtype=jnp.float32):
    """A random-weight target for the prefill sweep: ``shipped`` (the shipped target's config) or a
    ``regime.MINIATURES`` name."""
    from dflash_jax.perf import regime

    if name == "shipped":
        return synthetic.random_target(ASSETS / "target" / "config.json", dtype=dtype)
    if name not in regime.MINIATURES:
        raise ValueError(f"--prefill-model {name!r}: expected shipped or one of {', '.join(regime.MINIATURES)}")
    return synthetic.random_target(regime.MINIATURES[name][0], dtype=dtype)


def format_prefill(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| prompt tokens | prefill ms (min-max) | ms / token | time vs linear from the first | FLOPs vs "
             "linear | compile s | XLA scores / attention layer |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        grow = r["length"] / base["length"]
        lines.append(f"| {r['length']} | {1e3 * r['median_s']:.1f} ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f}) | "
                     f"{r['ms_per_token']:.3f} | {r['median_s'] / (base['median_s'] * grow):.2f}x | "
                     f"{r['flops'] / (base['flops'] * grow):.2f}x | {r['compile_s']:.1f} | "
                     f"{r['scores_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def format_compile(rows: list[dict]) -> str:
    lines = ["| target layers | trace s | lower s | XLA compile s | total s | CPU s | StableHLO ops |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['layers']} | {r['trace_s']:.1f} | {r['lower_s']:.1f} | {r['compile_s']:.1f} | "
              f"{r['total_s']:.1f} | {r['cpu_s']:.1f} | {r['stablehlo_ops']} |" for r in rows]
    return "\n".join(lines)
