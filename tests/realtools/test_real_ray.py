"""ringcomm.ray.RayExecutor on a local Ray cluster started by the test (``ray.init()``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from _tools import HERE, ROOT, module_missing

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]

_MISSING = module_missing("ray", "ray")
if _MISSING is not None:
    pytest.skip(_MISSING, allow_module_level=True)
import ray  # noqa: E402

from ringcomm.ray import RayExecutor, plan_ranks  # noqa: E402


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # the workers import ringcomm and this module (its functions travel by reference)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(HERE), before]))
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 1024 * 1024, log_to_driver=False,
             configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def collective(scale: float) -> tuple[int, int, list[float], list[int]]:
    import ringcomm as rc

    rc.init()
    total = rc.allreduce(np.full(3, rc.rank() + 1.0) * scale, op=rc.Sum)
    ranks = rc.allgather(np.array([rc.rank()])).tolist()
    return rc.rank(), rc.size(), total.tolist(), ranks


def test_plan_ranks_groups_actors_by_node() -> None:
    by_rank, envs = plan_ranks(["b", "a", "b", "a", "c"])
    assert by_rank == [0, 2, 1, 3, 4]
    assert [(e["RINGCOMM_LOCAL_RANK"], e["RINGCOMM_LOCAL_SIZE"], e["RINGCOMM_CROSS_RANK"]) for e in envs] == [
        ("0", "2", "0"), ("1", "2", "0"), ("0", "2", "1"), ("1", "2", "1"), ("0", "1", "2")]
    assert {e["RINGCOMM_SIZE"] for e in envs} == {"5"} and {e["RINGCOMM_CROSS_SIZE"] for e in envs} == {"3"}


@pytest.mark.timeout(120)
def test_two_workers_run_a_collective_and_return_both_results(local_ray: None) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2, cpus_per_worker=1)
    executor.start()
    try:
        results = executor.run(collective, args=[2.0])
        assert results == [(0, 2, [6.0, 6.0, 6.0], [0, 1]), (1, 2, [6.0, 6.0, 6.0], [0, 1])]
        # a second function joins the same job again (init after shutdown inside fn)
        again = executor.run(lambda: collective(1.0)[2])
        assert again == [[3.0, 3.0, 3.0]] * 2
        assert executor.execute(lambda executable: executable) == [None, None]
        assert executor.execute_single(lambda executable: os.environ["RINGCOMM_RANK"]) == "0"
    finally:
        executor.shutdown()


class Trainer:
    def __init__(self, base: float) -> None:
        self.base = base

    def step(self) -> float:
        import ringcomm as rc

        if not rc.is_initialized():
            rc.init()
        return float(rc.allreduce(np.array([self.base + rc.rank()]), op=rc.Sum)[0])


@pytest.mark.timeout(120)
def test_executable_class_lives_in_each_worker(local_ray: None) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start(executable_cls=Trainer, executable_args=[10.0])
    try:
        assert executor.execute(lambda trainer: trainer.step()) == [21.0, 21.0]
    finally:
        executor.shutdown()


def die_on_rank_1() -> float:
    import signal

    import ringcomm as rc

    rc.init()
    rc.allreduce(np.ones(2), name="before")
    if rc.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(200):
        rc.allreduce(np.ones(2), name=f"after_{step}")
    return 0.0


@pytest.mark.timeout(120)
def test_a_killed_worker_is_named(local_ray: None) -> None:
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=2)
    executor.start()
    try:
        survivor, dead = executor.run_remote(die_on_rank_1)
        # rank 0's task fails with ringcomm's error naming the dead rank; rank 1's actor is gone
        with pytest.raises(Exception, match="PeerLostError.*rank 0: lost rank 1"):
            ray.get(survivor, timeout=90)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(dead, timeout=90)
        with pytest.raises(ray.exceptions.RayError):  # run() raises the first failure Ray sees
            executor.run(lambda: __import__("ringcomm").allreduce(np.ones(1)))
    finally:
        executor.shutdown()


def test_elastic_arguments_are_refused_naming_the_alternative() -> None:
    with pytest.raises(NotImplementedError, match="ringcomm-run --min-np/--max-np"):
        RayExecutor(RayExecutor.create_settings(), min_workers=1, max_workers=4)
    with pytest.raises(RuntimeError, match="call start\\(\\) first"):
        RayExecutor(RayExecutor.create_settings(), num_workers=2).run(print)
    with pytest.raises(TypeError):  # a misspelt argument is not swallowed
        RayExecutor(RayExecutor.create_settings(), num_worker=2)  # type: ignore[call-arg]
    assert RayExecutor.create_settings(nics={"lo"}).env == {"RINGCOMM_NETWORK_INTERFACE": "lo"}
