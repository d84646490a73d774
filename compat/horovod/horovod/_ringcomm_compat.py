"""What makes this ``horovod`` package ringcomm's, and the check that it hides no other ``horovod``.

This file's presence marks a ``horovod`` package as ringcomm's compat package (a second copy of it,
e.g. an installed one beside the source tree, is harmless).  Any other ``horovod`` package on
``sys.path`` is another distribution, a real Horovod most likely, which this one would hide or be
hidden by depending on the order of ``sys.path``: ``import horovod`` refuses instead of picking one.

    >>> other_horovod_packages("/site/horovod", ["/home/me/src", "/site"])   # /home/me/src/horovod is Horovod's
    ['/home/me/src/horovod']
"""

from __future__ import annotations

import os
from collections.abc import Sequence

MARKER = "_ringcomm_compat.py"


def other_horovod_packages(this_package: str, search_path: Sequence[str]) -> list[str]:
    """The ``horovod`` package folders on ``search_path`` that are not ringcomm's compat package."""
    here = os.path.realpath(this_package)
    found: list[str] = []
    for entry in search_path:
        if not isinstance(entry, str):
            continue
        candidate = os.path.realpath(os.path.join(entry or os.getcwd(), "horovod"))
        if candidate == here or candidate in found:
            continue
        if os.path.isfile(os.path.join(candidate, "__init__.py")) and not os.path.isfile(
                os.path.join(candidate, MARKER)):
            found.append(candidate)
    return found


def refusal(this_package: str, others: Sequence[str], ringcomm_version: str) -> str:
    """The ``ImportError`` message naming both packages and the ways out."""
    listed = ", ".join(others)
    return (
        f"import horovod: another `horovod` package is on sys.path ({listed}) beside ringcomm's horovod "
        f"compat package {ringcomm_version} ({this_package}); one would hide the other. Keep one: "
        "`pip uninstall horovod` removes the compat package (its scripts then need `import ringcomm_torch as hvd` "
        "and `ringcomm-run`), or take the other folder off sys.path (PYTHONPATH, the working directory) to use "
        "ringcomm under Horovod's names"
    )
