"""The ``"ringcomm"`` process group's argument checks, and their failure on every rank of the group.

torch.distributed calls a group's collective on each rank with that rank's own arguments, so a
check can fail on one rank alone (a root out of range, an unsupported dtype or reduce op, a list
of the wrong length).  Raising there, before the op reaches the core, would leave the other ranks
waiting for this one's part until the stall check ends the job, and a program that catches the
error would pair its next op with the others' failed one.  So each op takes its name first and
runs its checks in :class:`refusing`: a check that fails refuses that name on every rank of the
group, as :mod:`ringcomm_torch.collectives` refuses its own, whose works raise this rank's reason,
and the next op pairs with the next op everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

import ringcomm as rc
from ringcomm.core import ops as _ops
from ringcomm.errors import InvalidInputError, InvalidTypeError

from ..collectives import refusing as _refusing
from ..tensors import check_stageable

__all__ = ["reduce_op", "check_root", "check_tensors", "refusing"]

_R = dist.ReduceOp.RedOpType
_OPS: dict[Any, _ops.ReduceOp] = {_R.SUM: rc.Sum, _R.AVG: rc.Average, _R.MIN: rc.Min, _R.MAX: rc.Max,  # type: ignore[attr-defined]
                                  _R.PRODUCT: rc.Product}  # type: ignore[attr-defined]


def reduce_op(op: Any, what: str) -> _ops.ReduceOp:
    """torch's ``ReduceOp`` -> ringcomm's; refuses the ones ringcomm does not have."""
    kind = getattr(op, "op", op)
    try:
        return _OPS[kind]
    except (KeyError, TypeError):
        raise InvalidInputError(
            f"{what}: ReduceOp {getattr(kind, 'name', kind)} is not supported by the ringcomm backend; "
            "use SUM, AVG, MIN, MAX or PRODUCT (or the gloo backend for bitwise and premultiplied sums)") from None


def check_root(root: int, size: int, what: str) -> None:
    """Refuse a root (a rank of the group) that is not a rank of a group of ``size``."""
    if not 0 <= root < size:
        raise InvalidInputError(f"{what}: root {root} is not a rank of this group (0..{size - 1}); "
                                "pass the same root, a rank of the group, on every rank")


def check_tensors(tensors: Sequence[Any], what: str) -> None:
    """Refuse, before any is staged, a tensor that :func:`~ringcomm_torch.tensors.stage` cannot stage."""
    for t in tensors:
        check_stageable(t, what)


class refusing(_refusing):  # lower case: used as a function, like the class it extends
    """:class:`ringcomm_torch.collectives.refusing` for a process group's op ``what`` (the core's
    ``kind`` op, submitted under ``names``; a grouped one's ``parts``): a check in the block that
    raises :class:`InvalidInputError` or :class:`InvalidTypeError` with ``"{what}: reason"``
    refuses the op on every rank of ``process_set``, and raises here as ``"{what} on rank {rank}: reason"``."""

    __slots__ = ("what", "rank")

    def __init__(self, rank: int, process_set: Any, what: str, kind: str, names: Sequence[str],
                 parts: int = 1) -> None:
        super().__init__(kind, None, process_set)
        self.names, self.parts = list(names), parts
        self.what, self.rank = what, rank

    def __enter__(self) -> refusing:
        return self

    def name_rank(self, exc: BaseException) -> None:
        """Nothing: :meth:`__exit__` names this rank of the group in the message's first words."""

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        super().__exit__(exc_type, exc, tb)
        if isinstance(exc, (InvalidInputError, InvalidTypeError)):
            named = type(exc)(f"{self.what} on rank {self.rank}: {str(exc).removeprefix(f'{self.what}: ')}")
            named.refused = True
            raise named from None
