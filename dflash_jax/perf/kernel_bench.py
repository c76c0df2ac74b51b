"""GPU timing of every shipped kernel case against its jnp reference (``dflash-jax report kernel-bench``).

Where it sits: a developer tool beside the kernels, fed by each kernel module's ``report_cases()`` (the same
cases the compile report checks: real Qwen3.5-27B / 35B-A3B shapes, batch 1 and 32, T = 1 and 16,
attention at 4K and 32K context). It needs a GPU and refuses to run on a CPU.

Per case: fill the ``ShapeDtypeStruct`` args with data, jit the Pallas kernel and the reference, run each
``--warmup`` times (compilation and autotuning excluded), then time ``--runs`` runs of ``--reps``
back-to-back calls closed by ``jax.block_until_ready`` and keep the median per call. Achieved bandwidth
is ``KernelCase.bytes_moved`` / time, shown as a fraction of the device's HBM peak.

Data fill: floats ~ N(0, 0.1^2) (keeps softmax and recurrences finite), 8-bit integers (packed MXFP4
codes and scales) uniform random bits, and any other integer array an even split of the first
argument's leading dimension over its entries (MoE group sizes spread the rows over distinct
experts; per-row counts become 1). Cases that need other integer metadata close over it, as the
attention cases do with ``q_start`` / ``kv_len``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.kernels.common import KernelCase

# HBM peak bytes/s by a substring of jax's device_kind.
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "MI355X": 8e12, "MI350X": 8e12, "MI300X": 5.3e12}


@dataclasses.dataclass
class BenchRow:
    case: str
    kernel_us: float | None
    reference_us: float | None
    speedup: float | None
    bandwidth: float | None  # bytes/s achieved by the kernel
    peak_fraction: float | None
    error: str = ""


def peak_bandwidth(device_kind: str) -> float | None:
    for key, bw in PEAK_BW.items():
        if key.lower() in device_kind.lower():
            return bw
    return None


def fill(args, seed: int = 0) -> list[jax.Array]:
    """Device arrays for a case's ShapeDtypeStructs (rules in the module docstring).

    Floats and bytes are drawn on the device: a 32K-context KV cache at batch 32 is gigabytes.
    """
    keys = jax.random.split(jax.random.key(seed), max(len(args), 1))
    lead = args[0].shape[0] if args and args[0].shape else 1
    out = []
    for key, a in zip(keys, args, strict=False):
        dt = jnp.dtype(a.dtype)
        if jnp.issubdtype(dt, jnp.floating):
            out.append((0.1 * jax.random.normal(key, a.shape, jnp.float32)).astype(dt))
        elif dt.itemsize == 1:
            out.append(jax.random.bits(key, a.shape, jnp.uint8).view(dt))
        else:
            used = min(a.size, lead)
            x = np.zeros(a.size, np.int64)
            x[:used] = lead // used
            x[: lead % used] += 1
            out.append(jnp.asarray(x.reshape(a.shape), dt))
    return out


def time_call(fn, args, *, warmup: int, runs: int, reps: int) -> float:
    """Median seconds per call of the jitted ``fn``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(reps)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - start) / reps)
    return statistics.median(per_call)


def bench_case(case: KernelCase, peak: float | None, *, warmup: int, runs: int, reps: int,
               reference: bool = True) -> BenchRow:
    row = BenchRow(case.name, None, None, None, None, None)
    args = fill(case.args)
    try:
        t = time_call(jax.jit(case.fn), args, warmup=warmup, runs=runs, reps=reps)
    except Exception as e:  # one failing kernel should not hide the others' numbers
        row.error = f"kernel: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        return row
    row.kernel_us = t * 1e6
    if case.bytes_moved:
        row.bandwidth = case.bytes_moved / t
        row.peak_fraction = row.bandwidth / peak if peak else None
    if reference:
        try:
            ref_t = time_call(jax.jit(case.reference), args, warmup=warmup, runs=runs, reps=reps)
            row.reference_us, row.speedup = ref_t * 1e6, ref_t / t
        except Exception as e:  # e.g. the reference's [.., S] f32 scores do not fit: report, go on
            row.error = f"reference: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return row


def format_table(rows: list[BenchRow], device: str, peak: float | None) -> str:
    num = lambda x, f: "-" if x is None else format(x, f)
    lines = [("case", "kernel us", "ref us", "speedup", "GB/s", "of peak", "")]
    for r in rows:
        lines.append((r.case, num(r.kernel_us, ".1f"), num(r.reference_us, ".1f"), num(r.speedup, ".2f"),
                      num(r.bandwidth and r.bandwidth / 1e9, ".0f"), num(r.peak_fraction, ".1%"), r.error))
    widths = [max(len(line[i]) for line in lines) for i in range(6)]
    fmt = lambda line: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(line[:6], widths, strict=True))) + \
        (f"  {line[6]}" if line[6] else "")
    head = f"{device}, HBM peak {'unknown' if peak is None else f'{peak / 1e12:.2f} TB/s'}"
    return "\n".join([head, fmt(lines[0])] + [fmt(line) for line in lines[1:]])
