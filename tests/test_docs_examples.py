"""Examples in the guides that a reader copies as they are: they run, and they say what the page says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import launch, needs_torch

ROOT = Path(__file__).resolve().parent.parent
GUIDES = ROOT / "docs" / "guides"


def python_block_after(page: Path, marker: str) -> str:
    """The first ```python block after the line ``marker`` on ``page``."""
    text = page.read_text()
    start = text.index(marker)
    found = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert found, f"no python block after {marker!r} in {page.name}"
    return found.group(1)


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_complete_script_of_the_migration_guide_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(python_block_after(GUIDES / "horovod-migration.md", "A complete script:"))
    proc = launch(2, [str(script)], timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[0]<stdout>:weights equal on every rank: True" in proc.stdout


def test_the_loggers_the_logging_guide_names_are_the_code_s() -> None:
    """Configuring a logger the page names must reach records: each is one the code logs under."""
    page = (GUIDES / "logging.md").read_text()
    named = set(re.findall(r"`(ringcomm(?:\.[a-z_]+)+)`", page.split("## Turning on")[0]))
    used = set()
    for path in (ROOT / "ringcomm").rglob("*.py"):
        used |= set(re.findall(r'getLogger\("(ringcomm[.a-z_]*)"\)', path.read_text()))
    assert named and named <= used, f"named in logging.md but logged under by no module: {sorted(named - used)}"
