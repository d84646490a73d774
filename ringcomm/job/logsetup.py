"""The ``ringcomm`` logger, set up as a library's: the application's logging configuration decides.

Importing ringcomm puts a :class:`LibraryNullHandler` on the ``ringcomm`` logger and sets nothing else:
no level, no formatter, no handler on the root logger.  An application that configures logging
(``logging.basicConfig(level=logging.DEBUG)``, a handler of its own on ``ringcomm``...) sees ringcomm's
records under its rules, and ``init()`` leaves them alone.

Only ``RINGCOMM_LOG_LEVEL`` (or Horovod's ``HOROVOD_LOG_LEVEL``) makes ``init()`` configure logging,
and then only the ``ringcomm`` logger: :func:`apply_level` sets its level and, when no handler would
show its records (none on the logger or above it), gives it one that writes to stderr.

    RINGCOMM_LOG_LEVEL=DEBUG ringcomm-run -np 2 python train.py   # the story of init() and of each op's path
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "ringcomm"
#: The format of the stderr handler that ``RINGCOMM_LOG_LEVEL`` adds when nothing else shows the records.
FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"


class LibraryNullHandler(logging.NullHandler):
    """A :class:`logging.NullHandler` that keeps Python's last resort for warnings.

    A plain NullHandler counts as "a handler was found", so Python's ``logging.lastResort`` never
    prints the library's warnings when the application configured no logging at all, and a stall
    warning ("allreduce 'x' was submitted by ranks [0]...") would be lost.  This one passes
    WARNING and above to ``logging.lastResort`` exactly when no other handler on the record's way
    to the root would see it, which is what Python does for a library without a NullHandler.
    Once the application configures any handler on that way, it does nothing.
    """

    def handle(self, record: logging.LogRecord) -> bool:
        last = logging.lastResort
        if last is not None and record.levelno >= last.level and not _shown_elsewhere(record.name):
            last.handle(record)
        return True


def _shown_elsewhere(name: str) -> bool:
    """Whether a handler other than ours sits on the way from logger ``name`` to the root."""
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        if any(not isinstance(h, LibraryNullHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def install() -> None:
    """Put the library's NullHandler on the ``ringcomm`` logger (once; at import)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, LibraryNullHandler) for h in logger.handlers):
        logger.addHandler(LibraryNullHandler())


class _StderrHandler(logging.StreamHandler):
    """The handler ``RINGCOMM_LOG_LEVEL`` adds; recognised by type so a second ``init()`` adds none."""


def apply_level(level: str) -> None:
    """``RINGCOMM_LOG_LEVEL`` given (non-empty): set the ``ringcomm`` logger's level, and give it a
    stderr handler when no handler on it or above it would show its records.  Empty: do nothing."""
    if not level:
        return
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level.upper())
    if not _shown_elsewhere(LOGGER_NAME):
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
