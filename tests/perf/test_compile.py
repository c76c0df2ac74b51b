"""The TPU compiler (libtpu, compile-only devices on this CPU host) builds the loop's programs: the shipped pair's
whole generate (prefill + the on-device loop) for one chip and for a tensor-parallel v5e 2x2 mesh, the compile
CLI, and the cost-model fact that docs/compile.md's FLOPs explanation rests on."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dflash_jax import frontend
from dflash_jax.cli import main
from dflash_jax.decoding import runtime
from dflash_jax.perf import compile_report

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu not installed (the test extra: jax[tpu])")


@pytest.fixture(scope="module")
def v5e():
    return compile_report.tpu_devices("v5e:2x2")


def _shipped(devices, **kw):
    return compile_report.abstract_setup(frontend.ASSETS / "target", frontend.ASSETS / "drafter", devices,
                                         shape="shipped", **dict(batch=2, context=64) | kw)


def _param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_the_shipped_generate_compiles_for_one_chip_and_a_tensor_parallel_mesh(v5e):
    one = _shipped(v5e)
    params = _param_bytes((one.target.params, one.drafter.params))
    (single,) = compile_report.report(one, ("run",))
    assert single["device"] == "TPU v5e" and single["device_kind"] == "TPU v5 lite"  # Cloud TPU's name, libtpu's
    assert single["cost_source"] == "compiled"
    assert params <= single["argument_bytes"] < 2 * params  # the params and the prompts, one copy
    assert single["flops"] > 0 and single["optimal_seconds"] > 0 and single["fits"]
    tp = _shipped(v5e, model=4)
    phase, args, _ = compile_report.programs(tp)["run"]
    compiled = phase.lower(*args).compile()
    assert {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == set(v5e)
    per_chip = compiled.memory_analysis().argument_size_in_bytes
    assert per_chip < 0.6 * single["argument_bytes"]  # the matrices split over 4 chips (norms, KV heads: whole)
    assert "all-reduce" in compiled.as_text()  # row-parallel projections sum their partial products


def test_a_one_row_matmul_costs_five_vector_ops_per_weight_unless_strength_reduction_is_off(v5e):
    """docs/compile.md's first explanation: at one row the compiler turns x @ W into multiply + reduce on the
    vector unit and counts 5 ops per weight (2 converts, a multiply, an add, a rounding); from 2 rows, or
    with the rewrite off, the MXU's 2 per weight. The compiler picks the rewrite because its own time
    estimate is never worse: equal at a 27B MLP matrix (the weights' bytes), better at small ones."""
    one = jax.sharding.SingleDeviceSharding(v5e[0])
    D, F = 5120, 17408  # Qwen3.5-27B's up projection
    w = jax.ShapeDtypeStruct((D, F), jnp.bfloat16, sharding=one)
    costs = {}
    for rows in (1, 2):
        x = jax.ShapeDtypeStruct((rows, D), jnp.bfloat16, sharding=one)
        for off in (False, True):
            options = {"xla_tpu_enable_dot_strength_reduction": False} if off else None
            cost = jax.jit(jnp.matmul).lower(x, w).compile(compiler_options=options).cost_analysis()
            costs[rows, off] = cost["flops"] / (2 * rows * D * F), cost["optimal_seconds"]
    assert costs[1, False][0] == pytest.approx(2.5, rel=1e-3)
    assert costs[1, True][0] == pytest.approx(1.0, rel=1e-3) == costs[2, False][0]
    assert costs[1, True][1] == pytest.approx(costs[1, False][1], rel=0.01)


def test_the_compile_command_writes_rows_and_refuses_an_unknown_topology(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["compile", "--shape", "shipped", "--topology", "v5e:2x2", "--programs", "decode,verify",
                 "--batch", "2", "--context", "64", "--draft-window", "32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["program"] for r in rows] == ["decode", "verify", "ratio"]
    assert rows[0]["draft_window"] == 32 and rows[0]["compiler_options"] == runtime.TPU_XLA_FLAGS
    ratio = rows[-1]
    assert math.isclose(ratio["verify_over_decode"], rows[1]["optimal_seconds"] / rows[0]["optimal_seconds"])
    assert "verify(16) / decode(1)" in capsys.readouterr().out
    assert main(["compile", "--topology", "v9z:2x2"]) == 2
    assert "--topology v9z:2x2: no compile-only TPU devices" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--tp", "3"], "--tp 3: the v5e:2x2 topology has 4 chips, and 3 of them form no tensor-parallel mesh; use one "
                    "of 1, 2, 4"),
    (["--tp", "8"], "--tp 8: the v5e:2x2 topology has 4 chips"),
    (["--tp", "0"], "--tp 0: every value must be >= 1"),
    (["--batch", "1,0"], "--batch 1,0: every value must be >= 1"),
    (["--context", "-5"], "--context -5: must be >= 1"),
    (["--block", "0"], "--block 0: must be >= 1"),
    (["--json", "no/such/dir/rows.json"], "the directory"),
    (["--tree", "16,0"], "--tree 16,0: every budget must be >= 1"),
    (["--tree", "16", "--block", "1"], "--block 1: a tree needs depth block - 1 >= 1"),
    (["--drafter", "dflash2"], "--drafter dflash2: only for --shape 27b or 35b-a3b"),
    (["--programs", "walk"], "--programs walk: the selector walk needs --drafter dflash2"),
    (["--draft-window", "8"], "--draft-window 8: must be >= the drafter's block size 16"),
])
def test_the_compile_command_refuses_bad_flags_in_one_line_before_compiling(flags, message, capsys, monkeypatch,
                                                                            tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compile_report, "report", lambda *a, **k: pytest.fail("compiled before refusing"))
    assert main(["compile", "--shape", "shipped", "--topology", "v5e:2x2", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_tensor_parallel_sizes_the_error_suggests_compile_with_the_mosaic_kernels(capsys, monkeypatch):
    """v5e:2x4: the --tp 3 error suggests the sizes that divide its 8 chips (libtpu's all-reduce aborts the
    process on 6 of 8: refused in one line), and 8 compiles the shipped decode with the TPU kernels (its 4 heads
    split over no 8 chips: the Mosaic kernels run whole on each chip, under shard_map; before, JAX refused to
    partition them automatically)."""
    with monkeypatch.context() as m:
        m.setattr(compile_report, "report", lambda *a, **k: pytest.fail("compiled before refusing"))
        for tp in ("3", "6"):
            assert main(["compile", "--shape", "shipped", "--topology", "v5e:2x4", "--tp", tp]) == 2
            err = capsys.readouterr().err
            assert f"--tp {tp}: the v5e:2x4 topology has 8 chips" in err and "use one of 1, 2, 4, 8\n" in err
    setup = _shipped(compile_report.tpu_devices("v5e:2x4"), model=8, batch=1, kernels="tpu")
    (row,) = compile_report.report(setup, ("decode",))
    assert row["chips"] == 8 and row["kernels"] == "tpu" and row["optimal_seconds"] > 0


def test_the_cuda_error_names_the_plugin_install_docs_compile_gives():
    """Without the CUDA plugin the error gives the install line docs/compile.md gives (the plugin alone)."""
    if importlib.util.find_spec("jax_cuda12_plugin") is not None:
        pytest.skip("the CUDA plugin is installed")
    with pytest.raises(ValueError) as e:
        compile_report.gpu_devices("h200")
    install = "pip install --no-deps jax-cuda12-plugin==0.10.2 jax-cuda12-pjrt==0.10.2"
    assert install in str(e.value)
    assert install in (Path(__file__).parents[2] / "docs" / "compile.md").read_text()


def test_a_program_without_compiled_costs_is_costed_from_its_lowered_hlo_on_the_host():
    """The CUDA plugin's compile-only GPU gives neither a compiled nor a lowered cost analysis (no client): the
    report costs the lowered HLO with the host's CPU client (docs/compile.md's FLOPs and bytes, not "–")."""
    import types

    lowered = jax.jit(jnp.matmul).lower(jnp.zeros((64, 128)), jnp.zeros((128, 256)))
    no_client = types.SimpleNamespace(cost_analysis=lambda: None, compiler_ir=lowered.compiler_ir)
    cost = compile_report.lowered_cost(no_client)
    assert cost["flops"] == 2 * 64 * 128 * 256
    assert cost["bytes accessed"] == 4 * (64 * 128 + 128 * 256 + 64 * 256)


def test_a_27b_shaped_decode_with_four_layers_compiles_for_a_v5p_chip_near_its_byte_floor():
    """Qwen3.5-27B's layer shapes (3 Gated DeltaNet layers and a full-attention one, the vocabulary's embedding and
    LM head) with the TPU kernels: a positive time estimate, and bytes within 1.3x the roofline's floor."""
    v5p = compile_report.tpu_devices("v5p:2x2x1")
    setup = compile_report.real_setup("27b", v5p, layers=4, kernels="tpu", context=1024)
    (row,) = compile_report.report(setup, ("decode",))
    assert row["shape"] == "27b/4L" and row["device"] == "TPU v5p" and row["fits"]
    assert row["optimal_seconds"] > 0
    assert row["floor_bytes"] <= row["bytes_accessed"] <= 1.3 * row["floor_bytes"]


def test_a_35b_a3b_shaped_decode_reads_its_active_floor_with_the_weights_left_where_they_lie():
    """Qwen3.5-35B-A3B's layer shapes, 4 layers, the TPU kernels: the routed experts read only the 8 picked, and
    with libtpu's weight prefetches into VMEM off (``runtime.TPU_XLA_FLAGS``, the report's default on a TPU)
    the decode's bytes are within 1.3x its floor; with XLA's default prefetching they are not."""
    v5p = compile_report.tpu_devices("v5p:2x2x1")
    setup = compile_report.real_setup("35b-a3b", v5p, layers=4, kernels="tpu", context=1024)
    (row,) = compile_report.report(setup, ("decode",))
    assert row["compiler_options"] == runtime.TPU_XLA_FLAGS and row["optimal_seconds"] > 0
    assert row["floor_bytes"] <= row["bytes_accessed"] <= 1.3 * row["floor_bytes"]
    (xla,) = compile_report.report(setup, ("decode",), compiler_options={"xla_msa_max_outstanding_prefetches": -1})
    assert xla["bytes_accessed"] > 1.3 * row["floor_bytes"] and xla["optimal_seconds"] > row["optimal_seconds"]


def test_a_tree_setup_verifies_its_n_plus_one_nodes_in_a_cache_sized_for_them(v5e):
    """``Setup(tree=N)``: the verify program is the loop's tree verify (N + 1 tokens, the draft's tree as parents),
    the cache holds context + 2 x max(block, N + 1) rounded up to 128 (the chain's rule), and it compiles."""
    capacity = lambda **kw: compile_report.Setup(shape="", target=None, drafter=None, devices=v5e, **kw).capacity  # noqa: E731
    assert (capacity(), capacity(tree=16), capacity(tree=64), capacity(tree=128)) == (4224, 4224, 4352, 4480)
    assert capacity(block=8, tree=4, context=100) == 128
    with pytest.raises(ValueError, match="--tree 0: a tree budget must be an integer >= 1"):
        _shipped(v5e, tree=0)
    setup = _shipped(v5e, batch=1, tree=20)
    phase, (loop, _, _, draft), tokens = compile_report.programs(setup)["verify"]
    assert tokens == 21 and loop.spec.tree_budget == 20 and draft.tree.parents.shape == (1, 21)
    (row,) = compile_report.report(setup, ("verify",))
    assert (row["program"], row["tree"], row["width"], row["capacity"]) == ("verify", 20, 21, 128)
    assert row["optimal_seconds"] > 0 and row["flops"] >= row["physics_flops"]  # 21 tokens' worth at least
    ratio = dict(row, program="ratio", verify_over_decode=1.5, plain_tok_s_per_chip=100.0)
    assert "| verify (tree 20) |" in compile_report.format_rows([row])
    assert "**tree verify(21) / decode(1) = 1.500**" in compile_report.format_rows([ratio])


def test_the_dflash2_entry_compiles_the_selector_walk_of_the_released_settings():
    """``--drafter dflash2`` on a 27B shape: the released DFlash2 drafter (block 8, five sliding layers of 2048,
    conv kernel 2, groups of 16, rank 256, top-16); its candidate-selector walk compiles alone (here at a 4096-token
    vocabulary: the 27B's top-k over 248320 logits takes libtpu ~25 s to compile, for the report's rows only)."""
    v5p = compile_report.tpu_devices("v5p:2x2x1")
    target, drafter = compile_report.real_configs("27b", layers=1, drafter="dflash2")
    setup = compile_report.abstract_setup(dict(target, vocab_size=4096), dict(drafter, vocab_size=4096), v5p,
                                          shape="27b/1L+dflash2", kernels="tpu", block=drafter["block_size"])
    cfg = setup.drafter.cfg
    assert setup.block == cfg.block_size == 8 and setup.capacity == 4224
    assert cfg.layer_types == ("sliding_attention",) * 5 and cfg.sliding_window == 2048
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    (walk,) = compile_report.report(setup, ("walk",))
    assert walk["program"] == "walk" and walk["optimal_seconds"] > 0 and walk["flops"] > 0
    phase, (_, _, hidden, logits, anchor), _ = compile_report.programs(setup, ("walk",))["walk"]
    assert (hidden.shape, logits.shape, anchor.shape) == ((1, 7, 5120), (1, 7, 4096), (1,))  # k = block - 1 drafts
    with pytest.raises(ValueError, match="--programs walk: the selector walk needs a DFlash2 drafter"):
        compile_report.report(compile_report.real_setup("27b", v5p, layers=1), ("walk",))
