"""``horovod.runner.util.threads.in_thread``: run a function on a background thread.

Horovod's test helpers import it; it is the standard library's :class:`threading.Thread`, started.

    >>> t = in_thread(print, args=("hi",))      # prints "hi" from a daemon thread
    >>> t.join()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["in_thread"]


def in_thread(target: Callable[..., Any], args: tuple[Any, ...] = (), name: str | None = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Start ``target(*args)`` on a new thread and return the thread; ``silent`` drops what it raises."""
    if not isinstance(args, tuple):
        raise ValueError(f"in_thread(args={args!r}): args must be a tuple (for one argument: (arg,)), "
                         f"not {type(args).__name__}")
    body = target
    if silent:
        def body(*a: Any) -> None:
            try:
                target(*a)
            except Exception:  # noqa: S110 - asked for with silent=True
                pass
    thread = threading.Thread(target=body, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
