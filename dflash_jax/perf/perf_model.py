"""The performance model at real shapes: bytes and FLOPs of one verify, draft and commit from their HLO.

Where it sits: on top of the whole library (target, drafter, proposers), beside ``roofline.py``, whose
analytic counts it checks against the compiler's program. Nothing runs: every program is traced with
abstract parameters and caches (``synthetic.abstract_target``) and lowered for the GPU (``cuda``, the
Pallas kernels as Triton custom calls), so a 27B step is analysed on a laptop in seconds.

Per program two byte counts, from the lowered (pre-optimisation) HLO:

* ``hlo_bytes``: XLA's ``cost_analysis`` "bytes accessed": every HLO op's operands and result, as if
  nothing were fused. An upper bound; it overstates elementwise activation traffic (at batch 32 a lot).
* ``fused_bytes``: the same sum over the ops that must touch memory when every elementwise op is fused
  into its neighbours: matmuls, kernels (custom calls), gathers/scatters and in-place row updates
  (their moved rows only), reductions, sorts, concatenations. The GPU's HBM traffic to first order.

``dflash-jax report perf-model`` prints the table and the tokens/s projections of ``docs/performance.md``
(``--json OUT`` also writes them); it takes about a minute of CPU.
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax
import jax.numpy as jnp

from dflash_jax.decoding.proposers import DFlashProposer, TargetView
from dflash_jax.decoding.sampling import SamplingConfig
from dflash_jax.models.cache import init_cache
from dflash_jax.models.drafter import init_draft_cache
from dflash_jax.models.target import commit, verify
from dflash_jax.perf import roofline, synthetic

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
             "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*?)\)(.*)$")
# Ops that move memory even when all elementwise work is fused (how many of their bytes: see _op_bytes).
_MATERIAL = {"dot", "convolution", "custom-call", "gather", "scatter", "dynamic-slice", "dynamic-update-slice",
             "reduce", "sort", "concatenate", "reduce-window", "select-and-scatter"}


def hlo_bytes(type_text: str) -> float:
    """Bytes of an HLO type (an array or a tuple of arrays); also used by ``sharding_report.collectives``."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEMSIZE.get(dtype, 4)
    return total


def _op_bytes(opcode: str, result: float, operands: list[float]) -> float:
    if opcode in ("dynamic-update-slice", "scatter"):  # in place: the update is read and written
        update = operands[1] if opcode == "dynamic-update-slice" else operands[-1]
        return 2 * update + sum(operands[2:] if opcode == "dynamic-update-slice" else operands[1:-1])
    if opcode in ("gather", "dynamic-slice"):  # only the gathered rows are read
        return 2 * result + sum(operands[1:])
    return result + sum(operands)


def fused_bytes(hlo_text: str) -> dict[str, float]:
    """Per-opcode bytes of the memory-moving ops of an HLO module (pre-optimisation text), called
    computations counted once per call. While loops count their body once per trip only when the
    trip count is a constant in the condition (scans); otherwise once."""
    comps: dict[str, list[tuple[str, str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        m = _LINE.match(line)
        if m and current is not None:
            comps[current].append(m.groups())

    def trips(cond: str) -> int:
        consts = [int(c) for _, t, op, args, _ in comps.get(cond, []) if op == "constant"
                  for c in re.findall(r"^(-?\d+)$", args.strip())]
        return max(consts) if consts else 1

    def walk(name: str, times: float, out: dict[str, float]):
        shapes: dict[str, float] = {}
        for res, type_text, opcode, args, attrs in comps[name]:
            shapes[res] = size = hlo_bytes(type_text)
            operands = [shapes.get(a.strip().lstrip("%"), 0.0) for a in args.split(",") if a.strip()]
            called = re.findall(r"(?:to_apply|calls|body)=%?([\w.\-]+)", attrs)
            if opcode in ("call", "fusion") and called:
                walk(called[0], times, out)
            elif opcode == "while" and called:
                cond = re.search(r"condition=%?([\w.\-]+)", attrs)
                walk(called[0], times * (trips(cond.group(1)) if cond else 1), out)
            elif opcode == "conditional":
                for branch in re.findall(r"%?([\w.\-]+)", (re.search(r"branch_computations=\{(.*?)\}", attrs)
                                                           or re.search(r"()", "")).group(1)):
                    walk(branch, times, out)
            elif opcode in _MATERIAL:
                out[opcode] = out.get(opcode, 0.0) + times * _op_bytes(opcode, size, operands)

    out: dict[str, float] = {}
    walk(entry, 1.0, out)
    return out


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    name: str
    flops: float
    hlo_bytes: float  # XLA cost analysis, unfused
    fused_bytes: float  # memory-moving ops only
    by_op: dict[str, float]
    lower_s: float


def analyse(name: str, fn, *args, platform: str = "cuda") -> ProgramCost:
    """Traces ``fn`` on abstract ``args``, lowers it for ``platform`` and counts its FLOPs and bytes."""
    start = time.perf_counter()
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    seconds = time.perf_counter() - start
    cost = lowered.cost_analysis()
    by_op = fused_bytes(lowered.compiler_ir("hlo").as_hlo_text())
    return ProgramCost(name, float(cost["flops"]), float(cost["bytes accessed"]), sum(by_op.values()), by_op,
                       seconds)


def step_programs(raw_target, raw_drafter, *, batch: int, block: int, context: int,
                  dtype=jnp.bfloat16) -> list[ProgramCost]:
    """decode (verify T=1 + commit), verify (T=block), commit, draft (propose) and the drafter's commit
    (context K/V) of one step, ``context`` tokens in the caches; the configs as ``synthetic`` takes them."""
    target = synthetic.abstract_target(raw_target, dtype=dtype, kernels="pallas")
    drafter = synthetic.abstract_drafter(raw_drafter, dtype=dtype, kernels="pallas")
    proposer = DFlashProposer(drafter.cfg, drafter.graphdef)
    capacity = context + 2 * block
    cache = jax.eval_shape(lambda: init_cache(target.cfg, batch, capacity, dtype))
    dcache = jax.eval_shape(lambda: init_draft_cache(drafter.cfg, batch, capacity, dtype))
    n = jax.ShapeDtypeStruct((batch,), jnp.int32)
    taps = proposer.taps

    def run_verify(tokens):
        return lambda p, t, c: verify(target.graphdef, p, t, c, taps=taps)

    def decode(p, t, c, n):  # a plain-decoding step: its logits and the committed cache
        out, vc = verify(target.graphdef, p, t, c, taps=())
        return out.logits, commit(vc, n)

    tokens = lambda T: jax.ShapeDtypeStruct((batch, T), jnp.int32)
    out, vcache = jax.eval_shape(run_verify(block), target.params, tokens(block), cache)

    def draft(tp, dp, state, anchor, keys):
        return proposer.propose(params=dp, view=TargetView.of(tp), state=state, anchor=anchor, k=block - 1,
                                keys=keys, sampling=SamplingConfig())

    def draft_commit(tp, dp, state, verified, n):
        return proposer.commit(params=dp, view=TargetView.of(tp), state=state, verified=verified, n=n)

    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    return [
        analyse("decode", decode, target.params, tokens(1), cache, n),
        analyse("verify", run_verify(block), target.params, tokens(block), cache),
        analyse("commit", commit, vcache, n),
        analyse("draft", draft, target.params, drafter.params, dcache, n, keys),
        analyse("draft commit", draft_commit, target.params, drafter.params, dcache, out, n),
    ]


def _idle_expert_bytes(cfg, tokens: int, itemsize: int = 2) -> float:
    """Bytes of the routed experts that ``tokens`` tokens leave idle, summed over layers: the grouped-matmul
    kernel reads only the active experts, but its custom call takes the whole [E, out, in] tensors."""
    if not cfg.is_moe:
        return 0.0
    idle = cfg.num_experts - roofline._distinct_experts(tokens, cfg.num_experts, cfg.num_experts_per_tok)
    return cfg.num_hidden_layers * idle * 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize


MXFP4_BITS = 4.25  # 4-bit codes + one 8-bit scale per 32 weights


def _mxfp4_saving(cfg, tokens: int) -> float:
    """Bytes saved per target pass over ``tokens`` tokens when the layers' matrices (not the embedding or
    the LM head) are MXFP4 instead of bf16; routed experts: only those the tokens pick."""
    D, V = cfg.hidden_size, cfg.vocab_size
    experts = cfg.num_hidden_layers * 3 * D * cfg.moe_intermediate_size if cfg.is_moe else 0  # per expert
    picked = roofline._distinct_experts(tokens, cfg.num_experts, cfg.num_experts_per_tok) if cfg.is_moe else 0
    params = sum(x.size for x in jax.tree.leaves(synthetic.abstract_target(cfg).params))
    dense = params - 2 * V * D - experts * cfg.num_experts  # every matrix but embedding, head, experts
    return 2 * (dense + experts * picked) * (1 - MXFP4_BITS / 16)


def report(shapes=("27b", "35b-a3b"), batches=(1, 32), block: int = 16, context: int = 4096,
           tau: float = 10.377) -> dict:
    """The model: per (shape, batch) the programs' costs, the verify / decode byte ratio, the analytic
    roofline bytes, and projected tokens/s (all rows together) on an H200 and an MI355X at ``tau``."""
    rows = []
    for shape in shapes:
        raw_target, raw_drafter = synthetic.REAL_SHAPES[shape]
        tcfg, dcfg = synthetic.target_config(raw_target), synthetic.drafter_config(raw_drafter)
        for batch in batches:
            progs = {p.name: p for p in step_programs(raw_target, raw_drafter, batch=batch, block=block,
                                                      context=context)}
            # Charge the MoE kernels only the experts the step's tokens pick (see _idle_expert_bytes).
            plain_bytes = progs["decode"].fused_bytes - _idle_expert_bytes(tcfg, batch)
            verify_bytes = progs["verify"].fused_bytes - _idle_expert_bytes(tcfg, batch * block)
            spec = verify_bytes + sum(progs[k].fused_bytes for k in ("commit", "draft", "draft commit"))
            spec_flops = sum(progs[k].flops for k in ("verify", "commit", "draft", "draft commit"))
            decode = progs["decode"]
            row = dict(shape=shape, batch=batch, block=block, context=context, tau=tau,
                       programs={k: dataclasses.asdict(p) for k, p in progs.items()},
                       decode_bytes=plain_bytes, verify_bytes=verify_bytes,
                       verify_over_decode_bytes=verify_bytes / plain_bytes,
                       roofline_decode_bytes=roofline.step_cost(tcfg, None, block=1, batch=batch,
                                                                context=context).bytes,
                       roofline_step_bytes=roofline.step_cost(tcfg, dcfg, block=block, batch=batch,
                                                              context=context).bytes,
                       step_bytes=spec, step_flops=spec_flops)
            saving = (_mxfp4_saving(tcfg, batch), _mxfp4_saving(tcfg, batch * block))
            for m in (roofline.H200, roofline.MI355X):
                proj = {}
                for fmt, (plain_b, spec_b) in (("bf16", (plain_bytes, spec)),
                                              ("mxfp4", (plain_bytes - saving[0], spec - saving[1]))):
                    t_plain = max(decode.flops / m.matmul_flops_per_s, plain_b / m.bytes_per_s)
                    t_spec = max(spec_flops / m.matmul_flops_per_s, spec_b / m.bytes_per_s)
                    proj[fmt] = dict(plain_tok_s=batch / t_plain, dflash_tok_s=batch * tau / t_spec,
                                     ceiling=tau * t_plain / t_spec)
                row[m.name.split()[0]] = proj
            rows.append(row)
    return dict(rows=rows, note="report (MI355X, vLLM, 27B, HumanEval, c=1, block 16): 396 tok/s bf16, "
                                "460 tok/s MXFP4; tau 10.377")


def format_report(rep: dict) -> str:
    """Two markdown tables: bytes per program, then projected tokens/s (all rows together)."""
    lines = ["| model | batch | decode GB | verify GB | verify/decode | commit GB | draft GB | step GB "
             "(roofline) | step TFLOP | lower s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        p = {k: v["fused_bytes"] / 1e9 for k, v in r["programs"].items()}
        lower = sum(v["lower_s"] for v in r["programs"].values())
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['decode_bytes'] / 1e9:.2f} | {r['verify_bytes'] / 1e9:.2f} | "
            f"{r['verify_over_decode_bytes']:.3f} | {p['commit']:.2f} | {p['draft'] + p['draft commit']:.2f} | "
            f"{r['step_bytes'] / 1e9:.2f} ({r['roofline_step_bytes'] / 1e9:.2f}) | {r['step_flops'] / 1e12:.2f} | "
            f"{lower:.0f} |")
    lines += ["", f"tokens/s at 100% of peak, tau {rep['rows'][0]['tau']}, plain decoding / DFlash (speed-up):", "",
              "| model | batch | H200 bf16 | H200 MXFP4 | MI355X bf16 | MI355X MXFP4 |", "|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        cells = [f"{r[m][f]['plain_tok_s']:.0f} / {r[m][f]['dflash_tok_s']:.0f} ({r[m][f]['ceiling']:.1f}x)"
                 for m in ("H200", "MI355X") for f in ("bf16", "mxfp4")]
        lines.append(f"| {r['shape']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
