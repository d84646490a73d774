"""Run a ringcomm job on a Ray cluster: N actors, a function on all of them, their results back.

The shape of ``horovod.ray.RayExecutor``::

    import ray
    from ringcomm.ray import RayExecutor

    def train(lr):
        import ringcomm_torch as hvd
        hvd.init()
        ...                                   # the usual Horovod-style training
        return hvd.rank(), final_loss

    ray.init()                                # or ray.init(address="auto") on a cluster
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=4, cpus_per_worker=2, use_gpu=False)
    executor.start()
    results = executor.run(train, args=[0.01])   # one result per worker, in rank order
    executor.shutdown()

``start()`` creates the actors and gives each its place in the job: ranks are
grouped by node (local ranks on one node are consecutive), and rank 0's actor
serves the job's rendezvous on its node's address, on a port it picked.  Every
actor's environment then holds the ``RINGCOMM_*`` variables ``ringcomm-run``
would set, so ``ringcomm.init()`` / ``ringcomm_torch.init()`` inside ``fn``
join the job.  A worker that dies (its process killed, its node lost) makes
the other workers' collectives fail with ``PeerLostError`` naming its rank;
``run`` raises that error (a ``ray.exceptions.RayTaskError`` wrapping it, or
``RayActorError`` for the dead actor).

Ray is an optional dependency: ``pip install 'ringcomm[ray]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import UnsupportedError
from ..job import config

__all__ = ["RayExecutor", "RaySettings", "plan_ranks"]


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """What :meth:`RayExecutor.create_settings` returns."""

    #: seconds every rank waits at the rendezvous for the others (``RINGCOMM_START_TIMEOUT``)
    timeout_s: float = 30.0
    #: seconds ``start()`` waits for Ray to place all actors (the cluster may need to grow)
    placement_group_timeout_s: float = 100.0
    #: extra environment variables set in every actor before ``fn`` runs (e.g. ``RINGCOMM_*`` settings)
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def plan_ranks(nodes: Sequence[str]) -> tuple[list[int], list[dict[str, str]]]:
    """Ranks for actors on ``nodes`` (actor i's node): ``(actor index of each rank, env of each rank)``.

    Ranks of one node are consecutive, nodes in order of their first actor;
    the env holds rank, size, local and cross rank/size.  Pure.
    """
    order: list[str] = []
    for node in nodes:
        if node not in order:
            order.append(node)
    by_rank = [i for node in order for i, n in enumerate(nodes) if n == node]
    envs = []
    for rank, actor in enumerate(by_rank):
        node = nodes[actor]
        same = [a for a in by_rank if nodes[a] == node]
        envs.append({
            "RINGCOMM_RANK": str(rank), "RINGCOMM_SIZE": str(len(nodes)),
            "RINGCOMM_LOCAL_RANK": str(same.index(actor)), "RINGCOMM_LOCAL_SIZE": str(len(same)),
            "RINGCOMM_CROSS_RANK": str(order.index(node)), "RINGCOMM_CROSS_SIZE": str(len(order)),
        })
    return by_rank, envs


class _Worker:
    """One rank: lives in a Ray actor process; rank 0's also serves the rendezvous."""

    def __init__(self) -> None:
        self._server: Any = None
        self.executable: Any = None

    def node(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def hostname(self) -> str:
        return socket.gethostname()

    def serve_rendezvous(self, size: int, secret_hex: str, port_range: str = "") -> str:
        """Start the job's rendezvous in this process, on this node's address (a port of ``port_range``,
        RINGCOMM_PORT_RANGE's form; empty: any free one); returns its address."""
        from ..job import ports
        from ..net.rendezvous import RendezvousServer

        host = self.node()
        self._server = RendezvousServer(size=size, secret=bytes.fromhex(secret_hex), host="0.0.0.0",
                                        ports=ports.parse(port_range))
        return f"tcp://{host}:{self._server.port}"

    def update_env_vars(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def start_executable(self, cls: type | None, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        if cls is not None:
            self.executable = cls(*args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.executable)

    def stop(self) -> None:
        import ringcomm

        if ringcomm.is_initialized():
            ringcomm.shutdown()
        if self._server is not None:
            self._server.close()
            self._server = None


class RayExecutor:
    """Start ``num_workers`` Ray actors as the ranks of one ringcomm job and run functions on them.

    Each actor asks Ray for ``cpus_per_worker`` CPUs (and ``gpus_per_worker`` GPUs, default 1, with
    ``use_gpu``); Horovod's ``num_hosts``/``num_workers_per_host`` and ``*_per_slot`` spellings are
    accepted.  ``use_current_placement_group`` is accepted and has no effect: the actors are
    plain Ray actors, placed where Ray finds the resources.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30.0, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100.0,
                        nics: set[str] | None = None, env: dict[str, str] | None = None) -> RaySettings:
        """Settings for the executor.

        ``ssh_identity_file`` and ``ssh_str`` (Horovod's) are accepted and unused: Ray starts
        the workers.  ``nics``: one interface name sets ``RINGCOMM_NETWORK_INTERFACE``.
        """
        extra = dict(env or {})
        if nics:
            if len(nics) != 1:
                raise ValueError(f"RayExecutor uses one network interface; nics={sorted(nics)} names {len(nics)}")
            extra.setdefault("RINGCOMM_NETWORK_INTERFACE", next(iter(nics)))
        return RaySettings(float(timeout_s), float(placement_group_timeout_s), extra)

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_slot: float | None = None,
        gpus_per_slot: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
    ) -> None:
        if min_workers is not None or max_workers is not None:
            raise UnsupportedError(
                "RayExecutor runs a fixed number of workers (num_workers=...); min_workers/max_workers "
                "(elastic training on Ray) are not supported: use ringcomm-run --min-np/--max-np for elastic jobs"
            )
        if num_workers is None:
            if num_hosts is None:
                raise ValueError("RayExecutor needs num_workers=N (or num_hosts=H with num_workers_per_host=W)")
            num_workers = num_hosts * num_workers_per_host
        if num_workers < 1:
            raise ValueError(f"RayExecutor num_workers must be >= 1, got {num_workers}")
        self.settings = settings or RaySettings()
        self.num_workers = int(num_workers)
        self.cpus_per_worker = float(cpus_per_slot if cpus_per_slot is not None else cpus_per_worker)
        self.use_gpu = bool(use_gpu)
        gpus = gpus_per_slot if gpus_per_slot is not None else gpus_per_worker
        self.gpus_per_worker = float(gpus if gpus is not None else 1) if self.use_gpu else 0.0
        self.workers: list[Any] = []

    def start(self, executable_cls: type | None = None, executable_args: Sequence[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None, extra_env_vars: dict[str, str] | None = None) -> None:
        """Create the actors, place them in one job, and build ``executable_cls`` in each (when given)."""
        import ray

        if self.workers:
            raise RuntimeError("RayExecutor.start() was already called; call shutdown() first")
        actor_cls: Any = ray.remote(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker)(_Worker)
        actors = [actor_cls.remote() for _ in range(self.num_workers)]
        try:
            nodes = ray.get([a.node.remote() for a in actors], timeout=self.settings.placement_group_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for a in actors:
                ray.kill(a)
            raise TimeoutError(
                f"Ray did not place {self.num_workers} workers of {self.cpus_per_worker:g} CPUs and "
                f"{self.gpus_per_worker:g} GPUs within {self.settings.placement_group_timeout_s:g} s "
                "(placement_group_timeout_s): is the cluster big enough?"
            ) from None
        by_rank, envs = plan_ranks(nodes)
        self.workers = [actors[i] for i in by_rank]
        secret = secrets.token_hex(16)
        port_range = config.port_range({**os.environ, **self.settings.env, **(extra_env_vars or {})})
        address = ray.get(self.workers[0].serve_rendezvous.remote(self.num_workers, secret,
                                                                  str(port_range or "")))
        common = {
            "RINGCOMM_RENDEZVOUS_ADDR": address, "RINGCOMM_SECRET": secret, "RINGCOMM_JOB_ID": secrets.token_hex(4),
            "RINGCOMM_START_TIMEOUT": str(self.settings.timeout_s), **self.settings.env, **(extra_env_vars or {}),
        }
        ray.get([w.update_env_vars.remote({**common, **env}) for w, env in zip(self.workers, envs)])
        ray.get([w.start_executable.remote(executable_cls, list(executable_args or []), dict(executable_kwargs or {}))
                 for w in self.workers])

    def _started(self) -> list[Any]:
        if not self.workers:
            raise RuntimeError("RayExecutor has no workers: call start() first")
        return self.workers

    def execute(self, fn: Callable[[Any], Any]) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        import ray

        return ray.get([w.execute.remote(fn) for w in self._started()])

    def run_remote(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the ``ObjectRef`` of each result, in rank order."""
        a, kw = list(args or []), dict(kwargs or {})
        return [w.execute.remote(lambda _executable: fn(*a, **kw)) for w in self._started()]

    def run(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
            kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        import ray

        return ray.get(self.run_remote(fn, args, kwargs))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0's worker only."""
        import ray

        return ray.get(self._started()[0].execute.remote(fn))

    def shutdown(self) -> None:
        """Leave the job on every worker and end the actors."""
        import ray

        workers, self.workers = self.workers, []
        # a dead actor cannot stop; it is killed below all the same
        with contextlib.suppress(Exception):
            ray.get([w.stop.remote() for w in workers], timeout=30)
        for w in workers:
            ray.kill(w)
