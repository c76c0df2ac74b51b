"""``compile_cache``: the default folder (the environment's, else under the user's cache directory) and JAX's
persistent cache on this backend: a program compiled once is loaded, not compiled, after JAX forgot it (as in a
second process), and ``tally`` counts both."""

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.io import compile_cache


@pytest.mark.parametrize("env, want", [
    ({compile_cache.ENV: "/x/cache"}, "/x/cache"),
    ({compile_cache.ENV: ""}, ""),  # off
    ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/dflash-jax/jax-compilation-cache"),
    ({"HOME": "/home/u"}, "/home/u/.cache/dflash-jax/jax-compilation-cache"),
])
def test_the_default_folder(env, want, monkeypatch):
    for name in (compile_cache.ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert compile_cache.default_dir() == want


@pytest.fixture
def restored():
    """JAX's cache folder as it was before the test (another test's command may have turned it on)."""
    before = jax.config.jax_compilation_cache_dir
    yield
    compile_cache.enable(before or "")


def test_a_program_compiled_once_is_loaded_the_second_time(tmp_path, restored):
    assert compile_cache.enable(tmp_path / "cache") == tmp_path / "cache"

    def program(x):  # [3] -> [3]; a sub-second compile, which JAX alone would not keep
        return jnp.cumsum(jnp.sin(x) * 3.0)

    x = jnp.arange(3.0)
    want = jax.jit(program)(x)
    compiled, loaded = compile_cache.tally()
    assert compiled >= 1 and loaded == 0 and any((tmp_path / "cache").iterdir())
    jax.clear_caches()  # as a new process: JAX's in-memory programs gone
    got = jax.jit(program)(x)
    assert compile_cache.tally() == (compiled, 1)
    assert (got == want).all()
    assert compile_cache.enable("") is None  # off: nothing more is written
    jax.clear_caches()
    written = sorted((tmp_path / "cache").iterdir())
    jax.jit(lambda x: program(x) + 1)(x)
    assert sorted((tmp_path / "cache").iterdir()) == written


def test_a_folder_that_cannot_be_made_names_the_flag(tmp_path, restored):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--compilation-cache-dir .*file/cache: cannot create it"):
        compile_cache.enable(tmp_path / "file" / "cache")
