"""``horovod.torch`` is :mod:`ringcomm_torch`: every name of it, plus Horovod's submodules.

    import horovod.torch as hvd          # the same functions and classes as `import ringcomm_torch as hvd`
    hvd.init()
    from horovod.torch.mpi_ops import synchronize

Submodules: :mod:`.mpi_ops`, :mod:`.compression`, :mod:`.elastic`, :mod:`.functions`,
:mod:`.optimizer`, :mod:`.sync_batch_norm` (each re-exports ringcomm_torch's names).
"""

from ringcomm_torch import *  # noqa: F403 - the whole public API, listed in ringcomm_torch.__all__
from ringcomm_torch import __all__ as __all__

# horovod.torch.elastic (this package's, re-exporting ringcomm_torch.elastic) replaces the star import's `elastic`
from . import compression, elastic, functions, mpi_ops, optimizer, sync_batch_norm  # type: ignore[no-redef]  # noqa: F401
