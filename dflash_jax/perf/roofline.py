"""The roofline of one decoding step: its FLOPs and bytes, the machine's rates, the speed-up ceiling.

Where it sits: beside the loop, read by ``bench`` and ``generate`` (the CLI) to print, next to a
measured speed-up, the ceiling this machine allows at the measured acceptance length tau, and by the
performance model (``perf_model.py``) as the analytic side of its HLO byte counts. It depends only on
the configs, never on parameters or caches, so it works at any shape (a 27B config on a laptop).

Two floors. At a device's published peaks a step's time is bounded below by ``max(flops / F,
bytes / BW)``: F the matmul rate, BW the memory bandwidth (``Machine``, ``ceiling``; the projections
in ``perf_model``). On this process's own device the floor is measured (``step_floor_timer``):
one jitted program runs exactly the step's matmuls (``Cost.matmuls``, at their own row counts, each
weight a distinct buffer of its real size, so weights stream from memory as the step's do); its warm
time, one window right after each timed run, is the floor the bench divides that run's step by;
``measured_ceiling`` times the plain and the DFlash step's programs in adjacent pairs. ``step_cost`` counts, per step of
``batch`` rows:

* FLOPs: 2 x rows x the linear weights each token meets (every matmul: projections, MLP or the k routed
  + shared experts, LM head), plus attention's QK and PV over the context. Norms, activations, RoPE
  and the Gated DeltaNet recurrence are left out (a few percent at the shipped sizes, < 1% at 27B).
  ``Cost.flops`` is derived from ``Cost.matmuls``, the one record: each module's own linears (q, k,
  v, o; gate, up, down; the GDN's four input projections and its output) and attention's QK and PV
  per (row, KV head).
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
import math
import statistics
import time

import jax
import jax.numpy as jnp

from dflash_jax.config import DrafterConfig, TargetConfig


@dataclasses.dataclass(frozen=True)
class Machine:
    """A device's rates: matmul FLOP/s and memory bytes/s (published peaks, for projections)."""

    matmul_flops_per_s: float
    bytes_per_s: float
    name: str = ""


# Published peaks (dense bf16 FLOP/s, HBM bytes/s; the vendors' data sheets), for projections.
H200 = Machine(989e12, 4.8e12, "H200 (peak)")
MI355X = Machine(2.5e15, 8e12, "MI355X (peak)")


@dataclasses.dataclass(frozen=True)
class Matmul:
    """``count`` products ``[rows, d_in] @ W^T``, each with its own weight W ``[d_out, d_in]`` (the
    modules' layout). Attention's QK and PV are ``count = batch x KV heads`` such products with the
    cached K or V as W. ``rows`` and ``count`` may be fractional (routed experts: expected values)."""

    rows: float
    d_in: int
    d_out: int
    count: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.count * self.rows * self.d_in * self.d_out


@dataclasses.dataclass(frozen=True)
class Cost:
    """The bytes a piece of work moves and the matmuls that make its FLOPs; ``+`` adds, ``seconds``
    is its roofline time on a machine."""

    bytes: float = 0.0
    matmuls: tuple[Matmul, ...] = ()

    @property
    def flops(self) -> float:
        return sum(m.flops for m in self.matmuls)

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.matmuls + other.matmuls)

    def seconds(self, machine: Machine) -> float:
        return max(self.flops / machine.matmul_flops_per_s, self.bytes / machine.bytes_per_s)


def matmul_program(matmuls: tuple[Matmul, ...], dtype) -> tuple:
    """(fn, args): ``fn(n, *args)`` runs exactly ``matmuls`` (rows and counts rounded up), in order, n
    times in one ``lax.fori_loop`` (as the decode loop runs its steps), and returns the last outputs.

    Every matmul has its own weight buffer ``[count, d_out, d_in]`` and input ``[count, rows, d_in]``
    (``[d_out, d_in]`` and ``[rows, d_in]`` for count 1: the modules' own ``Linear`` einsum);
    each input waits on the previous output (a zero taken from it is added), so the products run one
    after another as a step's layers do, and every output is carried, so none is cut short.
    """
    dt = jnp.dtype(dtype)
    shapes = [(math.ceil(m.count), math.ceil(m.rows), m.d_in, m.d_out) for m in matmuls]
    lead = lambda c: (c,) if c > 1 else ()
    # 1 / d_in keeps every output at 1: no overflow, no denormals along the chain
    weights = [jnp.full((*lead(c), o, i), 1.0 / i, dt) for c, _, i, o in shapes]
    inputs = [jnp.ones((*lead(c), r, i), dt) for c, r, i, _ in shapes]

    def run(n, inputs, weights):
        def step(_, carry):
            zero, outs = carry[0], []
            for x, w in zip(inputs, weights, strict=True):
                y = jnp.einsum("...ri,...oi->...ro", x + zero, w)  # [(count,) rows, d_out]
                zero = y.reshape(-1)[0] * 0  # float x * 0 is not folded (NaN semantics): a real dependency
                outs.append(y)
            return zero, outs

        init = (jnp.zeros((), dt), [jnp.zeros((*lead(c), r, o), dt) for c, r, _, o in shapes])
        return jax.lax.fori_loop(0, n, step, init)[1]

    return run, (inputs, weights)


def _timer(matmuls: tuple[Matmul, ...], dtype: str, window_s: float):
    """A function timing one window of ``matmul_program`` (compiled and warmed here): runs back to back in
    one program, enough for ``window_s``, waited on; it returns seconds per run."""
    fn, args = matmul_program(matmuls, dtype)
    fn = jax.jit(fn)
    jax.block_until_ready(fn(1, *args))  # compile + warm
    start = time.perf_counter()
    jax.block_until_ready(fn(1, *args))
    n = max(1, math.ceil(window_s / (time.perf_counter() - start)))

    def window() -> float:
        start = time.perf_counter()
        jax.block_until_ready(fn(n, *args))
        return (time.perf_counter() - start) / n

    return window


@functools.lru_cache(maxsize=64)
def program_ratio(slow: tuple[Matmul, ...], fast: tuple[Matmul, ...], dtype: str = "float32", repeats: int = 7,
                  window_s: float = 0.05) -> float:
    """time(``slow``'s program) / time(``fast``'s): the median of ``repeats`` ratios of adjacent windows,
    the two alternating order (A B | B A ...), so a busy machine's slow spells hit both alike."""
    a, b = _timer(slow, dtype, window_s), _timer(fast, dtype, window_s)
    ratios = []
    for r in range(repeats):
        if r % 2:
            tb, ta = b(), a()
        else:
            ta, tb = a(), b()
        ratios.append(ta / tb)
    return statistics.median(ratios)


def _linear(rows: float, d_in: int, d_out: int, itemsize: int) -> Cost:
    """A [rows, d_in] @ [d_in, d_out] matmul: its FLOPs and its weight read."""
    return Cost(float(d_in * d_out * itemsize), (Matmul(rows, d_in, d_out),))


def _mlp(rows: float, d: int, f: int, itemsize: int) -> Cost:
    return _linear(rows, d, f, itemsize) + _linear(rows, d, f, itemsize) + _linear(rows, f, d, itemsize)


def _distinct_experts(tokens: float, experts: int, k: int) -> float:
    """Expected number of distinct experts picked by ``tokens`` tokens choosing k of E uniformly."""
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def _attention_core(batch: int, t: int, context: int, heads: int, kv_heads: int, head_dim: int,
                    itemsize: int) -> Cost:
    """Scores and weighted values of t queries over context + t keys; K/V read, new rows written."""
    keys, group = context + t, heads // kv_heads
    # per (row, KV head): the group's t x group queries against K [keys, head_dim], then against V
    rows = batch * kv_heads
    matmuls = (Matmul(t * group, head_dim, keys, rows), Matmul(t * group, keys, head_dim, rows))
    return Cost(float(2 * batch * (keys + t) * kv_heads * head_dim * itemsize), matmuls)


def target_cost(cfg: TargetConfig, *, tokens: int, batch: int = 1, context: int = 0, dtype=jnp.bfloat16,
                logits_rows: int | None = None) -> Cost:
    """One target pass over ``tokens`` new tokens per row (verify; tokens=1 is a decode step) + commit.

    Args:
      context: tokens already in the cache per row (attention reads them).
      logits_rows: rows per batch row that go through the LM head (default: all ``tokens``).
    """
    size = jnp.dtype(dtype).itemsize
    D, m = cfg.hidden_size, batch * tokens
    cost = Cost(float(m * D * size))  # embedding rows gathered
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for kind in cfg.layer_types:
        if kind == "full_attention":
            # q (with its gate), k, v; o
            cost += _linear(m, D, 2 * N * H, size) + _linear(m, D, K * H, size) + _linear(m, D, K * H, size)
            cost += _attention_core(batch, tokens, context, N, K, H, size) + _linear(m, N * H, D, size)
        else:
            # in_proj_qkv, z, b, a; out_proj
            cost += _linear(m, D, cfg.conv_dim, size) + _linear(m, D, cfg.linear_value_dim, size)
            cost += _linear(m, D, Hv, size) + _linear(m, D, Hv, size) + _linear(m, cfg.linear_value_dim, D, size)
            # f32 state: read by verify, read + written by commit
            cost += Cost(3.0 * batch * Hv * Dk * Dv * 4)
        if cfg.is_moe:
            E, k, Fe = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
            cost += _linear(m, D, E, size)  # router
            touched = _distinct_experts(m, E, k)
            # the m x k (token, expert) rows spread over the experts they touch: gate_up, then down
            per = m * k / touched
            cost += Cost(touched * 3 * D * Fe * size, (Matmul(per, D, 2 * Fe, touched), Matmul(per, Fe, D, touched)))
            if cfg.shared_expert_intermediate_size:
                cost += _mlp(m, D, cfg.shared_expert_intermediate_size, size) + _linear(m, D, 1, size)
        else:
            cost += _mlp(m, D, cfg.intermediate_size, size)
    rows = batch * (tokens if logits_rows is None else logits_rows)
    return cost + _lm_head(cfg, rows, size)


def _lm_head(cfg: TargetConfig, rows: float, itemsize: int) -> Cost:
    """The (possibly tied) LM head on ``rows`` rows, logits written in f32."""
    return _linear(rows, cfg.hidden_size, cfg.vocab_size, itemsize) + Cost(rows * cfg.vocab_size * 4.0)


def drafter_cost(cfg: DrafterConfig, target: TargetConfig, *, block: int, batch: int = 1, context: int = 0,
                 dtype=jnp.bfloat16) -> Cost:
    """The drafter's part of one DFlash step: context K/V for the ``block`` verified tokens (the commit's
    part) and ``draft_cost`` (the draft phase's)."""
    size = jnp.dtype(dtype).itemsize
    D, m, KH = cfg.hidden_size, batch * block, cfg.num_key_value_heads * cfg.head_dim
    cost = _linear(m, len(cfg.target_layer_ids) * cfg.target_hidden_size, D, size)  # fc over the taps
    for _ in range(cfg.num_hidden_layers):  # weights re-read by the block pass
        cost += _linear(m, D, KH, size) + _linear(m, D, KH, size)
    return cost + draft_cost(cfg, target, block=block, batch=batch, context=context, dtype=dtype)


def draft_cost(cfg: DrafterConfig, target: TargetConfig, *, block: int, batch: int = 1, context: int = 0,
               dtype=jnp.bfloat16) -> Cost:
    """The draft phase: the drafter's pass over the block's positions and the target's LM head on the
    block - 1 draft rows."""
    size = jnp.dtype(dtype).itemsize
    D, m = cfg.hidden_size, batch * block
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cost = Cost(0.0)
    for _ in range(cfg.num_hidden_layers):
        cost += _linear(m, D, N * H, size) + _linear(m, D, K * H, size) + _linear(m, D, K * H, size)  # q, k, v
        cost += _attention_core(batch, block, context, N, K, H, size) + _linear(m, N * H, D, size)
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
    """``tau x floor(plain step) / floor(step at block)`` on this process's device: the floors' programs
    (``step_floor_timer``) timed in adjacent pairs (``program_ratio``); what the CLI and the bench
    print beside a speed-up."""
    plain = step_cost(target, None, block=1, batch=batch, context=context, dtype=dtype)
    spec = step_cost(target, drafter, block=block, batch=batch, context=context, dtype=dtype)
    # A step over a block runs every matmul of a one-token step with more rows: never cheaper, whatever
    # two timings on a busy machine say.
    return tau / max(program_ratio(spec.matmuls, plain.matmuls, jnp.dtype(dtype).name), 1.0)


def step_floor_timer(target: TargetConfig, drafter: DrafterConfig | None, *, block: int, batch: int = 1,
                     context: int = 0, dtype=jnp.float32, window_s: float = 0.05):
    """A step's floor on this process's device: a function timing one window of one program running exactly
    the step's matmuls (``step_cost(...).matmuls``, ``matmul_program``; compiled and warmed here), returning
    seconds per run, for timing the floor right beside the step it bounds (the bench divides each step
    time by the window after it).

    Left out, as in the FLOP count: norms, activations, RoPE, the GDN recurrence, the K/V and state
    writes, the acceptance rule and the loop's control.
    """
    cost = step_cost(target, drafter, block=block, batch=batch, context=context, dtype=dtype)
    return _timer(cost.matmuls, jnp.dtype(dtype).name, window_s)


def draft_floor_timer(target: TargetConfig, drafter: DrafterConfig, *, block: int, batch: int = 1,
                      context: int = 0, dtype=jnp.float32, window_s: float = 0.05):
    """The draft phase's floor, as ``step_floor_timer`` times the step's: its matmuls (``draft_cost``) in
    one program, one window per call, seconds per run."""
    cost = draft_cost(drafter, target, block=block, batch=batch, context=context, dtype=dtype)
    return _timer(cost.matmuls, jnp.dtype(dtype).name, window_s)
