"""The per-op profile of the compiled loop: scopes and matmuls read from real compiled HLO, and the
command end to end on the shipped models (its own process: XLA:CPU's op tracing is a start-up flag)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from dflash_jax.perf import step_profile


@pytest.mark.parametrize("op_name, scope", [
    ("jit(decode)/while/body/jit(step)/jit(check)/jit(verify)/layer1/mul", "check/verify/layer1"),
    ("jit(decode)/while/body/jit(step)/jit(check)/jit(verify)/layer0/jit(silu)/div", "check/verify/layer0"),
    ("jit(decode)/while/body/jit(step)/jit(settle)/jit(_commit)/add", "settle"),
    ("jit(decode)/while/body/jit(step)/jit(settle)/jit(cumsum)/reduce_window_sum", "settle"),
    ("jit(decode)/while/body/jit(step)/jit(draft)/cond/branch_2_fun/slice", "draft"),
    ("jit(decode)/while/cond/eq", "decode"),
])
def test_scope_is_our_named_jits_and_layers(op_name, scope):
    assert step_profile._scope(op_name) == scope


def test_op_table_reads_matmuls_and_scopes_from_compiled_hlo():
    def mlp(x, w1, w2):
        return jnp.tanh(x @ w1) @ w2

    def model_fn(x, w1, w2):
        return jax.jit(mlp)(jnp.sin(x), w1, w2)

    args = (jnp.ones((8, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))
    text = jax.jit(model_fn).lower(*args).compile().as_text()
    table = step_profile.op_table(text)
    matmuls = {op.scope for op in table.values() if op.matmul}
    others = {op.scope for op in table.values() if not op.matmul and not op.control}
    assert sum(op.matmul for op in table.values()) >= 2 and matmuls == {"model_fn/mlp"}  # the two dots
    assert {"model_fn", "model_fn/mlp"} <= others  # sin outside the inner jit, tanh in it


def test_summarize_names_the_missing_flag_when_nothing_was_traced():
    table = {"dot.1": step_profile.Op(scope="draft", matmul=True, control=False)}
    with pytest.raises(RuntimeError, match="xla_cpu_enable_xprof_traceme"):
        step_profile.summarize([{"ph": "X", "name": "PjitFunction(decode)", "dur": 5.0}], table, steps=1)
    p = step_profile.summarize([{"ph": "X", "name": "dot.1", "dur": 6.0}] * 2, table, steps=3)
    assert p.ops == (("dot.1", "draft", True, 4.0, 2 / 3),) and p.by_scope() == [("draft", 2 / 3, 4.0, 0.0)]


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's per-op trace")
def test_command_profiles_the_shipped_loop_by_scope():
    env = {**os.environ, "XLA_FLAGS": ""}  # the command sets its own tracing flag
    out = subprocess.run([sys.executable, "-m", "dflash_jax.cli.step_profile", "--method", "dflash:4",
                          "--max-new-tokens", "12", "--top", "3"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(re.findall(r"^(\S+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+%$", out.stdout, re.M))
    # the shipped target's four layers (three GDN, one attention), the drafter, the commit
    assert {"draft", "settle", *(f"check/verify/layer{i}" for i in range(4))} <= set(rows), out.stdout
    assert all(float(rows[f"check/verify/layer{i}"]) >= 10 for i in range(4))  # ops per step
    assert re.search(r"untraced: [\d.]+ ms per step .*x its matmul floor", out.stdout), out.stdout
