"""The "ringcomm" torch.distributed backend's pure parts, in one process: op mapping, the store plan,
torch's variables under ringcomm-run, monitored_barrier's verdict, registration and the entry point."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - torch built without distributed
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

import ringcomm as rc  # noqa: E402
import ringcomm_torch.distributed as rcd  # noqa: E402
from ringcomm.errors import InvalidInputError  # noqa: E402
from ringcomm_torch.distributed.init import store_plan, torch_env_for_ringcomm_run  # noqa: E402
from ringcomm_torch.distributed.monitor import verdict  # noqa: E402


def test_registered_for_cpu_and_cuda():
    assert "ringcomm" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["ringcomm"] == ["cpu", "cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] != "ringcomm"  # gloo stays the default for cpu


@pytest.mark.parametrize("op,expected", [(dist.ReduceOp.SUM, rc.Sum), (dist.ReduceOp.AVG, rc.Average),
                                         (dist.ReduceOp.MIN, rc.Min), (dist.ReduceOp.MAX, rc.Max),
                                         (dist.ReduceOp.PRODUCT, rc.Product)])
def test_reduce_ops_map(op, expected):
    assert rcd.reduce_op(op, "allreduce") is expected


@pytest.mark.parametrize("op", [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR])
def test_other_reduce_ops_refused_by_name(op):
    with pytest.raises(InvalidInputError, match=r"allreduce: ReduceOp B\w+ is not supported.*SUM, AVG"):
        rcd.reduce_op(op, "allreduce")


def test_store_plan_places_ranks_by_host():
    plan = store_plan(3, ["a", "b", "a", "b"], "tcp://10.0.0.1:7000", b"\x01\x02", "job1")
    assert plan["RINGCOMM_RANK"] == "3" and plan["RINGCOMM_SIZE"] == "4"
    assert (plan["RINGCOMM_LOCAL_RANK"], plan["RINGCOMM_LOCAL_SIZE"]) == ("1", "2")
    assert (plan["RINGCOMM_CROSS_RANK"], plan["RINGCOMM_CROSS_SIZE"]) == ("1", "2")
    assert plan["RINGCOMM_SECRET"] == "0102" and plan["RINGCOMM_HOSTNAME"] == "b"


def test_torch_variables_under_ringcomm_run_only_where_missing():
    env = {"RINGCOMM_RANK": "1", "RINGCOMM_SIZE": "3", "RINGCOMM_LOCAL_RANK": "1", "RINGCOMM_LOCAL_SIZE": "3",
           "RINGCOMM_RENDEZVOUS_ADDR": "tcp://127.0.0.1:5000", "RINGCOMM_JOB_ID": "abc", "MASTER_PORT": "1234"}
    set_ = torch_env_for_ringcomm_run(env)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "3" and env["LOCAL_RANK"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "1234" and "MASTER_PORT" not in set_
    other = {"RINGCOMM_RANK": "0", "RINGCOMM_SIZE": "3", "RINGCOMM_JOB_ID": "abc"}
    torch_env_for_ringcomm_run(other)
    mine = {"RINGCOMM_RANK": "2", "RINGCOMM_SIZE": "3", "RINGCOMM_JOB_ID": "abc"}
    torch_env_for_ringcomm_run(mine)
    assert other["MASTER_PORT"] == mine["MASTER_PORT"]  # every rank derives the same store port
    assert torch_env_for_ringcomm_run({"RANK": "0", "WORLD_SIZE": "2"}) == {}  # not ringcomm-run: untouched


def test_monitored_barrier_verdict():
    assert verdict([0, 1, 2], 3, 1.0, False) == "ok"
    assert "rank 1 did not arrive within 2 s" in verdict([0, 2, 3], 4, 2.0, True)
    assert "ranks [1, 3]" in verdict([0, 2], 4, 2.0, True)
    assert "rank 1 did not" in verdict([0, 2], 4, 2.0, False)


def test_single_process_group_through_a_hash_store():
    """world size 1 with a hand-made store: every collective completes, results as gloo would give."""
    if rc.is_initialized():  # by an earlier test module in this process (and maybe a group over it)
        if rc.size() != 1:
            pytest.skip("this process is a rank of a larger ringcomm job")
        if dist.is_initialized():
            dist.destroy_process_group()
        if rc.is_initialized():
            rc.shutdown()
    dist.init_process_group("ringcomm", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()  # and again: a second group starts a new ringcomm job
    assert not rc.is_initialized()
    dist.init_process_group("ringcomm", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.arange(4.0)
        work = dist.all_reduce(t, async_op=True)
        assert work.wait() and torch.equal(t, torch.arange(4.0))
        fut = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).get_future()
        assert torch.equal(fut.wait()[0], torch.arange(4.0))
        out = [torch.empty(4)]
        dist.all_gather(out, t)
        assert torch.equal(out[0], t)
        dist.barrier()
        with pytest.raises(dist.DistBackendError, match="send/isend is not supported by the ringcomm backend"):
            dist.distributed_c10d._get_default_group().send([t], 0, 0)
    finally:
        dist.destroy_process_group()
    assert not rc.is_initialized()  # the group started ringcomm, so destroying it shut ringcomm down


def test_entry_point_registers_the_backend_at_import_torch(tmp_path):
    # run outside the checkout: a stale ringcomm.egg-info there would hide the installed metadata
    probe = ("from importlib import metadata; print(any(ep.value == 'ringcomm_torch_plugin:load' "
             "for ep in metadata.entry_points(group='torch.backends')))")
    has = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    if has.stdout.strip() != "True":
        pytest.skip("the installed ringcomm has no torch.backends entry point (reinstall: pip install -e .)")
    code = ("import sys, torch.distributed as dist; "
            "print('RINGCOMM' in dist.Backend._plugins, 'ringcomm_torch.distributed' in sys.modules)")
    env = {k: v for k, v in os.environ.items()
           if k != "TORCH_DEVICE_BACKEND_AUTOLOAD" and not k.startswith("RINGCOMM_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    # registered, but ringcomm itself is imported only when a group is created on it
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = ("import sys, torch, torch.distributed as dist; dist.init_process_group('ringcomm'); "
           "t = torch.ones(3); dist.all_reduce(t); "
           "print(t.tolist(), 'ringcomm_torch.distributed' in sys.modules); dist.destroy_process_group()")
    single = dict(env, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ran = subprocess.run([sys.executable, "-c", job], cwd=tmp_path, env=single, capture_output=True, text=True,
                         timeout=60)
    assert ran.stdout.split("\n")[0] == "[1.0, 1.0, 1.0] True", ran.stdout + ran.stderr
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    off = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert off.stdout.split() == ["False", "False"], off.stdout + off.stderr
