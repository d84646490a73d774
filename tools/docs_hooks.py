"""mkdocs hooks: reference tables generated from the code at build time, so the docs never drift from it.

A page asks for a table with a marker on a line of its own:

- ``<!-- generated: settings -->``: every tuning setting of :class:`ringcomm.job.config.Settings`
  (``RINGCOMM_<FIELD>``), its default, what it does (the ``#:`` comment above the field) and the
  ``HOROVOD_*`` variable that sets it too (:mod:`ringcomm.job.horovod_env`);
- ``<!-- generated: job-variables -->``: the variables that describe the job rather than tune it
  (``ringcomm.job.config.TOPOLOGY_VARS``);
- ``<!-- generated: errors -->``: the exception tree of :mod:`ringcomm.errors`.

A new field in ``Settings``, a new variable or a new exception appears on the next build.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _field_comments(cls: type) -> dict[str, str]:
    """``{field: text}`` from the ``#:`` comment lines right above each field of ``cls``."""
    path = inspect.getsourcefile(cls)
    assert path is not None
    source = Path(path).read_text().splitlines()
    (node,) = [n for n in ast.walk(ast.parse("\n".join(source)))
               if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    out: dict[str, str] = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            comment: list[str] = []
            i = item.lineno - 2  # the line above the field (0-based)
            while i >= 0 and source[i].strip().startswith("#:"):
                comment.insert(0, source[i].strip()[2:].strip())
                i -= 1
            out[item.target.id] = " ".join(comment)
    return out


def _size(value: int) -> str:
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= n and value % n == 0:
            return f"{value} ({value // n} {unit})"
    return str(value)


def _default(field: dataclasses.Field, name: str) -> str:
    value = field.default
    if isinstance(value, bool):
        return "`1`" if value else "`0`"
    if value == "":
        return "empty"
    if isinstance(value, int) and "bytes" in name or name == "fusion_threshold":
        return f"`{_size(int(value))}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _horovod_names() -> dict[str, list[str]]:
    """``{RINGCOMM_X: [HOROVOD_Y, ...]}``: which Horovod variables set each setting."""
    from ringcomm.job import horovod_env

    out: dict[str, list[str]] = {}
    for name in sorted(set(horovod_env.SAME) | set(horovod_env.TRANSLATED)):
        for target in horovod_env.translate({name: "1"}):
            out.setdefault(target, []).append(name)
    return out


def settings_table() -> str:
    from ringcomm.job.config import Settings

    comments = _field_comments(Settings)
    horovod = _horovod_names()
    rows = ["| variable | default | what it does | also set by |", "|---|---|---|---|"]
    for field in dataclasses.fields(Settings):
        var = "RINGCOMM_" + field.name.upper()
        text = comments.get(field.name) or "(undocumented)"
        also = ", ".join(f"`{h}`" for h in horovod.get(var, [])) or "-"
        rows.append(f"| `{var}` | {_default(field, field.name)} | {_escape(text)} | {also} |")
    return "\n".join(rows)


def job_variables() -> str:
    from ringcomm.job.config import TOPOLOGY_VARS

    return ", ".join(f"`{v}`" for v in sorted(TOPOLOGY_VARS))


def _escape(text: str) -> str:
    """Markdown for a table cell: Sphinx roles (``:func:`x```) become code, pipes are escaped."""
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text).replace("|", "\\|")


def errors_tree() -> str:
    from ringcomm import errors

    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__ and issubclass(c, BaseException)]
    children: dict[Any, list[type]] = {}
    for cls in classes:
        parent = next((b for b in cls.__bases__ if b in classes), None)
        children.setdefault(parent, []).append(cls)

    lines: list[str] = []

    def walk(parent: Any, depth: int) -> None:
        for cls in sorted(children.get(parent, []), key=lambda c: c.__name__):
            builtins = [b.__name__ for b in cls.__mro__[1:] if b.__module__ == "builtins"
                        and b not in (Exception, BaseException, object)]
            also = f" (also {', '.join(f'`{b}`' for b in builtins)})" if builtins else ""
            doc = _escape((inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " "))
            lines.append(f"{'    ' * depth}- `{cls.__name__}`{also}: {doc}")
            walk(cls, depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def on_config(config: Any) -> Any:
    # mkdocs restores sys.path after loading a hook: put this checkout first for the whole build,
    # so the tables describe this code, not another installed copy
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for name, make in (("settings", settings_table), ("job-variables", job_variables), ("errors", errors_tree)):
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
