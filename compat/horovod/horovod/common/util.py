"""``horovod.common.util``: Horovod's helpers that scripts and test suites import: ``env`` and the build queries.

    with env(HOROVOD_TIMELINE="timeline.json", HOROVOD_CYCLE_TIME=None):   # None: left as it is
        ...                                                              # the variables are restored after
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["env", "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built"]


@contextlib.contextmanager
def env(**variables: str | None) -> Iterator[None]:
    """Set environment variables for the ``with`` block (those given ``None`` are left alone), then restore them."""
    given = {name: value for name, value in variables.items() if value is not None}
    saved = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


# The build queries answer for ringcomm, as hvd.mpi_built() and the like do (ringcomm_torch.basics).


def mpi_built(verbose: bool = False) -> bool:
    from ringcomm_torch import basics

    return basics.mpi_built()


def gloo_built(verbose: bool = False) -> bool:
    from ringcomm_torch import basics

    return basics.gloo_built()


def nccl_built(verbose: bool = False) -> int:
    from ringcomm_torch import basics

    return basics.nccl_built()


def ddl_built(verbose: bool = False) -> bool:
    from ringcomm_torch import basics

    return basics.ddl_built()


def ccl_built(verbose: bool = False) -> bool:
    from ringcomm_torch import basics

    return basics.ccl_built()
