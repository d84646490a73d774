"""``horovod``, served by ringcomm: Horovod's import names for scripts that should run unedited.

``import horovod.torch as hvd`` gives :mod:`ringcomm_torch`; ``horovod.run`` is
:func:`ringcomm.run`; the ``horovodrun`` command is ``ringcomm-run``.  Installed from the
ringcomm repository with ``pip install ./compat/horovod``; never beside a real Horovod.

    >>> import horovod
    >>> horovod.__version__          # Horovod's API level + the ringcomm release behind it
    '0.28.1+ringcomm.0.1.0'
"""

from __future__ import annotations

import os
import sys

from ringcomm import run

from ._ringcomm_compat import other_horovod_packages, refusal

#: Horovod's API level, then the ringcomm release that serves it (the distribution's version too).
__version__ = "0.28.1+ringcomm.0.1.0"

_others = other_horovod_packages(os.path.dirname(__file__), sys.path)
if _others:
    raise ImportError(refusal(os.path.dirname(os.path.realpath(__file__)), _others, __version__))

__all__ = ["run", "__version__"]
