"""The roofline of one decoding step: its FLOPs and bytes, the machine's rates, the speed-up ceiling.

Where it sits: beside the loop, read by ``bench`` and ``generate`` (the CLI) to print, next to a
measured speed-up, the ceiling this machine allows at the measured acceptance length tau, and by the
performance model (``perf_model.py``) as the analytic side of its HLO byte counts. It depends only on
the configs, never on parameters or caches, so it works at any shape (a 27B config on a laptop).

The model. A step's time is bounded below by ``max(flops / F, bytes / BW)``: F the matmul rate, BW
the memory bandwidth (``Machine``). ``step_cost`` counts, per step of ``batch`` rows:

* FLOPs: 2 x rows x the linear weights each token meets (every matmul: projections, MLP or the k routed
  + shared experts, LM head), plus attention's QK and PV over the context. Norms, activations, RoPE
  and the Gated DeltaNet recurrence are left out (a few percent at the shipped sizes, < 1% at 27B).
* Bytes: every weight matrix the step touches, read once (routed experts: the expected number of
  distinct experts the step's tokens pick), the K/V cache read over the context and the new K/V rows
  written, the GDN state read in verify and read + written in commit, and the logits written.

A DFlash step at block Bk is one target verify over Bk tokens + commit, the drafter's context write
over those Bk tokens, its pass over the Bk block positions and the target's LM head on the Bk - 1
draft rows. Plain decoding is the same with Bk = 1 and no drafter. The speed-up ceiling at tau
tokens committed per step is ``tau * time(plain step) / time(DFlash step)``.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp

from dflash_jax.config import TargetConfig
from dflash_jax.drafter import DrafterConfig


@dataclasses.dataclass(frozen=True)
class Machine:
    """A device's sustained rates: matmul FLOP/s (at the step's row count) and memory bytes/s."""

    matmul_flops_per_s: float
    bytes_per_s: float
    name: str = ""


# Published peaks (dense bf16 FLOP/s, HBM bytes/s; the vendors' data sheets), for projections.
H200 = Machine(989e12, 4.8e12, "H200 (peak)")
MI355X = Machine(2.5e15, 8e12, "MI355X (peak)")


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of a piece of work; ``+`` adds, ``seconds`` is its roofline time on a machine."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)

    def seconds(self, machine: Machine) -> float:
        return max(self.flops / machine.matmul_flops_per_s, self.bytes / machine.bytes_per_s)


def _median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@functools.lru_cache(maxsize=16)
def measure_machine(dtype: str = "float32", rows: int = 16, working_set_bytes: int = 256 * 2**20,
                    repeats: int = 7) -> Machine:
    """Measures this process's default device (cached per arguments; about a second on a CPU).

    Args:
      dtype: the matmul's dtype (the weights').
      rows: the matmul's row count (tokens per step: batch x block), sized ``[rows, K] @ [K, N]``
        with a weight that stays in cache on a CPU (K = N = 1024; 8192 on an accelerator).
      working_set_bytes: the buffer summed to measure bandwidth (clamped to 1 MiB .. 1 GiB). A step
        whose weights fit the CPU's caches streams them at cache speed, so pass the step's bytes.
    Returns:
      Medians of ``repeats`` warm runs.
    """
    on_cpu = jax.default_backend() == "cpu"
    dt = jnp.dtype(dtype)
    k = n = 1024 if on_cpu else 8192
    a = jnp.ones((rows, k), dt)
    w = jnp.ones((k, n), dt)
    matmul = jax.jit(lambda a, w: a @ w)
    flops = 2 * rows * k * n / _median_seconds(matmul, a, w, repeats=repeats)
    nbytes = min(max(int(working_set_bytes), 2**20), 2**30) // 4 * 4
    buf = jnp.ones((nbytes // 4,), jnp.float32)
    bandwidth = nbytes / _median_seconds(jax.jit(jnp.sum), buf, repeats=repeats)
    return Machine(flops, bandwidth, f"{jax.devices()[0].device_kind} (measured: {dt.name}, {rows} rows, "
                                     f"{nbytes / 2**20:.0f} MiB)")


def _linear(rows: float, d_in: int, d_out: int, itemsize: int) -> Cost:
    """A [rows, d_in] @ [d_in, d_out] matmul: its FLOPs and its weight read."""
    return Cost(2.0 * rows * d_in * d_out, float(d_in * d_out * itemsize))


def _mlp(rows: float, d: int, f: int, itemsize: int) -> Cost:
    return _linear(rows, d, 3 * f, itemsize)  # gate, up, down


def _distinct_experts(tokens: float, experts: int, k: int) -> float:
    """Expected number of distinct experts picked by ``tokens`` tokens choosing k of E uniformly."""
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def _attention_core(batch: int, t: int, context: int, heads: int, kv_heads: int, head_dim: int,
                    itemsize: int) -> Cost:
    """Scores and weighted values of t queries over context + t keys; K/V read, new rows written."""
    keys = context + t
    flops = 2.0 * 2 * batch * t * heads * head_dim * keys
    return Cost(flops, float(2 * batch * (keys + t) * kv_heads * head_dim * itemsize))


def target_cost(cfg: TargetConfig, *, tokens: int, batch: int = 1, context: int = 0, dtype=jnp.bfloat16,
                logits_rows: int | None = None) -> Cost:
    """One target pass over ``tokens`` new tokens per row (verify; tokens=1 is a decode step) + commit.

    Args:
      context: tokens already in the cache per row (attention reads them).
      logits_rows: rows per batch row that go through the LM head (default: all ``tokens``).
    """
    size = jnp.dtype(dtype).itemsize
    D, m = cfg.hidden_size, batch * tokens
    cost = Cost(0.0, float(m * D * size))  # embedding rows gathered
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for kind in cfg.layer_types:
        if kind == "full_attention":
            cost += _linear(m, D, 2 * N * H + 2 * K * H, size) + _linear(m, N * H, D, size)
            cost += _attention_core(batch, tokens, context, N, K, H, size)
        else:
            cost += _linear(m, D, cfg.conv_dim + cfg.linear_value_dim + 2 * Hv, size)
            cost += _linear(m, cfg.linear_value_dim, D, size)
            # f32 state: read by verify, read + written by commit
            cost += Cost(0.0, 3.0 * batch * Hv * Dk * Dv * 4)
        if cfg.is_moe:
            E, k, Fe = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
            cost += _linear(m, D, E, size)  # router
            touched = _distinct_experts(m, E, k)
            cost += Cost(2.0 * m * k * 3 * D * Fe, touched * 3 * D * Fe * size)
            if cfg.shared_expert_intermediate_size:
                cost += _mlp(m, D, cfg.shared_expert_intermediate_size, size) + _linear(m, D, 1, size)
        else:
            cost += _mlp(m, D, cfg.intermediate_size, size)
    rows = batch * (tokens if logits_rows is None else logits_rows)
    return cost + _lm_head(cfg, rows, size)


def _lm_head(cfg: TargetConfig, rows: float, itemsize: int) -> Cost:
    """The (possibly tied) LM head on ``rows`` rows, logits written in f32."""
    return _linear(rows, cfg.hidden_size, cfg.vocab_size, itemsize) + Cost(0.0, rows * cfg.vocab_size * 4.0)


def drafter_cost(cfg: DrafterConfig, target: TargetConfig, *, block: int, batch: int = 1, context: int = 0,
                 dtype=jnp.bfloat16) -> Cost:
    """The drafter's part of one DFlash step: context K/V for the ``block`` verified tokens, one pass
    over the block's positions, and the target's LM head on the block - 1 draft rows."""
    size = jnp.dtype(dtype).itemsize
    D, m = cfg.hidden_size, batch * block
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cost = _linear(m, len(cfg.target_layer_ids) * cfg.target_hidden_size, D, size)  # fc over the taps
    for _ in range(cfg.num_hidden_layers):
        cost += _linear(m, D, 2 * K * H, size)  # context K/V (weights re-read by the block pass below)
        cost += _linear(m, D, N * H + 2 * K * H, size) + _linear(m, N * H, D, size)
        cost += _attention_core(batch, block, context, N, K, H, size)
        cost += _mlp(m, D, cfg.intermediate_size, size)
    return cost + _lm_head(target, batch * (block - 1), size)


def step_cost(target: TargetConfig, drafter: DrafterConfig | None, *, block: int, batch: int = 1,
              context: int = 0, dtype=jnp.bfloat16) -> Cost:
    """One loop step: a DFlash step at ``block`` (drafter given) or plain decoding (drafter None, block 1).

    Args:
      target, drafter: the configs; the drafter's block size is not checked (any block <= it runs).
      block: tokens verified per row; batch: rows; context: tokens in the cache per row.
      dtype: the weights' dtype (bytes per parameter), e.g. ``jnp.float32`` on a CPU.
    """
    if drafter is None and block != 1:
        raise ValueError(f"step_cost: block {block} needs a drafter config (plain decoding is block 1)")
    if block < 1 or batch < 1 or context < 0:
        raise ValueError(f"step_cost: block={block}, batch={batch} must be >= 1 and context={context} >= 0")
    cost = target_cost(target, tokens=block, batch=batch, context=context, dtype=dtype)
    if drafter is not None:
        cost += drafter_cost(drafter, target, block=block, batch=batch, context=context, dtype=dtype)
    return cost


def ceiling(machine: Machine, target: TargetConfig, drafter: DrafterConfig | None, *, block: int, tau: float,
            batch: int = 1, context: int = 0, dtype=jnp.bfloat16) -> float:
    """Upper bound on the speed-up over plain decoding at ``tau`` tokens committed per step.

    ``tau * roofline(plain step) / roofline(step at block)``; e.g. on a compute-bound CPU with a drafter
    as costly as the target's LM head on 15 rows, block 16 at tau 10 allows far less than 10x.
    """
    plain = step_cost(target, None, block=1, batch=batch, context=context, dtype=dtype).seconds(machine)
    spec = step_cost(target, drafter, block=block, batch=batch, context=context, dtype=dtype).seconds(machine)
    return tau * plain / spec


def tokens_per_second(machine: Machine, target: TargetConfig, drafter: DrafterConfig | None, *, block: int,
                      tau: float, batch: int = 1, context: int = 0, dtype=jnp.bfloat16) -> float:
    """Roofline tokens/s per row at ``tau`` tokens per step (tau = 1 for plain decoding)."""
    step = step_cost(target, drafter, block=block, batch=batch, context=context, dtype=dtype)
    return tau / step.seconds(machine)


def measured_ceiling(target: TargetConfig, drafter: DrafterConfig | None, *, block: int, tau: float,
                     batch: int = 1, context: int = 0, dtype=jnp.float32) -> float:
    """``ceiling`` on this process's device, each step timed at its own shape (what the CLI prints).

    The plain step's rates are measured at ``batch`` rows and its own bytes as the working set, the
    DFlash step's at ``batch * block`` rows and its bytes (``measure_machine`` caches both).
    """
    plain = measured_step_seconds(target, None, block=1, batch=batch, context=context, dtype=dtype)
    spec = measured_step_seconds(target, drafter, block=block, batch=batch, context=context, dtype=dtype)
    # A step over a block reads every byte and does every FLOP of a one-token step: never cheaper,
    # whatever the rates measured at the two shapes (a busy machine can skew them) would say.
    return tau * plain / max(spec, plain)


def measured_step_seconds(target: TargetConfig, drafter: DrafterConfig | None, *, block: int, batch: int = 1,
                          context: int = 0, dtype=jnp.float32) -> float:
    """A step's floor on this process's device: its roofline time at the rates measured for its own shape
    (``batch * block`` matmul rows, its bytes as the working set); the bench prints step time over it."""
    cost = step_cost(target, drafter, block=block, batch=batch, context=context, dtype=dtype)
    machine = measure_machine(jnp.dtype(dtype).name, rows=batch * block, working_set_bytes=int(cost.bytes))
    return cost.seconds(machine)
