"""README's "From Python" example runs as written, on the shipped small models.

The code block is read from README.md and run with only what the shipped models force: their paths for
the 27B ones, token ids inside their vocabulary, f32 and shorter outputs (CPU time). Each replacement
must match exactly once, so an edit of the example that these no longer fit fails here, not silently.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_jax.decoding.runtime import ASSETS

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## From Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under '## From Python'"
    return match.group(1)


@pytest.mark.slow  # five compiled loops (~1 min of CPU)
@pytest.mark.skipif(not (ASSETS / "drafter" / "config.json").exists(), reason="shipped assets absent")
def test_from_python_example_runs(capsys):
    code = _example()
    replacements = {
        '"Qwen3.5-27B/"': repr(str(ASSETS / "target")),
        '"Qwen3.5-27B-DFlash/"': repr(str(ASSETS / "drafter")),
        "[[151644, 872, 198], [151644, 77091]]": "[[5, 87, 198], [17, 77]]",
        "jnp.bfloat16": "jnp.float32",
        "max_new_tokens=256": "max_new_tokens=24",
        "max_new_tokens=64": "max_new_tokens=8",
        "SpecConfig(block_size=8)": "SpecConfig(block_size=8, max_new_tokens=8)",
    }
    for old, new in replacements.items():
        assert code.count(old) == 1, f"README example changed: {old!r} occurs {code.count(old)} times"
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md:From Python", "exec"), scope)
    out, target = scope["out"], scope["target"]
    assert out.tokens.shape[0] == 2 and len(out.token_lists()) == 2
    assert len(capsys.readouterr().out.splitlines()) >= 1  # the stream printed its steps
    # The last call (make_generate under jax.jit, greedy) equals plain decoding of the same prompts.
    plain = scope["generate"](target, scope["prompts"], max_new_tokens=8, stop_ids=())
    got = [row[:8] for row in out.token_lists()]
    assert all(g == p[:len(g)] for g, p in zip(got, plain.token_lists(), strict=True))
