"""The loop's programs as the TPU (or GPU) compiler builds them, on a CPU host: memory, FLOPs, bytes, time per chip.

Where it sits: among the measurement tools, on top of the loop (``SpeculativeLoop``), the sharding tables
(``parallel``) and ``synthetic``'s abstract models. Nothing runs and nothing is allocated: libtpu's compiler
(``jax[tpu]``) is handed compile-only TPU devices of a named topology (``jax.experimental.topologies``), or the
CUDA plugin compile-only GPUs of a target config (``gpu_devices``); each program is lowered from
``jax.ShapeDtypeStruct`` arguments placed on them (one chip, or a tensor-parallel mesh by the project's own
layouts) and compiled. The compiled program reports its per-device memory (``memory_analysis``: arguments,
outputs, aliased, temporaries) and cost (``cost_analysis``: FLOPs, bytes accessed and the TPU compiler's own
``optimal_seconds``; the GPU compiler reports none, and the lowered program's counts stand in). The programs
are the loop's phases at one (batch, block, context): ``decode`` (a plain-decoding step: verify T=1, accept,
commit), ``verify`` (the DFlash check, the target over the block, its state donated as inside ``step``),
``settle`` (accept, commit target and drafter), ``draft``, ``step`` (the three in one), ``loop`` (the on-device
``decode`` while-loop) and ``run`` (prefill and the loop: the whole generate). ``docs/compile.md`` holds the
27B / 35B-A3B table and what departs from the physics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax import parallel
from dflash_jax.decoding import runtime
from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop, tile_capacity
from dflash_jax.decoding.proposers import DFlashProposer, NoProposer, TargetView
from dflash_jax.models.drafter import draft_logits
from dflash_jax.perf import roofline, synthetic

# Memory per chip (bytes) by the compile-only device's ``device_kind`` (the vendors' data sheets).
HBM_BYTES = {"TPU v4": 32 * 2**30, "TPU v5 lite": 16 * 2**30, "TPU v5": 95 * 2**30, "TPU v6 lite": 32 * 2**30,
             "NVIDIA H100": 80e9, "NVIDIA H200": 141e9}
# GPUs the CUDA plugin compiles for without one (``gpu_devices``): published specs, as XLA's
# ``GpuTargetConfigProto`` wants them (SMs, shared memory and registers per SM, clocks, memory, bandwidth).
GPUS = {
    "h100": dict(name="NVIDIA H100", major=9, core_count=132, memory=80e9, bandwidth=3.35e12, l2=50 * 2**20),
    "h200": dict(name="NVIDIA H200", major=9, core_count=132, memory=141e9, bandwidth=4.8e12, l2=50 * 2**20),
}
# The chip names users know (Cloud TPU's) for libtpu's ``device_kind``: a v5p chip calls itself "TPU v5".
CHIP_NAMES = {"TPU v5": "TPU v5p", "TPU v5 lite": "TPU v5e", "TPU v6 lite": "TPU v6e"}
PROGRAMS = ("decode", "verify", "settle", "draft", "step", "loop", "run", "walk")
# The drafters a Qwen3.5 shape is compiled with: its DFlash drafter, or the released DFlash2 settings on its shape.
DRAFTERS = {"dflash": lambda raw: raw, "dflash2": synthetic.dflash2_drafter}
TAU = 10.377  # the report's 27B HumanEval tokens per step at block 16 (MI355X, vLLM)


def tpu_devices(topology: str) -> list:
    """Compile-only TPU devices of ``topology`` (e.g. ``v5p:2x2x1``, ``v5e:2x4``), on a host without a TPU.

    libtpu is told to skip the cloud metadata server (there is none) and to allow other processes that
    loaded it (a JAX process started without ``JAX_PLATFORMS=cpu`` holds its lock file); compile-only
    devices touch no hardware, so neither matters here."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    try:
        return list(topologies.get_topology_desc(topology, platform="tpu").devices)
    except (RuntimeError, ValueError) as e:  # libtpu missing, or a topology it does not know
        raise ValueError(f"--topology {topology}: no compile-only TPU devices ({str(e).splitlines()[0]}); "
                         f"install libtpu (pip install 'jax[tpu]==0.10.2') and name a topology such as "
                         f"v5p:2x2x1, v5e:2x4 or v6e:2x2") from None


def check_tensor_parallel(sizes, devices: list, where: str) -> None:
    """A ValueError naming ``--tp`` for a size whose first chips of ``devices`` form no mesh (more chips than
    there are, or a count JAX's device-mesh builder cannot lay out on the topology, e.g. 3 of a 2x2), or, on a
    TPU, a count that does not divide the topology's chips (libtpu's all-reduce aborts the process on a group of
    6 of 8), listing the sizes that do; checked before any compile."""
    def fits(tp):
        if tp > len(devices) or (devices[0].platform == "tpu" and len(devices) % tp):
            return False
        try:
            parallel.make_mesh(model=tp, devices=devices[:tp])
        except (AssertionError, ValueError, NotImplementedError):  # mesh_utils asserts on a shape it cannot tile
            return False
        return True

    bad = [tp for tp in sizes if not fits(tp)]
    if bad:
        good = [tp for tp in range(1, len(devices) + 1) if fits(tp)]
        raise ValueError(f"--tp {bad[0]}: {where} has {len(devices)} chips, and {bad[0]} of them form no "
                         f"tensor-parallel mesh; use one of {', '.join(map(str, good))}")


def gpu_target_config(gpu: str) -> str:
    """XLA's ``GpuTargetConfigProto`` text for one of ``GPUS`` (Hopper: 228 KiB shared memory per SM, 227 KiB
    per block opted in, 64K registers, 2048 threads per SM, 1.98 GHz boost)."""
    g = GPUS[gpu]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: {g["core_count"]} fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {int(g["bandwidth"])} l2_cache_size: {g["l2"]} clock_rate_ghz: 1.98
  device_memory_size: {int(g["memory"])} registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability {{ major: {g["major"]} }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{g["name"]}"
"""


def gpu_devices(gpu: str, count: int = 1) -> list:
    """Compile-only CUDA devices of one of ``GPUS`` (``count`` on one host), on a host without a GPU: needs
    the CUDA plugin (``jax[cuda12]``; the plugin alone, no CUDA libraries, is enough to compile)."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu}: one of {', '.join(GPUS)}")
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(gpu),
                                                topology=f"1x1x{count}")
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise ValueError(f"--gpu {gpu}: no compile-only CUDA devices ({str(e).splitlines()[0]}); install the "
                         f"CUDA plugin alone, no CUDA libraries or GPU needed: pip install --no-deps "
                         f"jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2 (docs/compile.md)") from None
    return list(topology.devices)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One configuration to compile: abstract target and drafter, devices, tensor parallelism, shapes."""

    shape: str  # a ``synthetic.REAL_SHAPES`` key, or "" for given models
    target: object  # synthetic.abstract_target(...) or a loaded Target
    drafter: object
    devices: tuple
    model: int = 1  # tensor-parallel size (1: one chip)
    batch: int = 1
    block: int = 16
    context: int = 4096  # cache positions the step's tokens attend (capacity: ``capacity``)
    prompt: int = 16  # prompt bucket of the abstract init (its prefill is traced, not compiled)
    tree: int | None = None  # a DDTree budget N: the drafts are a tree of N nodes (depth <= block - 1)

    def __post_init__(self):
        if self.tree is not None and (isinstance(self.tree, bool) or not isinstance(self.tree, int) or self.tree < 1):
            raise ValueError(f"--tree {self.tree}: a tree budget must be an integer >= 1")

    @property
    def width(self) -> int:
        """Target tokens per row of one verify: the block, or the tree's N + 1 nodes."""
        return self.block if self.tree is None else self.tree + 1

    @property
    def capacity(self) -> int:
        """context + 2 x max(block, width), as the loop sizes it on the devices (``loop.tile_capacity``)."""
        return tile_capacity(self.context + 2 * max(self.block, self.width), self.devices[0].platform)


def _placed(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _on(tree, device_sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device_sharding), tree)


# The check phase as it runs inside ``step``: its state donated. Alone (``SpeculativeLoop.check`` does not donate)
# the compiler must copy every K/V cache before writing the block's rows into it, a whole cache's bytes per
# attention layer that the loop never moves.
_DONATED_CHECK = jax.jit(SpeculativeLoop.check, static_argnums=0, donate_argnums=2)
# The draft phase the same way: it writes the block's context rows into the drafter's cache, in place in ``step``.
_DONATED_DRAFT = jax.jit(SpeculativeLoop.draft, static_argnums=0, donate_argnums=2)


@functools.partial(jax.jit, static_argnums=0)
def _selector_walk(proposer: DFlashProposer, params, hidden, logits, anchor):
    """A DFlash2 drafter's greedy candidate-selector walk alone, as ``DFlashProposer.propose`` runs it."""
    return nnx.merge(proposer.graphdef, params).candidate_selector.walk(hidden, logits, anchor, None)[0]


def programs(setup: Setup, names=PROGRAMS) -> dict[str, tuple]:
    """name -> (jitted phase, its abstract arguments, target tokens per row), ready for ``.lower``, for each of
    ``names`` (only what they need is traced). ``walk`` (a DFlash2 drafter's selector walk over the block's
    k = block - 1 draft positions) only for a DFlash2 drafter."""
    s, names = setup, set(names)
    devices = list(s.devices)[:s.model]
    mesh = None if s.model == 1 else parallel.make_mesh(model=s.model, devices=devices)
    one = jax.sharding.SingleDeviceSharding(devices[0])
    max_new = s.capacity - s.prompt - max(s.block, s.width)
    spec = SpecConfig(block_size=s.block, max_new_tokens=max_new, stop_ids=(), capacity=s.capacity,
                      tree_budget=s.tree)
    dflash = DFlashProposer(s.drafter.cfg, s.drafter.graphdef)
    loops = {"plain": SpeculativeLoop.of(s.target, NoProposer(), dataclasses.replace(spec, block_size=1,
                                                                                     tree_budget=None), mesh),
             "dflash": SpeculativeLoop.of(s.target, dflash, spec, mesh)}
    pparams = {"plain": (), "dflash": s.drafter.params}

    def rows(*shapes):  # abstract per-row inputs, on the chip or split over the mesh's data axis
        structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
        if mesh is None:
            return _on(tuple(structs), one)
        return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=parallel.batch_sharding(mesh, x.shape))
                     for x in structs)

    def placed(kind):  # (params, state, prompt rows) of the plain or DFlash loop
        loop, params = loops[kind], (s.target.params, pparams[kind])
        if mesh is None:
            params = _on(params, one)
        else:
            tlay, dlay = parallel.layouts(mesh, s.target.cfg, loop.proposer)
            params = (_placed(params[0], parallel.param_shardings(params[0], tlay)),
                      _placed(params[1], parallel.param_shardings(params[1], dlay or tlay)))
        prompts = rows(((s.batch, s.prompt), jnp.int32), ((s.batch,), jnp.int32))
        if names <= {"walk"}:
            return params, None, prompts
        state = jax.eval_shape(lambda p, t, n: loop.init(p, t, n, 0), params, *prompts)
        if mesh is None:
            state = _on(state, one)
        else:
            state = _placed(state, parallel.state_shardings(state, s.batch, *parallel.layouts(
                mesh, s.target.cfg, loop.proposer)))
        return params, state, prompts

    built = {}
    if "decode" in names:
        built["decode"] = (SpeculativeLoop.step, (loops["plain"], *placed("plain")[:2]), 1)
    if not names - {"decode"}:
        return built
    loop, (params, state, prompts) = loops["dflash"], placed("dflash")
    if "walk" in names and s.drafter.cfg.dflash2:  # inputs as propose has them: hidden [B, k, D], logits [B, k, V]
        hidden = jax.ShapeDtypeStruct((s.batch, s.block - 1, s.drafter.cfg.hidden_size), s.target.dtype)
        logits = jax.eval_shape(lambda t, h: draft_logits(s.drafter.cfg, TargetView.of(t).logits(h)),
                                params[0], hidden)
        walk = rows((hidden.shape, hidden.dtype), (logits.shape, logits.dtype), ((s.batch,), jnp.int32))
        built["walk"] = (_selector_walk, (dflash, params[1], *walk), 0)
    if names <= {"decode", "walk"}:
        return built
    draft = jax.eval_shape(loop.draft, params, state)
    verified = jax.eval_shape(loop.check, params, state, draft) if "settle" in names else None
    if mesh is None:
        draft, verified = _on(draft, one), _on(verified, one)
    return built | {
        "verify": (_DONATED_CHECK, (loop, params, state, draft), s.width),
        "settle": (SpeculativeLoop.settle, (loop, params, state, draft, verified), 0),
        "draft": (_DONATED_DRAFT, (loop, params, state), 0),
        "step": (SpeculativeLoop.step, (loop, params, state), s.width),
        "loop": (SpeculativeLoop.decode, (loop, params, state), s.width),
        "run": (SpeculativeLoop.run, (loop, params, *prompts, 0), s.width),
    }


def lowered_cost(lowered) -> dict:
    """XLA's HLO cost analysis of a lowered program, before fusion (bytes: an upper bound), by the host CPU
    client: ``Lowered.cost_analysis`` asks the target platform's client, which a compile-only device lacks (the
    CUDA plugin without a GPU), and returns nothing. A custom call (a Pallas kernel) counts as nothing."""
    cost = lowered.cost_analysis()
    if cost:
        return cost
    from jax._src.lib import xla_client

    module = lowered.compiler_ir("hlo").as_hlo_module()
    return xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module) or {}


def compile_program(phase, args, compiler_options: dict | None = None) -> dict:
    """Lowers and compiles one phase; its per-device memory and cost as the compiler reports them. Where the
    compiled program has no cost analysis (XLA's GPU compiler through its plugin) FLOPs and bytes are the
    lowered program's (before fusion: bytes are an upper bound) and ``optimal_seconds`` is NaN, as it is where
    the TPU's estimate is not positive (libtpu 0.0.42 charges some ops -1 or -2 s: with XLA's weight prefetching,
    a bincount; docs/compile.md)."""
    start = time.perf_counter()
    with warnings.catch_warnings():  # a phase alone donates the state parts that ``step`` updates in place; those
        # it returns no buffer of the same shape for (check: the caches the commit writes) are simply freed
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        lowered = phase.lower(*args)
        compiled = lowered.compile(compiler_options=compiler_options or None)
    seconds = time.perf_counter() - start
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
    source = "compiled"
    if not cost:
        cost, source = lowered_cost(lowered), "lowered"
    row = dict(argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
               alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
               code_bytes=mem.generated_code_size_in_bytes,
               flops=float(cost.get("flops", math.nan)), bytes_accessed=float(cost.get("bytes accessed", math.nan)),
               optimal_seconds=float(cost.get("optimal_seconds", math.nan)), cost_source=source,
               compile_s=round(seconds, 1))
    if not row["optimal_seconds"] > 0:  # libtpu 0.0.42's estimate with an op it charges a negative time
        row["optimal_seconds"] = math.nan
    # What the chip holds while it runs: inputs, outputs not aliased to a donated input, temporaries.
    row["peak_bytes"] = row["argument_bytes"] + row["output_bytes"] - row["alias_bytes"] + row["temp_bytes"]
    return row


def floor_bytes(setup: Setup, tokens: int) -> float:
    """The target pass's byte floor per chip (``roofline.target_cost``: the weights its tokens meet, the routed
    experts counted as the distinct ones ``tokens`` x batch tokens pick under random routing, K/V over the
    context, the GDN state, the logits)."""
    cost = roofline.target_cost(setup.target.cfg, tokens=tokens, batch=setup.batch, context=setup.context)
    return cost.bytes / setup.model


def physics_flops(setup: Setup, tokens: int) -> float:
    """2 x the target's weights each token meets + attention over the context, per chip (``roofline``)."""
    if tokens == 0:
        return math.nan
    cost = roofline.target_cost(setup.target.cfg, tokens=tokens, batch=setup.batch, context=setup.context)
    return cost.flops / setup.model


def report(setup: Setup, names=PROGRAMS, *, compiler_options: dict | None = None, tau: float = TAU,
           on_row=None) -> list[dict]:
    """One row per compiled program of ``setup`` (``on_row(row)`` as each finishes), then the summary row
    ``ratio``: verify(width) / decode(1) by the compiler's time and projected tokens/s per chip at ``tau``; with
    ``walk`` (a DFlash2 drafter), the selector walk's share of ``step`` and ``draft`` (time, FLOPs, bytes)."""
    device = setup.devices[0]
    if device.platform == "tpu":  # the flags the loop runs with there (``runtime.use_tpu_xla_flags``), yours over them
        compiler_options = {**runtime.TPU_XLA_FLAGS, **(compiler_options or {})}
    hbm = HBM_BYTES.get(device.device_kind)
    head = dict(shape=setup.shape, device=CHIP_NAMES.get(device.device_kind, device.device_kind),
                device_kind=device.device_kind, kernels=setup.target.kernels, chips=setup.model, batch=setup.batch,
                block=setup.block, tree=setup.tree, width=setup.width, context=setup.context,
                capacity=setup.capacity, draft_window=setup.drafter.cfg.draft_window,
                hbm_bytes=hbm, compiler_options=compiler_options or {})
    built = programs(setup, names)
    if "walk" in names and "walk" not in built:
        raise ValueError("--programs walk: the selector walk needs a DFlash2 drafter (--drafter dflash2)")
    rows = {}
    for name in names:
        phase, args, tokens = built[name]
        row = dict(head, program=name, **compile_program(phase, args, compiler_options))
        row["physics_flops"] = physics_flops(setup, tokens)
        row["floor_bytes"] = floor_bytes(setup, tokens) if name in ("decode", "verify") else math.nan
        row["fits"] = None if hbm is None else row["peak_bytes"] <= row["hbm_bytes"]
        rows[name] = row
        if on_row:
            on_row(row)
    out = list(rows.values())
    seconds = {name: row["optimal_seconds"] for name, row in rows.items() if not math.isnan(row["optimal_seconds"])}
    summary = dict(head, program="ratio")
    if "decode" in seconds and "verify" in seconds:
        summary.update(verify_over_decode=seconds["verify"] / seconds["decode"],
                       plain_tok_s_per_chip=setup.batch / seconds["decode"] / setup.model)
        if "step" in seconds:
            summary.update(dflash_tok_s_per_chip=setup.batch * tau / seconds["step"] / setup.model, tau=tau)
    for whole in ("step", "draft"):
        if "walk" in rows and whole in rows:
            walk, of = rows["walk"], rows[whole]
            summary[f"walk_share_of_{whole}"] = {key: walk[key] / of[key] if of[key] else math.nan
                                                  for key in ("optimal_seconds", "flops", "bytes_accessed")}
    if len(summary) > len(head) + 1:
        out.append(summary)
        if on_row:
            on_row(summary)
    return out


def abstract_setup(target_config, drafter_config, devices, *, shape: str = "", kernels: str = "reference",
                   draft_window: int | None = None, **kw) -> Setup:
    """A ``Setup`` of abstract models (bf16) of two configs (as ``synthetic`` takes them: objects, raw
    ``config.json`` dicts or paths); ``draft_window``: ``--draft-window``'s bound on the drafter's context;
    ``kw``: the ``Setup`` fields (model, batch, block, context, prompt)."""
    drafter = synthetic.abstract_drafter(drafter_config, kernels=kernels, window=draft_window)
    return Setup(shape=shape, target=synthetic.abstract_target(target_config, kernels=kernels), drafter=drafter,
                 devices=tuple(devices), **kw)


def real_configs(shape: str, layers: int | None = None, drafter: str = "dflash") -> tuple[dict, dict]:
    """The ``config.json`` dicts of the Qwen3.5 ``shape`` (``synthetic.REAL_SHAPES``) and its DFlash drafter
    (``drafter`` "dflash2": the released DFlash2 drafter of that shape, ``synthetic.dflash2_drafter``); with
    ``layers``, the target's first ``layers`` layers (same layer shapes and pattern; the drafter taps the last
    one in place of deeper ones): a probe whose per-layer costs extrapolate to the whole model."""
    if drafter not in DRAFTERS:
        raise ValueError(f"--drafter {drafter}: one of {', '.join(DRAFTERS)}")
    target, drafter = synthetic.REAL_SHAPES[shape][0], DRAFTERS[drafter](synthetic.REAL_SHAPES[shape][1])
    if layers is None:
        return target, drafter
    if not 1 <= layers <= target["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: {shape} has 1 .. {target['num_hidden_layers']} layers")
    taps = [min(i, layers - 1) for i in drafter["dflash_config"]["target_layer_ids"]]
    dflash = dict(drafter["dflash_config"], target_layer_ids=taps)
    return dict(target, num_hidden_layers=layers), dict(drafter, num_target_layers=layers, dflash_config=dflash)


def real_setup(shape: str, devices, *, layers: int | None = None, drafter: str = "dflash", **kw) -> Setup:
    """``abstract_setup`` of the Qwen3.5 ``shape`` (``synthetic.REAL_SHAPES``) and its DFlash drafter (``layers``,
    ``drafter``: ``real_configs``); the block defaults to the drafter's."""
    target, draft = real_configs(shape, layers, drafter)
    name = (shape if layers is None else f"{shape}/{layers}L") + ("" if drafter == "dflash" else f"+{drafter}")
    kw.setdefault("block", draft.get("block_size", 16))
    return abstract_setup(target, draft, devices, shape=name, **kw)


def format_rows(rows: list[dict]) -> str:
    """A markdown table of ``report`` rows."""
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    lines = ["| model | chip x n | batch | program | args GiB | out GiB | temp GiB | peak / HBM GiB | GFLOP "
             "(/ physics) | GB accessed (/ floor) | optimal ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = f"| {r['shape']} | {r['device']} x {r['chips']} | {r['batch']} "
        if r["program"] == "ratio":
            parts = []
            if "verify_over_decode" in r:
                dflash = r.get("dflash_tok_s_per_chip")
                verify = f"verify({r['width']})" if r.get("tree") is None else f"tree verify({r['width']})"
                parts.append(f"**{verify} / decode(1) = {r['verify_over_decode']:.3f}**; tok/s per chip: plain "
                             f"{r['plain_tok_s_per_chip']:.0f}"
                             + ("" if dflash is None else f", DFlash {dflash:.0f} (tau {r['tau']})"))
            for whole in ("step", "draft"):
                share = r.get(f"walk_share_of_{whole}")
                if share:
                    parts.append(f"**selector walk / {whole} = {100 * share['optimal_seconds']:.2f}%** of the time "
                                 f"({100 * share['flops']:.2f}% FLOPs, {100 * share['bytes_accessed']:.2f}% bytes)")
            lines.append(where + "| " + "; ".join(parts).replace("nan", "–") + " ||||||||")
            continue
        program = r["program"] if r.get("tree") is None or r["program"] == "decode" else \
            f"{r['program']} (tree {r['tree']})"
        hbm = "?" if r["hbm_bytes"] is None else gib(r["hbm_bytes"])
        ratio = "" if math.isnan(r["physics_flops"]) else f" ({r['flops'] / r['physics_flops']:.2f}x)"
        fb = r.get("floor_bytes", math.nan)
        floor = "" if math.isnan(fb) else f" ({r['bytes_accessed'] / fb:.2f}x)"
        lines.append(where + f"| {program} | {gib(r['argument_bytes'])} | {gib(r['output_bytes'])} | "
                     f"{gib(r['temp_bytes'])} | {gib(r['peak_bytes'])} / {hbm} | {r['flops'] / 1e9:.1f}{ratio} | "
                     f"{r['bytes_accessed'] / 1e9:.2f}{floor} | {r['optimal_seconds'] * 1e3:.3f} |".replace("nan", "–"))
    return "\n".join(lines)
