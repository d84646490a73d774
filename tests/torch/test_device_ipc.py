"""DistributedOptimizer's CUDA buckets reduced on the device among one host's ranks (CUDA IPC), run
on CPU through the fake device's model of IPC: buffers are shared-memory CPU tensors the peer
process maps, events are counters in shared memory that stay not happened while the recording
rank's fake is held, and a stream's wait for a peer's event blocks where it is queued.

Runs alone (one rank: the pinned path, with its reason) or under the launcher at np 2 and 3, also
with ``RINGCOMM_DEVICE_IPC=0`` (the pinned path) (test_torch_jobs.py).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import ringcomm_torch as hvd  # noqa: E402
from conftest import name_test_host, hosts_of_job  # noqa: E402
from ringcomm import api as core_api  # noqa: E402
from ringcomm.shm import slots  # noqa: E402
from ringcomm_torch import device, device_ipc, device_ipc_ops  # noqa: E402
from ringcomm_torch.buckets import DeviceBucket  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _init():
    name_test_host()
    hvd.init()
    yield


def on_device() -> bool:
    """Whether this job takes the device path (some host with two ranks, the setting on)."""
    return core_api.current_settings().device_ipc and hvd.size() > 1 and hosts_of_job(hvd.size()) < hvd.size()


def spans_hosts() -> bool:
    return hosts_of_job(hvd.size()) > 1


def make(ipc: bool, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    ops = device.FakeOps(ipc=ipc)
    with device.override(ops):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), groups=3, **kwargs)
    return model, opt, ops


def alike(t: torch.Tensor) -> bool:
    """Whether ``t`` holds the same bits on every rank."""
    rows = hvd.allgather(t.detach().reshape(1, -1))
    return all(torch.equal(rows[0], row) for row in rows)


def batch() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + hvd.rank()))  # differs per rank


def test_the_path_is_chosen_alike_on_every_rank():
    def reach(a: int, b: int) -> bool:
        return {a, b} != {0, 1}

    one_host = ["h"] * 3
    assert device_ipc.choose_path(True, one_host, 2, [0, 1, 1], reach, True, True) == (
        False, "GPU 0 of rank 0 cannot access GPU 1 of rank 1 (torch.cuda.can_device_access_peer)")
    # across hosts only a rank's own host counts: host b's GPUs reach each other, host a's do not
    two = ["a", "b", "a", "b"]
    assert device_ipc.choose_path(True, two, 1, [0, 1, 1, 1], reach, True, True)[0]
    assert not device_ipc.choose_path(True, two, 0, [0, 1, 1, 1], reach, True, True)[0]
    assert device_ipc.choose_path(True, ["a", "b", "c"], 0, [0] * 3, reach, True, True) == (
        False, "each of the 3 ranks is alone on its host")
    assert device_ipc.choose_path(True, ["h", "h"], 0, [0, 0], reach, False, True)[1] == \
        "the op is neither Sum nor Average"
    _, opt, _ = make(ipc=True)
    kinds = {type(b) for b in opt.reducer.device_buckets.values()}
    assert kinds == ({device_ipc.IpcBucket} if on_device() else {DeviceBucket}), kinds
    _, fallback, _ = make(ipc=False)  # the fake offers no peer access: every rank keeps the pinned path
    assert not any(isinstance(b, device_ipc.IpcBucket) for b in fallback.reducer.device_buckets.values())


def test_shared_files_outlive_another_jobs_sweep_of_what_dead_processes_left():
    """Another job's launcher, starting while this one shares its buffers, removes every
    ``ringcomm-*`` file in /dev/shm that no live process holds; the fake's files are held."""
    ipc = device_ipc_ops.FakeIpc(device.FakeOps(ipc=True))
    flat = ipc.shared_flat(8, torch.float32, torch.device("cpu"))
    path, _, _ = ipc.share(flat)
    event_path = ipc.event_handle(ipc.event())
    swept = [p for p, _ in slots.reclaim_left_by_dead()]
    assert path not in swept and event_path not in swept
    assert os.path.exists(path) and os.path.exists(event_path)
    peer = ipc.open_shared(ipc.share(flat), torch.device("cpu"))
    peer.fill_(3.0)
    assert torch.equal(flat, torch.full((8,), 3.0))
    ipc.opened()  # every peer has it: the names go, the mappings stay
    assert not os.path.exists(path) and not os.path.exists(event_path)
    assert torch.equal(flat, torch.full((8,), 3.0))


def test_results_are_bitwise_alike_on_every_rank_and_the_pinned_paths_within_rounding():
    model, opt, ops = make(ipc=True, op=hvd.Average, gradient_predivide_factor=2.0)
    twin = copy.deepcopy(model)
    twin_model, twin_opt, _ = make(ipc=False, op=hvd.Average, gradient_predivide_factor=2.0)
    twin_model.load_state_dict(twin.state_dict())
    x = batch()
    for step in range(3):
        for m, o in ((model, opt), (twin_model, twin_opt)):
            o.zero_grad(set_to_none=step == 0)
            m(x).square().mean().backward()
            o.step()
        for (name, p), q in zip(model.named_parameters(), twin_model.parameters()):
            gathered = hvd.allgather(p.grad.detach().reshape(1, -1))
            assert all(torch.equal(gathered[0], row) for row in gathered), f"{name}.grad differs between ranks"
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), f"{name}.grad differs from the pinned path"
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name
    if on_device():
        kinds = {type(b).__name__ for b in opt.reducer.device_buckets.values()}
        assert kinds == {"IpcBucket"}, f"the device path fell back to pinned memory ({kinds}): see the warning"
        assert all(all(b.views()) for b in opt.reducer.device_buckets.values())
        for b in opt.reducer.device_buckets.values():
            if spans_hosts():  # only each rank's shard of its host's sum, once per step
                lo, hi = device_ipc.shard_bounds(b.numel, b.local.index(hvd.rank()), len(b.local))
                assert b.staged_bytes == 3 * (hi - lo) * b.dtype.itemsize, (b.staged_bytes, lo, hi)
            else:
                assert b.staged_bytes == 0
        if not spans_hosts():
            assert ops.pinned_allocations == 0  # nothing went through host memory


def test_no_wait_for_a_peer_in_backward_even_while_a_peers_device_is_held(foreign_waits):
    if not on_device():
        pytest.skip("the pinned path (one rank, or RINGCOMM_DEVICE_IPC=0): nothing is shared")
    model, opt, ops = make(ipc=True)
    waits = foreign_waits
    x = batch()
    seen: list[str] = []
    for _ in range(2):
        seen += waits
        waits.clear()
        opt.zero_grad()
        held = hvd.rank() == hvd.size() - 1
        if held:
            ops.hold()  # its posted events do not happen until it fires
        started = time.monotonic()
        model(x).square().mean().backward()
        backward = time.monotonic() - started
        me = threading.current_thread().name
        assert me not in waits, waits  # the hooks queued no wait for a peer (step() may: it synchronizes)
        if held:
            time.sleep(0.5)  # the other ranks' return threads wait for this rank meanwhile
            ops.fire()
        opt.step()
        assert backward < 5.0, backward
    seen += waits
    assert set(seen) <= {"ringcomm-torch-device-return", threading.current_thread().name}
    assert "ringcomm-torch-device-return" in seen


def test_the_setting_off_keeps_the_pinned_path_and_says_why(caplog):
    if core_api.current_settings().device_ipc:
        pytest.skip("RINGCOMM_DEVICE_IPC is on in this job")
    assert device_ipc.choose_path(False, ["h"] * hvd.size(), hvd.rank(), [0] * hvd.size(), lambda a, b: True,
                                  True, True) == (False, "RINGCOMM_DEVICE_IPC=0")
    _, opt, ops = make(ipc=True)
    assert not any(isinstance(b, device_ipc.IpcBucket) for b in opt.reducer.device_buckets.values())
    with caplog.at_level(logging.INFO):
        device_ipc.log_once(False, "again")  # once per process: nothing more
    assert "again" not in caplog.text


def test_while_a_rank_has_joined_the_buckets_take_the_pinned_path_where_it_adds_zeros():
    model, opt, _ = make(ipc=True, op=hvd.Sum)
    twin_model, twin_opt, _ = make(ipc=False, op=hvd.Sum)
    x = batch()
    for step in range(2):  # every rank steps once (its buffer then holds gradients); then rank 0 runs dry
        if step == 1 and hvd.rank() == 0:
            hvd.join()
            return
        for m, o in ((model, opt), (twin_model, twin_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.synchronize()
    for (name, p), q in zip(model.named_parameters(), twin_model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), f"{name}.grad differs from the pinned path"
    hvd.join()


def test_the_timeline_shows_each_buckets_pack_device_reduction_and_unpack(tmp_path):
    """With a timeline, a bucket reduced on the device has BUCKET_PACK, IPC_REDUCE (one host) and
    BUCKET_UNPACK on its row, each naming the bucket's parameters."""
    import json

    model, opt, _ = make(ipc=True)
    path = tmp_path / "ipc-buckets.json"
    hvd.start_timeline(str(path))
    model(batch()).square().mean().backward()
    opt.step()
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return
    events = json.loads(path.read_text())
    names = sorted(n for n, _ in model.named_parameters())
    phases = ["BUCKET_PACK", "BUCKET_UNPACK"] + (["IPC_REDUCE"] if on_device() and not spans_hosts() else [])
    for phase in phases:
        carried = [e["args"]["parameters"] for e in events if e.get("name") == phase]
        assert sorted(n for names_ in carried for n in names_) == names, phase
    if not on_device():
        assert not any(e.get("name") == "IPC_REDUCE" for e in events)


def test_an_elastic_job_keeps_its_buckets_on_the_pinned_path(monkeypatch):
    """In an elastic job a worker that joins later makes its optimizer alone, so no bucket is
    shared at construction (a collective there would wait for ranks that never come)."""
    from ringcomm_torch import reducer

    assert device_ipc.refusal(True, 4, elastic=True).startswith("an elastic job")
    assert device_ipc.refusal(True, 4) is None
    monkeypatch.setattr(reducer, "current_world", lambda: object())  # as in a worker of an elastic job
    model, opt, _ = make(ipc=True)
    assert opt.reducer.device_buckets and not any(isinstance(b, device_ipc.IpcBucket)
                                                  for b in opt.reducer.device_buckets.values())
    model(batch()).square().mean().backward()
    opt.step()  # and the pinned path reduces them
    for p in model.parameters():
        assert alike(p.grad)


def test_buckets_shared_in_an_earlier_job_go_through_pinned_memory_and_stay_right(monkeypatch, caplog):
    """After init() starts a new job, a bucket's peers' buffers and events belong to the old one:
    it takes the pinned path from then on, on every rank, and says so once."""
    import dataclasses

    if not on_device():
        pytest.skip("the pinned path here already")
    model, opt, _ = make(ipc=True, op=hvd.Sum)
    twin_model, twin_opt, _ = make(ipc=False, op=hvd.Sum)
    x = batch()
    for m, o in ((model, opt), (twin_model, twin_opt)):
        m(x).square().mean().backward()
        o.synchronize()
    assert all(isinstance(b, device_ipc.IpcBucket) for b in opt.reducer.device_buckets.values())
    new_job = dataclasses.replace(core_api.current_settings())
    monkeypatch.setattr(core_api, "current_settings", lambda: new_job)  # what init() after shutdown() gives
    with caplog.at_level(logging.WARNING, logger="ringcomm_torch.reducer"):
        for m, o in ((model, opt), (twin_model, twin_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.synchronize()
    assert not any(isinstance(b, device_ipc.IpcBucket) for b in opt.reducer.device_buckets.values())
    assert caplog.text.count("shared with the ranks of an earlier job") == 1, caplog.text
    for (name, p), q in zip(model.named_parameters(), twin_model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
        assert alike(p.grad), name
