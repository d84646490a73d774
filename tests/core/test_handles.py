"""Every handle type satisfies one protocol, :class:`ringcomm.handles.OpHandle` (``done()``, ``wait()``).

mypy checks this file too (pyproject.toml): each class below is assigned to ``type[OpHandle]``, so a
handle type whose ``done``/``wait`` stop matching the protocol fails the static check as well as
the run-time one here.
"""

from __future__ import annotations

import threading

import pytest

from ringcomm.errors import HorovodInternalError
from ringcomm.handles import GroupHandle, Handle, MappedHandle, OpHandle
from ringcomm.lane.handle import LaneHandle

pytestmark = pytest.mark.pure

CORE_TYPES: list[type[OpHandle]] = [Handle, GroupHandle, MappedHandle, LaneHandle]


def _torch_types() -> list[type[OpHandle]]:
    pytest.importorskip("torch")
    from ringcomm_torch.device_threads import Returning, Staging
    from ringcomm_torch.distributed.work import RingcommWork
    from ringcomm_torch.handles import Handle as TorchHandle
    from ringcomm_torch.sparse import SparseHandle

    return [TorchHandle, SparseHandle, Staging, Returning, RingcommWork]


def test_every_handle_type_has_done_and_wait() -> None:
    for cls in CORE_TYPES + _torch_types():
        assert callable(getattr(cls, "done", None)) and callable(getattr(cls, "wait", None)), cls


def test_core_handles_are_op_handles_at_run_time() -> None:
    h = Handle("x")
    assert isinstance(h, OpHandle)
    assert isinstance(GroupHandle("g", [h]), OpHandle)
    assert isinstance(MappedHandle("m", h, lambda r: r), OpHandle)
    assert isinstance(LaneHandle("lane"), OpHandle)


def test_a_group_waits_for_every_handle_before_it_raises_the_first_error() -> None:
    """No buffer of the group is in use once its error reaches the caller."""
    first, second, third = Handle("a"), Handle("b"), Handle("c")
    group = GroupHandle(None, [first, second, third])
    first.set_error(HorovodInternalError("a failed"))
    second.set_result(2)
    assert not group.done()
    waited = threading.Event()

    def waiter() -> None:
        with pytest.raises(HorovodInternalError, match="a failed"):
            group.wait()
        waited.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not waited.wait(0.2)  # still waiting for the third handle
    third.set_error(HorovodInternalError("c failed"))
    t.join(5)
    assert waited.is_set() and group.done()


def test_a_group_returns_results_in_order_and_passes_a_timeout() -> None:
    a, b = Handle("a"), Handle("b")
    a.set_result("ra")
    with pytest.raises(TimeoutError, match="'b'"):
        GroupHandle("g", [a, b]).wait(0.01)
    b.set_result("rb")
    assert GroupHandle("g", [a, b]).wait() == ["ra", "rb"]


def test_the_backends_work_object_answers_done() -> None:
    torch = pytest.importorskip("torch")
    from ringcomm_torch.distributed.work import RingcommWork

    fut = torch.futures.Future()
    work = RingcommWork("allreduce", fut)
    assert isinstance(work, OpHandle) and not work.done()
    fut.set_result([torch.zeros(1)])
    assert work.done() and work.is_completed() and work.wait() is True
