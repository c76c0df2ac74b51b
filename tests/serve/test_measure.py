"""``serve/measure.py``'s decomposition of a gap between tokens (``report serve-prefix stall``): the parts of an
engine's iteration are timed through a stand-in loop, and a gap is split into the parts inside it and the rest."""

import jax.numpy as jnp

from dflash_jax.serve.measure import _Parts, _Timed


class _Loop:
    spec = "spec"

    def extend(self, x):
        return x + 1

    def recent(self, x):
        return x


def test_a_loops_phases_are_timed_and_a_gap_is_split_into_its_parts():
    parts = _Parts()
    loop = _Timed(_Loop(), parts)
    assert loop.spec == "spec" and int(loop.extend(jnp.asarray(1))) == 2 and int(loop.recent(jnp.asarray(5))) == 5
    assert [p for p, *_ in parts.spans] == ["chunk"]  # only the named phases: recent is not one
    parts.spans = [("step", 1.0, 1.03), ("chunk", 1.031, 1.09), ("first token", 1.091, 1.095), ("step", 1.2, 1.3)]
    got = parts.within(0.999, 1.1)  # the second step ends after the gap: not in it
    assert got == {"step": 30.0, "chunk": 59.0, "first token": 4.0, "other": 8.0}
    assert parts.medians(1.0, 1.25) == {"step": 65.0, "chunk": 59.0, "first token": 4.0}
