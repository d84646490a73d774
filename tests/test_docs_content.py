"""The docs say only what the code and the measurements say: results as JSON match the performance page's
tables, and no page, comment or docstring speaks of how the project was built."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "performance"


def cell(text: str) -> object:
    """A table cell as a JSON value: a plain number becomes a number, anything else stays text."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def tables(markdown: str) -> list[tuple[list[str], list[list[object]]]]:
    """Every pipe table of a Markdown page: (column names, rows of cells)."""
    found, lines, i = [], markdown.splitlines(), 0
    while i + 1 < len(lines):
        if lines[i].startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([cell(c) for c in lines[i].strip().strip("|").split("|")])
                i += 1
            found.append((header, rows))
        else:
            i += 1
    return found


def result_files() -> list[Path]:
    return sorted(p for p in PERF.glob("*.json") if "columns" in json.loads(p.read_text()))


def test_there_are_result_files() -> None:
    assert len(result_files()) >= 5


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.name)
def test_each_result_file_is_a_table_of_the_performance_page(path: Path) -> None:
    data = json.loads(path.read_text())
    assert {"what", "command", "columns", "rows"} <= set(data), sorted(data)
    page = tables((PERF / "index.md").read_text())
    assert (data["columns"], data["rows"]) in [(h, r) for h, r in page], f"{path.name} differs from the page"


# words that mean something only to the people who built the project, not to its readers
PROCESS_WORDS = [r"\bsession \d", r"\bissue #?\d", r"\.\./shared\b", r"\ba later issue\b", r"\bfinal run\b",
                 r"/work/", r"\bthe brief\b"]


def test_no_words_about_how_the_project_was_built() -> None:
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    if files.returncode != 0:
        pytest.skip("not a git checkout (the file list comes from git)")
    hits = []
    for name in files.stdout.splitlines():
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".toml", ".yml", ".txt", ".in", "") or not path.is_file():
            continue
        if name == "tests/test_docs_content.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern in PROCESS_WORDS:
                if re.search(pattern, line, re.IGNORECASE):
                    hits.append(f"{name}:{n}: {line.strip()[:100]}")
    assert hits == [], "\n".join(hits)
