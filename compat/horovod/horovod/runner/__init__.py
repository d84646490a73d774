"""``horovod.runner``: ``run`` is :func:`ringcomm.run`; the ``horovodrun`` command is ``ringcomm-run``."""

from ringcomm import run

__all__ = ["run"]
