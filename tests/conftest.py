"""Tiny Qwen3.5 checkpoints written by transformers itself: the oracle every target test compares to.

Also: ``gpu``-marked tests are skipped (with the reason) unless JAX runs on a GPU. torch, when installed,
is imported first (before JAX compiles anything; imported lazily it made XLA's CPU compiler crash); where it
is missing the torch-free tests still run and the oracle fixtures skip themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

# libtpu (in the test extra, for compile-only TPU devices) makes JAX probe for a TPU whenever it picks the
# platforms itself: seconds per process and a screen of errors on a machine without one. The tests name them:
# any installed GPU plugin first (the default backend), then the CPU. Compile-only TPU topologies still work.
if "JAX_PLATFORMS" not in os.environ:
    _gpus = [name for name, plugin in (("cuda", "jax_cuda12_plugin"), ("rocm", "jax_rocm7_plugin"))
             if importlib.util.find_spec(plugin)]
    os.environ["JAX_PLATFORMS"] = ",".join([*_gpus, "cpu"])

# torch (the transformers oracle's backend), when installed, is loaded before JAX compiles anything.
try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError:  # torch-free tests still run; the oracle fixtures skip themselves
    pass

# Tests compile many small programs; LLVM's expensive passes buy nothing at these sizes.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

# The commands' persistent compilation cache (``io/compile_cache.py``; its processes inherit this) is this run's own
# temporary folder, never the user's ~/.cache.
if "DFLASH_JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["DFLASH_JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-jax-test-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["DFLASH_JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


MAX_MAPPINGS = 30_000  # of vm.max_map_count's 65530: a test adds at most a few thousand (~8k a CPU minute)


def _mappings() -> int:
    """This process's memory mappings (0 where there is no /proc: no vm.max_map_count there either)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _release():
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Each test file's compiled programs are dropped when it ends (a file starts with JAX's caches empty).
    Kept alive over the whole suite, their memory mappings (~8k a minute in test_speculative) reach the
    per-process limit (vm.max_map_count, 65530) and XLA's CPU compiler crashed midway through the suite
    in three runs, while every file passes alone. Within a file the programs are shared: dropping them
    after every test (as before) recompiled each eager op per test: test_train_drafter.py +
    test_sampling.py took 64 s of CPU (1304 compilations) that way, 33 s (678) this way."""
    yield
    _release()


@pytest.fixture(autouse=True)
def _release_compiled_programs_past_mappings():
    """...and after any test that leaves the process with more than MAX_MAPPINGS mappings."""
    yield
    if _mappings() > MAX_MAPPINGS:
        _release()


# The files that take longest, longest first (CPU seconds on 2 cores, 2026-12-03; the default run: test_loop.py
# 243, test_bench.py 108, test_cli.py 89, test_parallel.py 69 (its 8-device subprocess), test_engine.py 56;
# with -m slow also test_parallel.py's full matrix 165, test_train_ship.py 232, test_notebooks.py 155). They run
# first, the rest in file order: under xdist (one file per worker at a time, addopts) no worker is left alone
# with one of them at the end, which the file-size order xdist uses by default did (test_train_ship.py ran last).
FIRST = ("test_loop.py", "test_train_ship.py", "test_parallel.py", "test_notebooks.py", "test_bench.py", "test_cli.py",
         "test_engine.py", "test_quant.py", "test_target.py", "test_zlab_client.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: each file keeps its order
    import jax

    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU; JAX runs on {backend}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _torch():
    return pytest.importorskip("torch", reason="the transformers oracle models need torch")

# Hv/Hk = 3 and a GQA group of 6, as in Qwen3.5-27B.
DENSE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=1,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
             linear_value_head_dim=8, intermediate_size=48, rope_parameters=dict(
                 rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
# top-k 2 of 8 experts with a shared expert, as in Qwen3.5-35B-A3B (there: top-8 of 256).
MOE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)


def _perturb(model):
    """Random init leaves every norm weight at its neutral value; perturb them so norms are tested."""
    torch = _torch()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def _build(kind: str):
    _torch().manual_seed(0)
    import transformers

    if kind == "dense":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**DENSE))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**MOE))
    return _perturb(model)


def _saved(kind, tmp_path_factory):
    model = _build(kind)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="session")
def hf_dense(tmp_path_factory):
    return _saved("dense", tmp_path_factory)


@pytest.fixture(scope="session")
def hf_moe(tmp_path_factory):
    return _saved("moe", tmp_path_factory)


@pytest.fixture(scope="session")
def hf_moe_conditional(hf_moe, tmp_path_factory):
    """The MoE model rewritten in the official multimodal layout: nested text_config,
    ``model.language_model.*`` keys, fused experts, and a vision tensor the loader must ignore."""
    import transformers
    from safetensors.torch import save_file

    torch = _torch()
    model, _ = hf_moe
    path = tmp_path_factory.mktemp("moe_vl")
    config = transformers.Qwen3_5MoeConfig(text_config=model.config.to_dict())
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    tensors = {k.replace("model.", "model.language_model.", 1): v.contiguous()
               for k, v in model.state_dict().items()}  # in-memory experts are already fused
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, str(path / "model.safetensors"))
    return model, path
