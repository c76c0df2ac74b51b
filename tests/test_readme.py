"""README's "From Python" example runs exactly as written, on the shipped small models.

The code block is read from README.md and executed unchanged: tokenizer in, text out. The checks are on
what it leaves behind: the first completion equals plain decoding's, and the jitted ``make_generate``
run agrees with ``generate`` on the same prompts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_jax.frontend import ASSETS

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## From Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under '## From Python'"
    return match.group(1)


def test_readme_is_short_and_starts_with_what_it_is():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    assert "speculative decoding" in " ".join(lines[:4])


@pytest.mark.skipif(not (ASSETS / "drafter" / "config.json").exists(), reason="shipped assets absent")
def test_from_python_example_runs_as_written(capsys):
    scope: dict = {}
    exec(compile(_example(), "README.md:From Python", "exec"), scope)
    printed = capsys.readouterr().out
    generate, target, prompts, tokenizer = (scope[k] for k in ("generate", "target", "prompts", "tokenizer"))
    plain = generate(target, prompts, max_new_tokens=48)
    assert tokenizer.decode(plain.token_lists()[0]) in printed  # the greedy completion it printed
    jitted = [row[:16] for row in scope["out"].token_lists()]
    short = generate(target, prompts, max_new_tokens=16, stop_ids=()).token_lists()
    assert all(j == s[:len(j)] for j, s in zip(jitted, short, strict=True))


def test_the_docs_name_commands_as_they_are_now():
    """Every ``dflash-jax COMMAND`` in README, BUILD.md, docs/ and the model card is a command of today's grouping
    (``report quant``, ``train drafter``), not a flat name of the previous release."""
    from dflash_jax import cli

    root = README.parent
    stale = []
    for path in [README, root / "BUILD.md", *sorted((root / "docs").glob("*.md")), ASSETS / "MODEL_CARD.md"]:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for match in re.finditer(r"dflash-jax ([a-z][\w-]*)(?: ([a-z][\w-]*))?", line):
                command, member = match.groups()
                ok = command in cli.COMMANDS and (command not in cli.GROUPS or member in cli.GROUPS[command]
                                                  or member is None)
                if not ok:
                    stale.append(f"{path.name}:{line_no}: {match.group(0)}")
    assert not stale, "\n".join(stale)


def test_build_md_cpu_block_installs_what_the_readme_installs():
    """A newcomer who follows BUILD.md's CPU block gets what README's two commands install (z-lab's dflash too)."""
    readme = README.read_text()
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    installs = {" ".join(p.split()) for line in first.splitlines() for p in line.split("&&") if "pip install" in p}
    build = (README.parent / "BUILD.md").read_text()
    cpu = re.search(r"## CPU.*?```bash\n(.*?)```", build, re.S).group(1)
    lines = {" ".join(line.split("#")[0].split()) for line in cpu.splitlines()}
    assert installs and installs <= lines, installs - lines


def test_the_readme_command_table_lists_every_command_in_the_help_order():
    from dflash_jax import cli

    rows = re.findall(r"^\| `dflash-jax (\w+)(?: \{([\w,-]+)\})?", README.read_text(), re.M)
    assert [name for name, _ in rows] == list(cli.COMMANDS)
    assert {name: members.split(",") for name, members in rows if members} == {
        group: list(table) for group, table in cli.GROUPS.items()}
