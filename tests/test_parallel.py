"""Sharded decoding on 8 simulated CPU devices: token-for-token equal to one device, no gathered weights.

The cases run in ONE subprocess (``python tests/test_parallel.py CASES``) started with
``--xla_force_host_platform_device_count=8``, so the rest of the suite keeps a single device. The
worker builds tiny dense and MoE targets (random weights; head counts chosen so some axes shard and
some fall back to replicated), a DFlash drafter and the MTP head, and compares greedy outputs of plain,
DFlash and MTP decoding on (data x model x expert) meshes with the single-device outputs. It checks
the compiled program (prefill + the decode loop) for all-gathers of whole or partly gathered weights,
caches or logits, and, where the model axis divides the GDN key heads, for any all-gather or
collective-permute of the GDN channels in the decode steps (``gdn_moves``); and that a checkpoint
loaded onto a mesh equals the one loaded on one device.
"pallas" cases run the Pallas kernels (interpreted on a CPU: ``pallas_mode``) on the mesh, each in
``shard_map`` over its rows and heads (``dflash_jax/kernels/dispatch.per_head``), against the same kernels on one
device; "kernels" cases do the same for each per-head kernel alone, on inputs in the table's layout,
and check that the compiled program moves nothing. The fast set is two decode cases, one load and
the kernels on two meshes (1x8: KV and key heads sliced per device; 2x2x2: both split); the full
matrix, with the decode loops on Pallas kernels, is ``slow``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pallas_mode import MODE

VOCAB = 160  # divisible by 8, and no other dimension of the tiny models has this size
# Two layers (one Gated DeltaNet, one full attention) and the MTP layer: the smallest target with every
# layer kind. KV heads 2: replicated on a model axis of 4 or 8, sharded on 2.
DENSE = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=VOCAB, hidden_size=32,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
             intermediate_size=64, mtp_num_hidden_layers=1, full_attention_interval=2,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
MOE = dict(DENSE, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", intermediate_size=0,
           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
MESHES = ((1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1))  # (data, model, expert)
EXPERT_MESHES = ((1, 1, 8), (2, 2, 2))  # MoE only: experts over the expert axis (with the model axis)
METHODS = ("plain", "dflash", "mtp")
PROMPT_LENS = (5, 12, 1, 9, 3, 16, 7, 2)  # 8 rows: every data-parallel size divides them
MAX_NEW = 8
FAST_TIMEOUT, FULL_TIMEOUT = 900, 3600  # seconds; the worker's progress is shown when one is exceeded


# ---------------------------------------------------------------------------------------------- worker


def _setup(kind: str):
    """(target with an MTP head, drafter, prompts, lengths): deterministic, f32."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax.config import DrafterConfig, TargetConfig
    from dflash_jax.decoding.api import pad_prompts
    from dflash_jax.models.drafter import init_drafter
    from dflash_jax.models.target import init_target

    target = init_target(TargetConfig.from_hf(DENSE if kind == "dense" else MOE), dtype=jnp.float32, mtp=True)
    # Spread the logits (random init leaves them ~0.1 apart): greedy choices then never hinge on
    # rounding differences between a sharded and an unsharded reduction.
    flat = [(p, v.replace(v.get_value() * 30)) if p == ("lm_head", "weight") else (p, v)
            for p, v in nnx.to_flat_state(target.params)]
    target = dataclasses.replace(target, params=nnx.from_flat_state(flat))
    cfg = DrafterConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=16, intermediate_size=64, vocab_size=VOCAB, block_size=4, mask_token_id=VOCAB - 1,
                        target_layer_ids=(0, 1), num_target_layers=2, rope_theta=10000.0)
    drafter = init_drafter(cfg, dtype=jnp.float32, seed=1)
    rng = np.random.default_rng(0)
    tokens, lengths = pad_prompts([rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS], 16)
    return target, drafter, tokens, lengths


def _method(method: str, target, drafter):
    """(proposer, proposer params, block size)."""
    from dflash_jax.decoding.mtp import MTPProposer, mtp_params
    from dflash_jax.decoding.proposers import DFlashProposer, NoProposer

    if method == "plain":
        return NoProposer(), (), 1
    if method == "dflash":
        return DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params, 4
    return MTPProposer.of(target, 3), mtp_params(target), 4


def _mesh(shape):
    from dflash_jax import parallel

    return parallel.make_mesh(**dict(zip(("data", "model", "expert"), shape, strict=True)))


def _generate(kind, method, mesh_shape, models, refs, hlo: bool, kernels: str = "reference"):
    """Greedy tokens on the mesh vs one device (both in kernel mode ``kernels``); with ``hlo``, the
    compiled program's gathers too."""
    import jax
    import numpy as np

    from dflash_jax import parallel
    from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop
    from dflash_jax.perf import sharding_report

    target, drafter, tokens, lengths = models[kind]
    target, drafter = target.with_kernels(kernels), drafter.with_kernels(kernels)
    proposer, pparams, block = _method(method, target, drafter)
    spec = SpecConfig(block_size=block, max_new_tokens=MAX_NEW, stop_ids=())
    if (kind, method, kernels) not in refs:
        loop = SpeculativeLoop.of(target, proposer, spec)
        refs[kind, method, kernels] = np.asarray(loop.run((target.params, pparams), tokens, lengths, 0).tokens)
    mesh = _mesh(mesh_shape)
    loop = SpeculativeLoop.of(target, proposer, spec, mesh)
    params = parallel.shard_params((target.params, pparams), mesh, target.cfg, proposer)
    rows = parallel.shard_rows(mesh, tokens, lengths)
    compiled = SpeculativeLoop.run.lower(loop, params, *rows, 0).compile()  # one compile: run and inspect
    got = np.asarray(compiled(params, *rows, 0).tokens)
    want = refs[kind, method, kernels]
    out = {"equal": bool((got == want).all()), "got": got.tolist(), "want": want.tolist()}
    if hlo:
        state = jax.eval_shape(lambda: loop.init(params, *rows, 0))
        state_sh = parallel.state_shardings(state, len(lengths), *parallel.layouts(mesh, target.cfg, proposer))
        text = compiled.as_text()
        out["violations"] = gathered(text, params, state, state_sh)
        out["gdn_moves"] = gdn_moves(text, target.cfg, mesh_shape[1], block)
        out["collectives"] = len(sharding_report.collectives(text))
    jax.clear_caches()
    return out


def gathered(hlo: str, params, state, state_sh) -> list[str]:
    """All-gathers in ``hlo`` that rebuild a sharded weight or cache (whole, or along any of its sharded
    axes) or logits (any array with a vocabulary-sized dimension), and, in the decode steps (not the
    prefill, which runs once), a whole replicated cache: the partitioner split it and gathers it back."""
    import jax

    from dflash_jax.perf import sharding_report

    leaves = [(x.shape, x.sharding) for x in jax.tree.leaves(params)]
    leaves += [(x.shape, s) for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(state_sh), strict=True)]
    per_step = {tuple(x.shape) for x in jax.tree.leaves(state) if x.ndim >= 3}  # caches [B, S | Hv | K-1, ...]
    banned = set()
    for shape, s in leaves:
        if s.is_fully_replicated:
            continue
        local = s.shard_shape(shape)
        split = [i for i, (a, b) in enumerate(zip(shape, local, strict=True)) if a != b]
        for r in range(1, len(split) + 1):
            for dims in itertools.combinations(split, r):
                banned.add(tuple(shape[i] if i in dims else local[i] for i in range(len(shape))))
    bad = []
    for c in sharding_report.collectives(hlo):
        in_step = "jit(init)" not in c["name"]
        if c["op"] == "all-gather" and any(s in banned or VOCAB in s or (in_step and s in per_step)
                                           for s in c["shapes"]):
            bad.append(f"{c['shapes']} {c['name']}")
    return bad


def gdn_moves(hlo: str, cfg, model: int, block: int) -> list[str]:
    """All-gathers and collective-permutes in the decode steps of a Gated DeltaNet channel array: [rows, n, c]
    with n the verify block or the conv window (K-1) and c the channel axis C or its q / k / v part (Hk*Dk,
    Hv*Dv), whole or one model shard's share: the conv inputs and outputs, their q / k / v slices, the window.

    A check by shape alone (the HLO names no array): it misses a move of those channels in another shape
    (split into heads [rows, n, h, d], flattened, or a rank other than 3), and it would also flag an unrelated
    array whose shape happens to match."""
    from dflash_jax.perf import sharding_report

    whole = (cfg.conv_dim, cfg.linear_key_dim, cfg.linear_value_dim)
    channels = set(whole) | {c // model for c in whole}
    return [f"{c['op']} {c['shapes']} {c['name']}" for c in sharding_report.collectives(hlo)
            if c["op"] in ("all-gather", "collective-permute") and "jit(init)" not in c["name"]
            and any(len(s) == 3 and s[1] in (block, cfg.linear_conv_kernel_dim - 1) and s[2] in channels
                    for s in c["shapes"])]


def _load(kind, mesh_shape, tmp: Path):
    """Writes an HF-layout checkpoint of the tiny target and loads it on one device and on a mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash_jax import parallel
    from dflash_jax.config import TargetConfig
    from dflash_jax.io import checkpoint
    from dflash_jax.models.layers import hf_tensors
    from dflash_jax.models.target import init_target, load_target

    path = tmp / f"{kind}_ckpt"
    path.mkdir(parents=True, exist_ok=True)
    raw = DENSE if kind == "dense" else MOE
    (path / "config.json").write_text(json.dumps(raw))
    src = init_target(TargetConfig.from_hf(raw), dtype=jnp.float32, mtp=True, seed=3)
    checkpoint.write_safetensors(path / "model.safetensors", dict(hf_tensors(src.cfg, src.params)))
    mesh = _mesh(mesh_shape)
    one = load_target(path, dtype=jnp.float32, progress=False)
    many = load_target(path, dtype=jnp.float32, progress=False, mesh=mesh)
    want = parallel.param_shardings(many.params, parallel.Layout.of(many.cfg, mesh))
    problems = []
    for (p, a), b, s in zip(nnx.to_flat_state(one.params), jax.tree.leaves(many.params),
                            jax.tree.leaves(want), strict=True):
        key = ".".join(map(str, p))
        if not np.array_equal(np.asarray(a.get_value()), np.asarray(b)):
            problems.append(f"{key}: values differ")
        if not b.sharding.is_equivalent_to(s, b.ndim):
            problems.append(f"{key}: sharding {b.sharding.spec}, expected {s.spec}")
        shard = s.shard_shape(b.shape)
        if any(x.data.shape != shard for x in b.addressable_shards):
            problems.append(f"{key}: a device holds more than its shard {shard}")
    sharded = [".".join(map(str, p)) for (p, _), s in zip(nnx.to_flat_state(one.params), jax.tree.leaves(want),
                                                            strict=True) if not s.is_fully_replicated]
    return {"problems": problems, "sharded": sharded}


def _kernels(mesh_shape) -> dict:
    """Each per-head Pallas kernel (interpreted) on the mesh, its inputs laid out by the table, against
    the same kernel on one device: the largest difference, and the collectives of the compiled program."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax import kernels, parallel
    from dflash_jax.perf import sharding_report

    r = np.random.default_rng(0)
    B, T, S, N, K, H, Hk, Hv, Dk = 8, 3, 24, 8, 2, 16, 4, 8, 8  # KV 2 and key heads 4: sliced at model 8

    def normal(*shape):
        return jnp.asarray(r.normal(size=shape), jnp.float32)

    g = -jnp.abs(normal(B, T, Hv))
    args = dict(q=normal(B, T, N, H), k=normal(B, K, S, H), v=normal(B, K, H, S),
                start=jnp.asarray(r.integers(0, S - T, B), jnp.int32), gq=normal(B, T, Hk, Dk),
                gk=normal(B, T, Hk, Dk) * 0.3, gv=normal(B, T, Hv, Dk), g=g, beta=jax.nn.sigmoid(g),
                state=normal(B, Hv, Dk, Dk), n=jnp.asarray(r.integers(0, T + 1, B), jnp.int32))
    axes = dict(q=("batch", None, "heads", None), k=("batch", "kv_heads", None, None),
                v=("batch", "kv_heads", None, None), start=("batch",), gq=("batch", None, "k_heads", None),
                gk=("batch", None, "k_heads", None), gv=("batch", None, "v_heads", None),
                g=("batch", None, "v_heads"), beta=("batch", None, "v_heads"),
                state=("batch", "v_heads", None, None), n=("batch",))

    from dflash_jax.models import layers as L  # the models' kernel calls: per device on a mesh

    def run(a):
        def gdn(fn, xs, labels, out):
            return L._gdn(lambda *x: fn(*x, impl=MODE), MODE, xs, labels, out, a["gk"], a["gv"])

        qk, v, gate, st = L._QK, L._V, L._GATE, L._STATE
        return (L.attention(a["q"], a["k"], a["v"], a["start"], a["start"] + T, causal=True, mode=MODE),
                gdn(kernels.gdn_verify, (a["gq"], a["gk"], a["gv"], a["g"], a["beta"], a["state"]),
                    (qk, qk, v, gate, gate, st), (v, v)),
                gdn(kernels.gdn_replay, (a["gk"], a["gv"], a["g"], a["state"], a["n"]), (qk, v, gate, st, ("B",)), st),
                gdn(kernels.gdn_chunked, (a["gq"], a["gk"], a["gv"], a["g"], a["beta"], a["state"]),
                    (qk, qk, v, gate, gate, st), (v, st)))

    want = jax.jit(run)(args)
    mesh = _mesh(mesh_shape)
    layout = parallel.Layout(mesh, {"heads": N, "kv_heads": K, "v_heads": Hv, "k_heads": Hk})
    placed = {name: jax.device_put(x, layout.sharding(axes[name], x.shape)) for name, x in args.items()}

    @jax.jit
    def sharded(a):
        with parallel.mesh_context(mesh):
            return run(a)

    compiled = sharded.lower(placed).compile()
    got = compiled(placed)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                                             strict=True))
    jax.clear_caches()
    return {"diff": diff, "collectives": [c["op"] for c in sharding_report.collectives(compiled.as_text())]}


def worker(cases: list[list], tmp: str) -> dict:
    import jax

    assert jax.device_count() == 8, jax.devices()
    models, refs, results = {}, {}, {}
    for case in cases:
        start = time.perf_counter()
        name = _case_name(case)
        what, kind = case[0], case[1]
        if kind not in models and what != "kernels":
            models[kind] = _setup(kind)
        if what == "load":
            results[name] = _load(kind, tuple(case[2]), Path(tmp))
        elif what == "kernels":
            results[name] = _kernels(tuple(case[2]))
        else:  # "pallas": the Pallas kernels (interpreted on CPU), run per device (dflash_jax/kernels/dispatch.py)
            results[name] = _generate(kind, case[2], tuple(case[3]), models, refs, hlo=what != "gen",
                                      kernels=MODE if what == "pallas" else "reference")
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
    return results


# ------------------------------------------------------------------------------------------------ tests


def run_worker(cases, tmp_path, timeout: float) -> dict:
    """Runs the cases in the 8-device subprocess; its progress (one line per case) goes to worker.log."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    log = Path(tmp_path) / "worker.log"
    with log.open("w") as err:
        try:
            proc = subprocess.run([sys.executable, __file__, json.dumps(cases), str(tmp_path)], env=env,
                                  stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the 8-device worker did not finish {len(cases)} cases in {timeout:.0f} s (a loaded "
                        f"machine, or a hang); {log}:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, f"the 8-device worker failed ({log}):\n{log.read_text()[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _case_name(case) -> str:
    return "/".join("x".join(map(str, c)) if isinstance(c, list) else str(c) for c in case)


FAST = [["hlo", "dense", "dflash", [2, 4, 1]], ["hlo", "moe", "mtp", [1, 2, 4]], ["load", "moe", [2, 2, 2]],
        ["kernels", "pallas", [1, 8, 1]], ["kernels", "pallas", [2, 2, 2]]]
# Every (kind, method) on one mesh, the meshes rotating so that each runs with every method: the (1, 8, 1) and
# (2, 4, 1) ones also check the compiled program's gathers (at model 4 the GDN channels shard: 4 key heads).
FULL = ([["hlo" if mesh in ((1, 8, 1), (2, 4, 1)) else "gen", kind, method, list(mesh)]
         for k, kind in enumerate(("dense", "moe")) for m, method in enumerate(METHODS)
         for mesh in [MESHES[(2 * k + m) % len(MESHES)]]]
        + [["gen", "moe", method, list(mesh)] for method, mesh in zip(("plain", "dflash"), EXPERT_MESHES, strict=True)]
        + [["load", "dense", [1, 8, 1]], ["load", "moe", [4, 2, 1]]]
        + [["pallas", "dense", "dflash", [1, 8, 1]], ["pallas", "dense", "mtp", [2, 4, 1]],
           ["pallas", "moe", "plain", [2, 2, 2]]])


def _check(case, result):
    if case[0] == "kernels":  # per device, on inputs already in the table's layout: nothing moves
        assert result["diff"] <= 1e-6, result
        assert not result["collectives"], result
        return
    if case[0] == "load":
        assert not result["problems"], result["problems"]
        # the big matrices split: embedding, LM head, attention, GDN value heads (and experts: MoE)
        assert any("embed_tokens" in k for k in result["sharded"]), result["sharded"]
        assert any("q_proj" in k for k in result["sharded"]), result["sharded"]
        if case[1] == "moe":
            assert any("experts" in k for k in result["sharded"]), result["sharded"]
        if DENSE["linear_num_key_heads"] % case[2][1] == 0:  # and the GDN channels, by key-head groups
            assert {"model.layers.0.linear_attn.in_proj_qkv.weight",
                    "model.layers.0.linear_attn.conv1d.weight"} <= set(result["sharded"]), result["sharded"]
        return
    assert result["equal"], f"{_case_name(case)}: sharded {result['got']} != single-device {result['want']}"
    if case[0] == "hlo":
        assert not result["violations"], result["violations"]
        assert result["collectives"] > 0  # the program is partitioned, not replicated
        if DENSE["linear_num_key_heads"] % case[3][1] == 0:  # GDN channels sharded by key-head groups
            assert not result["gdn_moves"], result["gdn_moves"]


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return run_worker(FAST, tmp_path_factory.mktemp("sharding"), FAST_TIMEOUT)


@pytest.mark.parametrize("case", FAST, ids=_case_name)
def test_sharded_fast(fast, case):
    _check(case, fast[_case_name(case)])


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    return run_worker(FULL, tmp_path_factory.mktemp("sharding_full"), FULL_TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL, ids=_case_name)
def test_sharded_full(full, case):
    _check(case, full[_case_name(case)])


def test_mesh_size_must_match_devices():
    from dflash_jax import parallel

    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        parallel.make_mesh(model=3)


# The parameters each shards at the real shapes (suffix after the layer index; an MXFP4 ``*_scale`` follows its
# weight), written out by hand from the path table that the axes declared beside the weights replaced: the
# expectation below equals that table's result for every parameter of these models (computed once, at full depth).
_COLUMN = ("embed_tokens.weight", "lm_head.weight", "self_attn.q_proj.weight", "linear_attn.in_proj_qkv.weight",
           "linear_attn.in_proj_z.weight", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.shared_expert.gate_proj.weight",
           "mlp.shared_expert.up_proj.weight")  # ("model", None)
_ROW = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight",
        "mlp.shared_expert.down_proj.weight")  # (None, "model")
_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")  # ("model", None) where the model axis divides K


def _expected_spec(key: str, ndim: int, kv_split: bool, experts) -> tuple:
    import re

    suffix = re.sub(r"^(model\.|mtp\.)?(layers\.\d+\.)?", "", key).removesuffix("_scale")
    if suffix in _COLUMN or (kv_split and suffix in _KV):
        return ("model", None)
    if suffix in _ROW:
        return (None, "model")
    if suffix in ("linear_attn.A_log", "linear_attn.dt_bias"):
        return ("model",)
    if suffix == "linear_attn.conv1d.weight":
        return ("model", None, None)
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return (experts, None, None)
    return (None,) * ndim  # norms, the MoE router and shared-expert gate, the drafter's and the MTP head's fc


@pytest.mark.parametrize("name", ["27b", "35b-a3b"])
def test_real_shapes_layout_from_declared_axes(name):
    """Every parameter of the real-shape targets (dense and MXFP4, with the MTP head) and drafters on a TP=8 mesh
    and a TP=4 x EP=2 one gets the spec its declared logical axes give (abstract: no devices needed). Four
    decoder layers (three GDN, one attention: every layer kind) stand for all of them: the specs do not depend
    on the depth."""
    from jax.sharding import AbstractMesh

    from dflash_jax import parallel
    from dflash_jax.io import checkpoint
    from dflash_jax.models import quant
    from dflash_jax.perf import synthetic

    target_json, drafter_json = synthetic.REAL_SHAPES[name]
    dense = synthetic.abstract_target(dict(target_json, num_hidden_layers=4), mtp=True)
    models = {"dense": dense, "mxfp4": quant.convert(dense, True), "drafter": synthetic.abstract_drafter(drafter_json)}
    assert any(k.endswith("_scale") for k in parallel.axes_by_key(models["mxfp4"].params))
    for shape in ((1, 8, 1), (1, 4, 2)):
        mesh = AbstractMesh(shape, parallel.AXES)
        experts = "model" if shape[2] == 1 else ("model", "expert")
        for kind, model in models.items():
            shardings = parallel.param_shardings(model.params, parallel.Layout.of(model.cfg, mesh))
            kv_split = model.cfg.num_key_value_heads % shape[1] == 0
            for key, sharding, _ in checkpoint.param_tensors(shardings):  # an MXFP4 weight: codes, then scales
                spec = tuple(sharding.spec)
                assert spec == _expected_spec(key, len(spec), kv_split, experts), (name, kind, shape, key)


def test_real_shapes_replicated_axes():
    """``Layout.replicated`` at the real shapes: 27B's 4 KV heads on TP=8, its 16 GDN key-head groups on TP=32."""
    from jax.sharding import AbstractMesh

    from dflash_jax import parallel
    from dflash_jax.config import TargetConfig
    from dflash_jax.perf import synthetic

    cfg = TargetConfig.from_hf(synthetic.REAL_SHAPES["27b"][0])
    tp8 = parallel.Layout.of(cfg, AbstractMesh((1, 8, 1), parallel.AXES))
    assert tp8.replicated() == ["kv_heads (4) replicated: not divisible by the model axis (8)"]
    wide = parallel.Layout.of(cfg, AbstractMesh((1, 32, 1), parallel.AXES))
    assert "gdn_channels (16) replicated: not divisible by the model axis (32)" in wide.replicated()
    assert wide.spec(("gdn_channels", None), (10240, 5120)) == parallel.P(None, None)
    assert tp8.spec(("gdn_channels", None), (10240, 5120)) == parallel.P("model", None)


def test_one_device_mesh_is_the_plain_loop():
    """A 1x1x1 mesh runs the same program as no mesh: the tokens are identical."""
    import jax.numpy as jnp

    from dflash_jax import parallel
    from dflash_jax.config import TargetConfig
    from dflash_jax.decoding.api import generate
    from dflash_jax.models.target import init_target

    target = init_target(TargetConfig.from_hf(DENSE), dtype=jnp.float32)
    prompts = [[1, 2, 3], [4, 5]]
    want = generate(target, prompts, max_new_tokens=4, stop_ids=()).token_lists()
    got = generate(target, prompts, max_new_tokens=4, stop_ids=(), mesh=parallel.make_mesh()).token_lists()
    assert got == want


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]), sys.argv[2])))
