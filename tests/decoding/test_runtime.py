"""``decoding/runtime.py``: libtpu's options for the loop's programs."""

from __future__ import annotations

from dflash_jax.decoding import runtime


def test_the_tpu_xla_flags_join_libtpu_init_args_unless_the_user_named_them():
    environ = {}
    assert runtime.use_tpu_xla_flags(environ) == ["--xla_msa_max_outstanding_prefetches=0"]
    assert environ["LIBTPU_INIT_ARGS"] == "--xla_msa_max_outstanding_prefetches=0"
    assert runtime.use_tpu_xla_flags(environ) == [] and environ["LIBTPU_INIT_ARGS"].count("prefetches") == 1
    mine = {"LIBTPU_INIT_ARGS": "--xla_tpu_foo=1 --xla_msa_max_outstanding_prefetches=-1"}
    assert runtime.use_tpu_xla_flags(mine) == []
    assert mine["LIBTPU_INIT_ARGS"] == "--xla_tpu_foo=1 --xla_msa_max_outstanding_prefetches=-1"
    theirs = {"LIBTPU_INIT_ARGS": "--xla_tpu_foo=1"}
    runtime.use_tpu_xla_flags(theirs)
    assert theirs["LIBTPU_INIT_ARGS"] == "--xla_tpu_foo=1 --xla_msa_max_outstanding_prefetches=0"
