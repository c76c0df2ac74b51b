"""The GPU check: one command for the first H200 / MI355X we get (``dflash-jax report gpu-check --out DIR``).

Where it sits: a developer tool on top of everything (kernels, models, the loop, the bench). It runs,
in this order, within a time budget (default 9 minutes; a part that would not fit is recorded as
skipped, not run):

1. ``tests``: the kernel test files (``tests/kernels/``) under pytest in one process, with
   ``DFLASH_KERNELS=pallas`` (compiled kernels wherever a test follows the default mode).
2. ``kernels``: every kernel case at Qwen3.5-27B shapes (``report_cases`` of each kernel module, names
   containing ``27b`` or ``drafter``), compiled, checked against its jnp reference on the same data, and
   its achieved HBM bandwidth / the device's peak (goal >= 0.8).
3. ``steps``: verify(T=16) / decode(T=1) step time at 27B shapes, random bf16 weights initialised on the
   device (``synthetic.random_target``), 4K context (goal <= 1.2).
4. ``e2e``: plain decoding against DFlash block 16 with acceptance fixed to tau = 10 (the bench's
   ``SimulatedProposer``: the real random drafter runs, the oracle's drafts are used; ``regime.fixed_tau``),
   27B shapes, warm interleaved medians, beside the roofline's ceiling for an H200 at peak.

``run`` writes the results to ``OUT/gpu_check.json`` (one entry per part: values, goal, met) after each
part. ``smoke`` runs the same code at tiny shapes on any backend (tiny random models, interpreted kernels;
the tests part only collects the kernel tests) so that the check is exercised by the test suite; its
numbers say nothing about a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.io import atomic
from dflash_jax.kernels.common import KernelCase
from dflash_jax.perf import roofline, synthetic
from dflash_jax.perf.kernel_bench import bench_case, fill, peak_bandwidth
from dflash_jax.perf.kernel_report import KERNEL_MODULES, collect_cases

# --smoke: the smallest hybrid stack (3 Gated DeltaNet layers + 1 attention layer) and a one-layer drafter.
SMOKE_TARGET = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=128, hidden_size=32, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    intermediate_size=64)
SMOKE_DRAFTER = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     intermediate_size=64, vocab_size=128, block_size=16, num_target_layers=4,
                     dflash_config=dict(mask_token_id=1, target_layer_ids=[1, 2]))
REPO = Path(__file__).resolve().parents[2]  # the checkout this module runs from (dflash_jax/perf/gpu_check.py)
KERNEL_TESTS = ("kernels/test_attention.py", "kernels/test_gdn.py", "kernels/test_moe.py", "kernels/test_mxfp4.py",
                "kernels/test_integration.py")
PARTS = ("tests", "kernels", "steps", "e2e")


class Budget:
    """Wall-clock budget: ``left()`` seconds remain; parts estimated to overrun are skipped."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def part_tests(repo: Path, smoke: bool, budget: Budget) -> dict:
    """pytest on the kernel test files in one process (one GPU); smoke only collects them (interpreted tests
    are slow on a CPU)."""
    files = [str(repo / "tests" / f) for f in KERNEL_TESTS if (repo / "tests" / f).exists()]
    if not files:
        return dict(skipped=f"no kernel test files under {repo / 'tests'}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "", *files]
    if smoke:
        cmd.append("--collect-only")
    # This process already holds its GPU; without preallocation the tests' process takes what it needs of the rest.
    env = dict(os.environ, DFLASH_KERNELS="pallas" if not smoke else "reference", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=max(budget.left() - 360, 30))
    except subprocess.TimeoutExpired:
        return dict(met=False, error="pytest timed out", seconds=round(time.perf_counter() - start, 1))
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    return dict(met=proc.returncode == 0, returncode=proc.returncode, summary=tail[0],
                seconds=round(time.perf_counter() - start, 1), command=" ".join(cmd[1:]))


def _smoke_cases() -> list[KernelCase]:
    """Tiny attention cases through the Pallas interpreter (what a CPU can run)."""
    from dflash_jax import kernels

    B, T, N, K, H, S = 1, 4, 4, 2, 32, 64
    q_start, kv_len = jnp.full((B,), S - T, jnp.int32), jnp.full((B,), S, jnp.int32)
    args = (jax.ShapeDtypeStruct((B, T, N, H), jnp.float32),
            *(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in kernels.cache_shapes(B, S, K, H)))
    fn = lambda q, k, v: kernels.attention(q, k, v, q_start, kv_len, impl="interpret")
    ref = lambda q, k, v: kernels.attention_reference(q, k, v, q_start, kv_len)
    return [KernelCase("smoke/attention", fn, ref, args, (2 * B * S * K * H + 2 * B * T * N * H) * 4)]


def _max_error(case: KernelCase) -> float:
    """Largest |kernel - reference| over all outputs, relative to the reference's largest magnitude."""
    args = fill(case.args)
    got, want = jax.jit(case.fn)(*args), jax.jit(case.reference)(*args)
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        worst = max(worst, float(np.max(np.abs(g - w)) / (np.max(np.abs(w)) + 1e-6)))
    return worst


def part_kernels(smoke: bool, budget: Budget, peak: float | None) -> dict:
    if smoke:
        cases = _smoke_cases()
    else:
        all_cases, _ = collect_cases(KERNEL_MODULES)
        cases = [c for c in all_cases if "27b" in c.name or "drafter" in c.name]
    rows = []
    for case in cases:
        if budget.left() < 300:  # keep time for the model parts
            rows.append(dict(case=case.name, skipped="time budget"))
            continue
        row = bench_case(case, peak, warmup=2, runs=5, reps=5, reference=False)
        entry = dict(case=case.name, kernel_us=row.kernel_us, peak_fraction=row.peak_fraction, error=row.error)
        if not row.error:
            try:
                entry["max_rel_error"] = _max_error(case)
            except Exception as e:  # e.g. the reference does not fit at 32K x batch 32; report, go on
                entry["max_rel_error"] = None
                entry["error"] = f"reference: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
        rows.append(entry)
    fractions = [r["peak_fraction"] for r in rows if r.get("peak_fraction") is not None]
    errors = [r["max_rel_error"] for r in rows if r.get("max_rel_error") is not None]
    return dict(goal="each kernel >= 0.8 of HBM peak; kernel == reference (rel. error < 2e-2 in bf16)",
                met=bool(fractions) and min(fractions) >= 0.8 and bool(errors) and max(errors) < 2e-2,
                min_peak_fraction=min(fractions, default=None), max_rel_error=max(errors, default=None), rows=rows)


def _models(smoke: bool):
    if smoke:
        raw, dtype = (SMOKE_TARGET, SMOKE_DRAFTER), jnp.float32
    else:
        raw, dtype = synthetic.REAL_SHAPES["27b"], jnp.bfloat16
    target = synthetic.random_target(raw[0], dtype=dtype)
    return target, synthetic.random_drafter(raw[1], target), dtype


def part_steps(target, *, context: int, block: int) -> dict:
    """verify(T=block) + commit against verify(T=1) + commit, jitted, warm medians, 4K context."""
    from dflash_jax.models.cache import init_cache
    from dflash_jax.models.target import commit, verify

    runs = 8
    cache = init_cache(target.cfg, 1, context + (runs + 4) * block, target.dtype)
    cache = dataclasses.replace(cache, lengths=jnp.full((1,), context, jnp.int32))

    def step(params, tokens, cache):
        out, vcache = verify(target.graphdef, params, tokens, cache)
        return out.logits, commit(vcache, jnp.full((1,), tokens.shape[1], jnp.int32))

    fn = jax.jit(step, donate_argnums=2)
    seconds = {}
    for T in (1, block):
        tokens = jnp.ones((1, T), jnp.int32)
        times = []
        for i in range(runs):
            start = time.perf_counter()
            logits, cache = fn(target.params, tokens, cache)
            jax.block_until_ready((logits, cache))
            if i >= 2:  # compile and one warm run excluded
                times.append(time.perf_counter() - start)
        seconds[T] = statistics.median(times)
    ratio = seconds[block] / seconds[1]
    return dict(goal=f"verify(T={block}) / decode(T=1) <= 1.2", met=ratio <= 1.2, ratio=ratio,
                decode_ms=seconds[1] * 1e3, verify_ms=seconds[block] * 1e3, context=context)


def part_e2e(target, drafter, dtype, *, block: int, tau: int, prompt_len: int, max_new: int) -> dict:
    """Plain decoding vs DFlash with ``tau - 1`` drafts accepted every step (``regime.fixed_tau``)."""
    from dflash_jax.perf import regime

    r = regime.fixed_tau(target, drafter, blocks=(block,), tau=tau, prompt_len=prompt_len, max_new=max_new)
    b = r["blocks"][0]
    return dict(goal="report the speed-up at tau fixed; lossless", met=b["same_tokens"], tau=b["tau"],
                ar_decode_tok_s=r["ar_decode_tok_s"], dflash_decode_tok_s=b["decode_tok_s"],
                decode_speedup=b["speedup"], compile_s=dict(ar=r["ar_compile_s"], dflash=b["compile_s"]),
                roofline_ceiling_at_peak=roofline.ceiling(roofline.H200, target.cfg, drafter.cfg, block=block,
                                                          tau=b["tau"], context=prompt_len + max_new // 2,
                                                          dtype=dtype),
                same_tokens=b["same_tokens"])


def run(out_dir: str | Path, *, smoke: bool = False, parts=PARTS, budget_s: float = 540.0, repo: Path = REPO) -> dict:
    """Runs ``parts`` in order within ``budget_s`` seconds; ``OUT/gpu_check.json`` is rewritten after each part,
    so an interrupted check keeps what it measured. A part that raises is recorded as not met, with its error."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(budget_s)
    device = jax.devices()[0].device_kind
    result = dict(device=device, backend=jax.default_backend(), smoke=smoke, jax=jax.__version__, parts={})
    peak = peak_bandwidth(device)
    result["peak_bytes_per_s"] = peak

    def record(name, fn):
        start = time.perf_counter()
        try:
            entry = fn()
        except Exception as e:  # one failing part must not hide the others
            entry = dict(met=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        entry["wall_s"] = round(time.perf_counter() - start, 1)
        result["parts"][name] = entry
        atomic.write_text(out_dir / "gpu_check.json", json.dumps(result, indent=1, default=float))
        print(f"gpu_check {name}: {json.dumps(entry, default=float)[:400]}", file=sys.stderr, flush=True)

    if "tests" in parts:
        record("tests", lambda: part_tests(repo, smoke, budget))
    if "kernels" in parts:
        record("kernels", lambda: part_kernels(smoke, budget, peak))
    if "steps" in parts or "e2e" in parts:
        models = {}

        def build():
            models["m"] = _models(smoke)
            return models["m"]

        context, prompt, max_new = (64, 16, 24) if smoke else (4096, 128, 128)
        if "steps" in parts:
            record("steps", lambda: part_steps(build()[0], context=context, block=16))
        if "e2e" in parts:
            record("e2e", lambda: part_e2e(*(models.get("m") or build()), block=16, tau=10, prompt_len=prompt,
                                           max_new=max_new))
    return result
