"""The public API in a single-process job (no launcher): semantics and input validation."""

from __future__ import annotations

import numpy as np
import pytest

import ringcomm as rc
from ringcomm.job import topology


@pytest.fixture
def job(monkeypatch):
    for key in list(__import__("os").environ):
        if key.startswith("RINGCOMM_") or key in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    rc.init()
    yield rc
    rc.shutdown()


def test_topology_of_a_single_process(job) -> None:
    assert (rc.rank(), rc.size(), rc.local_rank(), rc.local_size(), rc.cross_rank(), rc.cross_size()) == (0, 1, 0, 1, 0, 1)
    assert rc.is_initialized()


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64"])
def test_every_collective_every_dtype(job, dtype: str) -> None:
    a = (np.arange(12) % 5).astype(dtype).reshape(3, 4)
    for op in (rc.Sum, rc.Average, rc.Min, rc.Max, rc.Product):
        np.testing.assert_array_equal(rc.allreduce(a, op=op), a)
    np.testing.assert_array_equal(rc.allgather(a), a)
    np.testing.assert_array_equal(rc.broadcast(a, 0), a)
    out, splits = rc.alltoall(a)
    np.testing.assert_array_equal(out, a)
    assert splits.tolist() == [3]
    np.testing.assert_array_equal(rc.reducescatter(a, op=rc.Sum), a)


def test_zero_d_and_empty(job) -> None:
    assert rc.allreduce(np.array(2.5)).shape == ()
    assert rc.allgather(np.array(7)).tolist() == [7]
    assert rc.allreduce(np.zeros((0, 3))).shape == (0, 3)
    assert rc.allgather(np.zeros((0, 2), np.int8)).shape == (0, 2)
    assert rc.broadcast(np.zeros(0), 0).shape == (0,)


def test_scale_factors_and_integer_average(job) -> None:
    np.testing.assert_allclose(rc.allreduce(np.ones(3), prescale_factor=2.0, postscale_factor=0.5), np.ones(3))
    assert rc.allreduce(np.array([7], np.int32), op=rc.Sum, postscale_factor=0.5).tolist() == [3]


def test_bool_ops(job) -> None:
    b = np.array([True, False])
    assert rc.allreduce(b, op=rc.Sum).tolist() == [True, False]
    with pytest.raises(TypeError, match="Average is not defined for bool"):
        rc.allreduce(b)


def test_async_poll_synchronize_and_out(job) -> None:
    a = np.arange(4.0)
    out = np.empty_like(a)
    h = rc.allreduce_async(a, out=out, name="x")
    assert rc.synchronize(h) is out
    b = np.arange(3.0)
    assert rc.broadcast(b, 0, out=b) is b and b.tolist() == [0.0, 1.0, 2.0]
    assert rc.poll(h)
    np.testing.assert_array_equal(out, a)
    res = rc.grouped_allreduce([np.ones(2), np.zeros(3)])
    assert [r.tolist() for r in res] == [[1, 1], [0, 0, 0]]
    assert [r.tolist() for r in rc.grouped_allgather([np.ones(1), np.zeros(1)])] == [[1], [0]]
    assert [r.tolist() for r in rc.grouped_reducescatter([np.ones(2)], op=rc.Sum)] == [[1, 1]]


def test_objects_barrier_join(job) -> None:
    assert rc.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert rc.allgather_object(("x", 1)) == [("x", 1)]
    rc.barrier()
    assert rc.join() == 0


def test_buffers_other_than_ndarray(job) -> None:
    assert rc.allreduce(bytearray(b"\x01\x02"), op=rc.Sum).tolist() == [1, 2]
    assert rc.allreduce(memoryview(np.arange(3, dtype=np.int16)), op=rc.Max).tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda: rc.allreduce(np.ones((4, 4))[:, ::2]), ValueError, "C-contiguous.*ascontiguousarray"),
        (lambda: rc.allreduce(np.array([object()])), TypeError, "object arrays"),
        (lambda: rc.allreduce(np.ones(2, np.complex64)), TypeError, "complex64.*not supported"),
        (lambda: rc.allreduce([1.0, 2.0]), TypeError, "expected a NumPy array.*np.asarray"),
        (lambda: rc.allreduce(np.ones(2, np.int32), op=rc.Adasum), TypeError, "Adasum reduces float16.*got int32"),
        (lambda: rc.allreduce(np.ones(2), op=42), TypeError, "not a reduce op"),
        (lambda: rc.broadcast(np.ones(2), 3), ValueError, "root_rank=3 is out of range.*0..0"),
        (lambda: rc.broadcast(np.ones(2), 0.5), TypeError, "root_rank must be an int"),
        (lambda: rc.alltoall(np.ones(3), splits=[1, 2]), ValueError, "one entry per rank"),
        (lambda: rc.alltoall(np.ones(3), splits=[-3]), ValueError, ">= 0"),
        (lambda: rc.alltoall(np.ones(3), splits=[2]), ValueError, "sum to 2 but dim 0 of the array is 3"),
        (lambda: rc.alltoall(np.ones(3), splits=np.array([3.0])), TypeError, "integers"),
        (lambda: rc.alltoall(np.array(1.0)), ValueError, "at least one dimension"),
        (lambda: rc.reducescatter(np.array(1.0)), ValueError, "at least one dimension"),
        (lambda: rc.allreduce(np.ones(2), out=np.ones(3)), ValueError, "out= must be"),
        (lambda: rc.broadcast(np.ones(2), 0, out=np.ones(2, np.float32)), ValueError, "out= must be"),
        (lambda: rc.broadcast(np.ones(2), 0, out=np.ones(2)[::-1].copy().reshape(1, 2)), ValueError, "out= must be"),
        (lambda: rc.allreduce(np.ones(2), name=""), ValueError, "non-empty string"),
        (lambda: rc.grouped_allreduce([np.ones(2), np.ones(2, np.int8)]), TypeError, "share a dtype"),
    ],
)
def test_bad_input_raises_a_clear_error_and_the_job_keeps_working(job, call, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        call()
    assert rc.allreduce(np.ones(2), op=rc.Sum).tolist() == [1, 1]


def test_duplicate_in_flight_name(job, monkeypatch) -> None:
    # hold the engine so the first op stays in flight
    engine = rc.runtime.active().engine
    real = engine.submit
    held = []
    monkeypatch.setattr(engine, "submit", lambda e: held.append(e) or e.handle)
    rc.allreduce_async(np.ones(2), name="dup")
    with pytest.raises(rc.DuplicateNameError, match="'dup' is already in flight on rank 0"):
        rc.allreduce_async(np.ones(2), name="dup")
    monkeypatch.setattr(engine, "submit", real)
    for e in held:
        real(e)
    rc.synchronize(held[0].handle)
    rc.allreduce(np.ones(2), name="dup")  # free again once finished


def test_a_claimed_name_is_in_flight_until_its_op_is_submitted_and_done_or_the_claim_dropped(job) -> None:
    later = rc.api.claim_name("allreduce", "later", rc.global_process_set)
    assert later == "later"
    with pytest.raises(rc.DuplicateNameError, match="'later' is already in flight on rank 0"):
        rc.api.claim_name("allgather", "later", rc.global_process_set)  # another op of the claimed name
    with pytest.raises(rc.DuplicateNameError, match="'later' is already in flight on rank 0"):
        rc.allreduce_async(np.ones(2), name="later")  # an op submitted at once under the name is another op
    assert rc.allreduce(np.ones(2), op=rc.Sum, name=later).tolist() == [1, 1]  # the claimed op itself
    rc.allreduce(np.ones(2), name="later")  # free again once done
    rc.api.claim_name("allreduce", "dropped", rc.global_process_set)
    rc.api.drop_claim("allreduce", "dropped", rc.global_process_set)  # never submitted
    rc.allreduce(np.ones(2), name="dropped")
    rc.api.drop_claim("allreduce", "dropped", rc.global_process_set)  # nothing claimed: nothing happens


def test_collectives_before_init_and_after_shutdown(monkeypatch) -> None:
    if rc.is_initialized():
        rc.shutdown()
    with pytest.raises(rc.NotInitializedError, match=r"init\(\) first"):
        rc.allreduce(np.ones(1))
    with pytest.raises(ValueError):
        rc.rank()
    rc.init()
    rc.shutdown()
    with pytest.raises(rc.NotInitializedError):
        rc.barrier()


@pytest.mark.parametrize(
    "env,pattern",
    [
        ({"RINGCOMM_RANK": "0", "RINGCOMM_SIZE": "0"}, "world size .* is 0; it must be >= 1"),
        ({"RINGCOMM_RANK": "4", "RINGCOMM_SIZE": "4", "RINGCOMM_RENDEZVOUS_ADDR": "tcp://127.0.0.1:1"}, "rank .* is 4 but the world size is 4"),
        ({"RINGCOMM_RANK": "x", "RINGCOMM_SIZE": "2"}, "not an integer"),
        ({"RINGCOMM_RANK": "1", "RINGCOMM_SIZE": "2"}, "RINGCOMM_RENDEZVOUS_ADDR is not set"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "torchrun"),
    ],
)
def test_bad_launch_environment(env: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        topology.from_env(env)


def test_unknown_setting_is_an_error(monkeypatch) -> None:
    from ringcomm.job.config import Settings

    with pytest.raises(ValueError, match="unknown setting RINGCOMM_FUSION_TRESHOLD"):
        Settings.from_env({"RINGCOMM_FUSION_TRESHOLD": "1"})
    assert Settings.from_env({"RINGCOMM_CYCLE_TIME": "2.5"}).cycle_time == 2.5


def test_a_number_set_to_nothing_is_the_default_and_a_bad_one_names_what_was_set() -> None:
    from ringcomm.errors import InvalidInputError
    from ringcomm.job.config import Settings

    default = Settings()
    for env in ({"RINGCOMM_FUSION_THRESHOLD": ""}, {"HOROVOD_FUSION_THRESHOLD": " "}, {"RINGCOMM_CYCLE_TIME": ""}):
        assert Settings.from_env(env) == default, env  # as job files write X=${X:-}
    assert Settings.from_env({"RINGCOMM_ENCRYPT": ""}).encrypt is False  # a flag set to nothing is off
    with pytest.raises(InvalidInputError, match=r"^HOROVOD_FUSION_THRESHOLD='64M' is not a valid int; set a whole "
                       rf"number \(the default: HOROVOD_FUSION_THRESHOLD={default.fusion_threshold}\) or unset it$"):
        Settings.from_env({"HOROVOD_FUSION_THRESHOLD": "64M"})
    with pytest.raises(InvalidInputError, match=r"^RINGCOMM_CYCLE_TIME='fast' is not a valid float; set a number"):
        Settings.from_env({"RINGCOMM_CYCLE_TIME": "fast", "HOROVOD_CYCLE_TIME": "5"})  # RINGCOMM_ wins, and is named


def test_torchrun_environment_is_understood() -> None:
    topo = topology.from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (topo.rank, topo.size, topo.local_rank, topo.cross_rank, topo.cross_size) == (1, 4, 1, 0, 2)
    assert topo.rendezvous == "tcp://127.0.0.1:29501" and not topo.host_rendezvous


def test_reinit_many_times_in_one_process(job) -> None:
    for _ in range(5):
        rc.shutdown()
        rc.init()
        assert rc.allreduce(np.ones(1), op=rc.Sum).tolist() == [1.0]


def test_timeline_uses_horovods_names_and_is_readable_while_running(job, tmp_path) -> None:
    path = tmp_path / "live.json"
    rc.start_timeline(str(path), mark_cycles=True)
    rc.allreduce(np.ones(3), op=rc.Sum)  # unnamed: allreduce.noname.N
    rc.allgather(np.ones(2), name="allgather.x")
    rc.allreduce(np.ones(3), name="grad.w")  # a name that does not tell the kind
    text = path.read_text()  # before stop_timeline: every event is already on disk
    rc.stop_timeline()
    assert "allreduce.noname." in text and "NEGOTIATE_ALLREDUCE" in text and "NEGOTIATE_ALLGATHER" in text
    assert '"CYCLE_START"' in text and '"NEGOTIATE"' not in text  # the kind, whatever the op's name


def test_timeline_records_the_phases_of_an_allreduce_in_order(job, tmp_path) -> None:
    import json

    path = tmp_path / "tl.json"
    rc.start_timeline(str(path), mark_cycles=True)
    rc.allreduce(np.ones(1000), name="grad.w")
    rc.grouped_allreduce([np.ones(3), np.ones(4)], name="g")
    rc.broadcast(np.ones(2), 0, name="b")
    rc.stop_timeline()
    events = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"grad.w", "g", "b"} <= set(names.values())
    for op, expected in {"grad.w": ["QUEUE", "NEGOTIATE_ALLREDUCE", "RING"],
                         "g": ["QUEUE", "NEGOTIATE_ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", "RING", "MEMCPY_OUT_FUSION_BUFFER"]
                         }.items():
        pid = next(p for p, n in names.items() if n == op)
        phases = [e for e in events if e.get("pid") == pid and e["ph"] == "X"]
        assert [e["name"] for e in phases] == expected
        starts = [e["ts"] for e in phases]
        assert starts == sorted(starts) and all(e["dur"] >= 0 for e in phases)
    assert any(e["name"] == "CYCLE_START" for e in events)
    assert any(e.get("name") == "BROADCAST" for e in events)


def test_timeline_from_the_environment(monkeypatch, tmp_path) -> None:
    import json

    if rc.is_initialized():
        rc.shutdown()
    path = tmp_path / "env.json"
    monkeypatch.setenv("RINGCOMM_TIMELINE", str(path))
    rc.init()
    rc.allreduce(np.ones(3), name="t")
    rc.shutdown()
    events = json.loads(path.read_text())
    assert any(e.get("args", {}).get("name") == "t" for e in events)


@pytest.mark.timeout(120)
def test_no_lost_wakeups_under_concurrent_submission(job) -> None:
    """Two threads submit thousands of ops while the engine drains; every one must complete.

    A lost wake-up (the engine asleep with ops queued) shows as a handle that never finishes.
    """
    import threading

    errors: list[BaseException] = []

    def worker(tag: str) -> None:
        try:
            for i in range(3000):
                handles = [rc.allreduce_async(np.ones(4), name=f"{tag}.{i}.{j}") for j in range(3)]
                for h in handles:
                    h.wait(timeout=20)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors[0]


def test_log_level_setting(monkeypatch) -> None:
    import logging

    from ringcomm.job.config import Settings

    if rc.is_initialized():
        rc.shutdown()
    monkeypatch.setenv("RINGCOMM_LOG_LEVEL", "debug")
    rc.init()
    assert logging.getLogger("ringcomm").level == logging.DEBUG
    rc.shutdown()
    logging.getLogger("ringcomm").setLevel(logging.NOTSET)  # as the import left it
    with pytest.raises(ValueError, match="RINGCOMM_LOG_LEVEL='loud'"):
        Settings.from_env({"RINGCOMM_LOG_LEVEL": "loud"})


def test_process_set_arguments_are_validated(monkeypatch) -> None:
    for key in list(__import__("os").environ):
        if key.startswith("RINGCOMM_") or key in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    with pytest.raises(ValueError, match="duplicate"):
        rc.ProcessSet([0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        rc.ProcessSet([-1])
    with pytest.raises(TypeError, match="ints"):
        rc.ProcessSet([0.5])
    with pytest.raises(ValueError, match="'dynamic'"):
        rc.init(process_sets="dynamc")
    assert not rc.is_initialized()
    with pytest.raises(ValueError, match="do not form a process set"):  # init fails cleanly, no engine left
        rc.init(process_sets=[rc.ProcessSet([1])])
    assert not rc.is_initialized()
    alone = rc.ProcessSet([0])
    rc.init(process_sets=[alone])
    try:
        assert alone.process_set_id == 0 and alone.rank() == 0 and alone.size() == 1  # every rank: the global set
        with pytest.raises(ValueError, match="process_sets='dynamic'"):
            rc.add_process_set([0])
        with pytest.raises(TypeError, match="must be a ProcessSet"):
            rc.allreduce(np.ones(2), process_set=[0])
        with pytest.raises(ValueError, match="not a registered process set"):
            rc.allgather(np.ones(2), process_set=rc.ProcessSet([0, 3]))
        np.testing.assert_array_equal(rc.allreduce(np.ones(2), process_set=alone), np.ones(2))
    finally:
        rc.shutdown()
    with pytest.raises(ValueError, match="not a registered process set"):  # from before shutdown()
        rc.init()
        try:
            stale = rc.ProcessSet([0])
            stale.process_set_id, stale.registered_round = 1, -5
            rc.barrier(process_set=stale)
        finally:
            rc.shutdown()


def test_a_second_init_with_process_sets_is_refused_not_ignored(monkeypatch) -> None:
    import ringcomm as rc

    for key in [k for k in __import__("os").environ if k.startswith(("RINGCOMM_", "RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(key, raising=False)
    rc.init()
    try:
        rc.init()  # a plain second init is a no-op, as in Horovod
        with pytest.raises(rc.InvalidInputError, match="already initialized"):
            rc.init(process_sets=[rc.ProcessSet([0])])
        assert rc.is_initialized() and rc.size() == 1
    finally:
        rc.shutdown()



def test_init_takes_a_settings_object(monkeypatch) -> None:
    import dataclasses

    for key in list(__import__("os").environ):
        if key.startswith("RINGCOMM_") or key in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(key)
    mine = dataclasses.replace(rc.Settings.from_env(), fusion_threshold=0, cache_capacity=3)
    rc.init(settings=mine)
    try:
        assert rc.runtime.current_settings() is mine
        assert rc.allreduce(np.ones(3), op=rc.Sum).tolist() == [1.0, 1.0, 1.0]
    finally:
        rc.shutdown()
    assert rc.runtime.current_settings() == rc.Settings.from_env()  # after shutdown: the environment's again
    with pytest.raises(rc.InvalidTypeError, match="expected a ringcomm.Settings"):
        rc.init(settings={"fusion_threshold": 0})
    assert not rc.is_initialized()
