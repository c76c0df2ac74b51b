"""Where a decoding step's time goes: the compiled loop's own ops, timed inside its while loop (CPU).

Where it sits: beside ``bench``, which times whole runs and divides their step by its matmul floor;
this says what the rest of the step is. XLA:CPU emits one trace event per op it executes (a thunk:
one fusion, one dot, one copy) when ``--xla_cpu_enable_xprof_traceme=true`` is in ``XLA_FLAGS``
before its first computation. ``trace_decode`` runs one ``SpeculativeLoop.decode`` under
``jax.profiler.trace``; each event is matched by name to its instruction in the same compiled program
(``op_table``), which says whether it is a matmul (a dot inside) and which JAX scope it came from
(its ``op_name``: ``check/verify/layer0``, ``draft``, ``settle``). Tracing adds about a microsecond to
each op, so the traced step is longer than the untimed one; the shares and op counts are what it is for.

``dflash-jax report step-profile --method dflash:16`` prints, per scope, ops per step and their
matmul and other microseconds per step, the slowest ops, and beside them the untraced step and its
floor (``roofline.step_floor_timer``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gzip
import json
import re
import tempfile
from pathlib import Path

import jax
import numpy as np

from dflash_jax.perf import bench

TRACE_FLAG = "--xla_cpu_enable_xprof_traceme=true"
_CONTROL = ("while", "conditional", "call")  # their bodies' ops are traced one by one
_MATMUL = ("dot", "convolution")


@dataclasses.dataclass(frozen=True)
class Op:
    """One instruction of the compiled program: its scope, whether it is (or fuses) a dot."""

    scope: str
    matmul: bool
    control: bool


def _library(name: str) -> bool:
    """A jitted jax function (``jnp.cumsum``, ``jax.nn.silu``), not a scope of ours."""
    return name.startswith("_") or any(hasattr(m, name) for m in (jax.numpy, jax.nn, jax.lax))


def _scope(op_name: str) -> str:
    """``jit(decode)/while/body/jit(step)/jit(check)/jit(verify)/layer1/mul`` -> ``check/verify/layer1``:
    the named jits and layers under the loop's step, up to the first primitive, control op or jax function."""
    parts = []
    for p in op_name.split("while/body/", 1)[-1].split("/"):
        m = re.fullmatch(r"jit\((\w+)\)", p)
        if m and m.group(1) == "step":
            continue
        if (m and _library(m.group(1))) or not (m or re.fullmatch(r"layer\d+", p)):
            break
        parts.append(m.group(1) if m else p)
    return "/".join(parts) or "loop"


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\((.*)$")


def op_table(hlo_text: str) -> dict[str, Op]:
    """Instruction name -> ``Op`` for every instruction of a compiled HLO module's text.

    A fusion is a matmul if a dot or convolution is inside it. Its scope is its own ``op_name``, else the
    first one inside it, else (XLA drops some, e.g. of HIGHEST-precision dots) its operands', else its
    computation's caller's."""
    insts, members, current = {}, {}, None  # name -> (computation, opcode, rest); computation -> names
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) \(", line)
        if head:
            current = head.group(1)
            members[current] = []
        elif current is not None and (m := _INSTRUCTION.match(line)):
            insts[m.group(1)] = (current, m.group(2), m.group(3))
            members[current].append(m.group(1))
    caller = {}  # computation -> the instruction that calls it (a fusion, a branch, a loop body)
    for name, (_, _, rest) in insts.items():
        for group in re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=(\{[^}]*\}|%[\w.\-]+)", rest):
            for c in re.findall(r"%([\w.\-]+)", group):
                caller.setdefault(c, name)
    called = {name: re.search(r"calls=%([\w.\-]+)", rest) for name, (_, _, rest) in insts.items()}
    inner = {name: members.get(c.group(1), []) if c else [] for name, c in called.items()}
    meta = {name: re.search(r'op_name="([^"]+)"', rest) for name, (_, _, rest) in insts.items()}

    operands = {name: [o for o in re.findall(r"%([\w.\-]+)", rest.split("), ")[0]) if o in insts]
                for name, (_, _, rest) in insts.items()}

    @functools.cache
    def scope(name: str, depth: int = 0) -> str:
        found = meta[name] or next((meta[n] for n in inner[name] if meta[n]), None)
        if found is not None:
            return _scope(found.group(1))
        if depth < 16:  # what feeds it, then what calls its computation
            for up in [*operands[name], caller.get(insts[name][0])]:
                if up is not None and (got := scope(up, depth + 1)) != "loop":
                    return got
        return "loop"

    return {name: Op(scope=scope(name), control=opcode in _CONTROL,
                     matmul=opcode in _MATMUL or any(insts[n][1] in _MATMUL for n in inner[name]))
            for name, (_, opcode, _) in insts.items()}


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """Per-op times of one traced decode: ``ops`` rows (name, scope, matmul, us per step, calls per step)."""

    steps: int
    ops: tuple[tuple[str, str, bool, float, float], ...]

    def by_scope(self) -> list[tuple[str, float, float, float]]:
        """(scope, ops per step, matmul us per step, other us per step), slowest scope first."""
        acc = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        for _, scope, matmul, us, calls in self.ops:
            a = acc[scope]
            a[0] += calls
            a[1 if matmul else 2] += us
        rows = [(s, *a) for s, a in acc.items()]
        return sorted(rows, key=lambda r: -(r[2] + r[3]))


def trace_events(trace_dir: str | Path) -> list[dict]:
    """The complete ("X") events of the Perfetto trace ``jax.profiler.trace`` wrote under trace_dir."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: was jax.profiler.trace given "
                                "create_perfetto_trace=True?")
    with gzip.open(files[-1]) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def summarize(events: list[dict], table: dict[str, Op], steps: int) -> StepProfile:
    """Events matched to the program's non-control instructions, summed per instruction, per step."""
    us, calls = collections.Counter(), collections.Counter()
    for e in events:
        op = table.get(e["name"])
        if op is not None and not op.control:
            us[e["name"]] += e.get("dur", 0.0)
            calls[e["name"]] += 1
    if not us:
        raise RuntimeError("the trace holds no op of the compiled loop: XLA:CPU traces its ops only when "
                           f"XLA_FLAGS has {TRACE_FLAG} before the process's first computation (set it, then "
                           "start a fresh process); other backends are not supported")
    ops = tuple(sorted(((n, table[n].scope, table[n].matmul, us[n] / steps, calls[n] / steps) for n in us),
                       key=lambda r: -r[3]))
    return StepProfile(steps=steps, ops=ops)


def trace_decode(loop, params, tokens, lengths, rng) -> StepProfile:
    """One warm ``loop.decode`` from ``loop.init(params, tokens, lengths, rng)`` traced op by op."""
    if jax.default_backend() != "cpu":
        raise RuntimeError(f"step_profile reads XLA:CPU's per-op trace; this process runs on "
                           f"{jax.default_backend()!r} (use the device's own profiler there)")
    state = loop.init(params, tokens, lengths, rng)
    table = op_table(loop.decode.lower(loop, params, state).compile().as_text())
    for _ in range(2):  # compile and warm
        jax.block_until_ready(loop.decode(params, loop.init(params, tokens, lengths, rng)))
    state = jax.block_until_ready(loop.init(params, tokens, lengths, rng))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            out, _ = jax.block_until_ready(loop.decode(params, state))
        events = trace_events(d)
    return summarize(events, table, steps=max(int(np.asarray(out.steps).max()), 1))


def format_profile(p: StepProfile, top: int = 15) -> str:
    total = sum(r[3] for r in p.ops)
    count = sum(r[4] for r in p.ops)
    lines = [f"traced: {p.steps} steps, {count:.0f} ops and {total:.0f} us of ops per step "
             f"(matmuls {sum(r[3] for r in p.ops if r[2]):.0f} us in {sum(r[4] for r in p.ops if r[2]):.0f} ops)",
             f"other ops: {count - sum(r[4] for r in p.ops if r[2]):.0f} per step, median "
             f"{np.median([r[3] / r[4] for r in p.ops if not r[2]] or [0.0]):.2f} us a call",
             f"{'scope':<24} {'ops':>6} {'matmul us':>10} {'other us':>9} {'share':>6}"]
    for scope, n, mm, other in p.by_scope():
        lines.append(f"{scope:<24} {n:>6.1f} {mm:>10.1f} {other:>9.1f} {(mm + other) / total:>6.1%}")
    lines.append(f"slowest {top} ops (us per step, calls per step):")
    for name, scope, matmul, us, calls in p.ops[:top]:
        lines.append(f"  {us:>7.1f} {calls:>4.1f}  {'matmul' if matmul else 'other ':<6} {scope:<22} {name}")
    return "\n".join(lines)


def untraced(loop, params, tokens, lengths, rng, method, target, drafter, context: int, repeats: int = 7) -> str:
    """The same decode untraced beside its matmul floor (not for MTP: its head is not in the floor model),
    as ``bench`` pairs them: each run's seconds per step over the floor window timed right after it."""
    floor = None if method.kind == "mtp" else bench.floor_timer(
        method, target.cfg, None if drafter is None else drafter.cfg, batch=1, context=context, dtype="float32")
    steps, ratios = [], []
    for _ in range(repeats):
        out, _, decode_s = bench.timed_run(loop, params, tokens, lengths, rng)
        steps.append(decode_s / max(int(np.asarray(out.steps).max()), 1))
        if floor is not None:
            ratios.append(steps[-1] / floor())
    text = f"untraced: {np.median(steps) * 1e3:.3f} ms per step (median of {repeats})"
    if ratios:
        text += f", {np.median(ratios):.2f}x its matmul floor (context {context})"
    return text
