"""The README's claim about the size of the core holds: the folders it names hold about the
number of lines it states (within 5%), so the claim is updated when the code grows or shrinks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ("mili/engine/", "services/", "mili/rpc/")


def _lines(folder: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in sorted((ROOT / folder).rglob("*.py")))


def _claim(readme: str) -> tuple[str, int]:
    found = re.search(r"the core,(.*?)is about ([\d,]+) lines of Python", readme, re.S)
    assert found, "README.md no longer states the core's size as 'the core, ... is about N lines'"
    return found.group(1), int(found.group(2).replace(",", ""))


def test_the_readme_states_the_size_of_the_core() -> None:
    folders, claimed = _claim((ROOT / "README.md").read_text())
    for folder in CORE:
        assert f"`{folder}`" in folders, f"README's core does not name {folder}"
    actual = sum(_lines(folder) for folder in CORE)
    assert abs(actual - claimed) <= 0.05 * claimed, (
        f"README.md says the core is about {claimed} lines; it is {actual}: update the README"
    )


def test_the_check_can_fail() -> None:
    _, claimed = _claim("the core, the engine (`mili/engine/`), is about 1,000 lines of Python")
    assert claimed == 1000
    actual = sum(_lines(folder) for folder in CORE)
    assert abs(actual - claimed) > 0.05 * claimed
