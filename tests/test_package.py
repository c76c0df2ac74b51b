"""The package namespace (``dflash_jax/__init__.py``): the public names, and no module hidden behind one."""

from __future__ import annotations

import importlib
import pkgutil
import types

import dflash_jax

PUBLIC = {"generate", "stream", "make_generate", "SpecConfig", "GenerateOutput", "SamplingConfig", "load_target",
          "load_drafter", "Target", "Drafter", "FinishReason"}


def test_public_names_are_exported():
    assert PUBLIC <= set(dflash_jax.__all__)
    assert all(hasattr(dflash_jax, name) for name in dflash_jax.__all__)


def test_no_submodule_is_shadowed_by_a_reexport():
    """``import dflash_jax.X`` and ``dflash_jax.X`` are the same module for every submodule X (a function
    re-exported under a module's name used to hide ``dflash_jax.generate``)."""
    for info in pkgutil.iter_modules(dflash_jax.__path__):
        module = importlib.import_module(f"dflash_jax.{info.name}")
        attr = getattr(dflash_jax, info.name)
        assert isinstance(attr, types.ModuleType) and attr is module, info.name
