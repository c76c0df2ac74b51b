"""Collectives of one compiled decode step at real shapes, sharded vs one device (abstract params, no weights).

Sits on top of ``parallel.py`` and ``synthetic.py``: it builds the abstract Qwen3.5-27B / 35B-A3B target
and its DFlash drafter (``synthetic.REAL_SHAPES``), places their shapes on a (data, model, expert)
mesh by ``sharding``'s tables, lowers and compiles ``SpeculativeLoop.step`` (draft, verify, accept,
commit: the body of the on-device loop) for that mesh, and counts the collectives in the compiled
HLO (``collectives`` below): per op, how many and the bytes each device receives per step; and
the GiB of parameters and loop state (caches) each device holds.
Needs as many devices as the mesh; on CPU simulate them::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        dflash-jax report sharding --config 27b --tp 1,8 --batch 1,32 --block 16
"""

from __future__ import annotations

import collections
import math
import re
import time

import jax
import jax.numpy as jnp

from dflash_jax import parallel
from dflash_jax.decoding.loop import SpecConfig, SpeculativeLoop
from dflash_jax.decoding.proposers import DFlashProposer, NoProposer
from dflash_jax.perf import perf_model, synthetic


def _placed(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%(?P<name>\S+) = (?P<type>\(.*?\)|\S+) "
                         r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"\b[a-z][a-z0-9]*\[([0-9,]*)\]")


def collectives(hlo: str) -> list[dict]:
    """The collectives in a compiled program's HLO text (``jit(f).lower(...).compile().as_text()``).

    Each: ``op``, result ``shapes`` (per device), result ``bytes`` per device and the JAX op ``name`` it
    came from. Counted as written: one inside a loop body appears once.
    """
    out = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.match(line)
        if not m:
            continue
        name = re.search(r'op_name="([^"]*)"', line)
        out.append({"op": m["op"], "shapes": [tuple(int(d) for d in dims.split(",") if d)
                                              for dims in _ARRAY.findall(m["type"])],
                    "bytes": perf_model.hlo_bytes(m["type"]), "name": name[1] if name else m["name"]})
    return out


def step_collectives(config: str, *, data: int = 1, model: int = 1, expert: int = 1, batch: int = 1,
                     block: int = 16, prompt: int = 512, max_new: int = 256) -> dict:
    """The collectives of one compiled step of the DFlash loop (plain decoding at block 1)."""
    target_raw, drafter_raw = synthetic.REAL_SHAPES[config]
    target = synthetic.abstract_target(target_raw, kernels="reference")
    drafter = synthetic.abstract_drafter(drafter_raw, kernels="reference")
    if block == 1:
        proposer, pparams = NoProposer(), ()
    else:
        proposer, pparams = DFlashProposer(drafter.cfg, drafter.graphdef), drafter.params
    mesh = None if data * model * expert == 1 else parallel.make_mesh(
        data=data, model=model, expert=expert, devices=jax.devices()[:data * model * expert])
    loop = SpeculativeLoop.of(target, proposer, SpecConfig(block_size=block, max_new_tokens=max_new, stop_ids=()),
                              mesh)
    tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    params = (target.params, pparams)
    if mesh is not None:
        tlay, dlay = parallel.layouts(mesh, target.cfg, proposer)
        params = (_placed(target.params, parallel.param_shardings(target.params, tlay)),
                  _placed(pparams, parallel.param_shardings(pparams, dlay or tlay)))
        tokens, lengths = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=parallel.batch_sharding(mesh, x.shape))
                           for x in (tokens, lengths))
    state = jax.eval_shape(lambda p, t, n: loop.init(p, t, n, 0), params, tokens, lengths)
    if mesh is not None:
        state = _placed(state, parallel.state_shardings(state, batch, *parallel.layouts(mesh, target.cfg, proposer)))
    held = dict(params_gib=_per_device(params), state_gib=_per_device(state))
    if mesh is None:  # one device: the program has no collectives to count
        return dict(config=config, mesh=dict(data=1, model=1, expert=1), batch=batch, block=block, collectives=0,
                    bytes_per_device=0, by_op={}, largest=None, per_device=held, compile_s=0.0)
    start = time.perf_counter()
    hlo = SpeculativeLoop.step.lower(loop, params, state).compile().as_text()
    found = collectives(hlo)
    ops = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in found:
        ops[c["op"]]["count"] += 1
        ops[c["op"]]["bytes"] += c["bytes"]
    biggest = max(found, key=lambda c: c["bytes"], default=None)
    return dict(config=config, mesh=dict(data=data, model=model, expert=expert), batch=batch, block=block,
                collectives=len(found), bytes_per_device=sum(c["bytes"] for c in found), by_op=dict(ops),
                largest=None if biggest is None else {k: biggest[k] for k in ("op", "shapes", "bytes")},
                per_device=held, compile_s=round(time.perf_counter() - start, 1))


def _per_device(tree) -> float:
    """GiB one device holds of a tree of ShapeDtypeStructs (its shard of each; whole ones without a sharding)."""
    def one(x):
        shape = x.shape if getattr(x, "sharding", None) is None else x.sharding.shard_shape(x.shape)
        return math.prod(shape) * x.dtype.itemsize
    return round(sum(one(x) for x in jax.tree.leaves(tree)) / 2**30, 3)
