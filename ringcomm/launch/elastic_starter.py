"""Starting an elastic job's workers: here as child processes, on other hosts through ssh.

A discovered host that is this machine under some name (``localhost``,
``127.0.0.x``, its host name, an address of one of its interfaces) gets its
workers as local children.  Any other host gets them the way ``ringcomm-run
-H`` starts remote ranks (:mod:`ringcomm.launch.remote`): ``--ssh-command HOST 'cd
DIR && exec env VARS... python -m ringcomm.launch.rexec ... COMMAND'``, with the
job's secret written into the ssh's input (never on a command line), and the
worker stopped by closing that input.

Addresses.  The driver's servers (its key-value store, and each generation's
rendezvous) must be reachable from every host a worker may ever run on, and
hosts appear while the job runs.  So they listen on ``--network-interface``'s
address when one is given, else on every interface (``0.0.0.0``; every
request is authenticated with the job's secret), and each worker is told the
address that leads to the driver from its host: ``127.0.0.1`` on this
machine, the local address that routes toward a remote host (or the
interface's) otherwise.

    >>> starter = WorkerStarter(args, os.environ, job_id, secret)
    >>> starter.is_remote("localhost"), starter.advertised(["localhost"])
    (False, '127.0.0.1')
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
from collections.abc import Iterable, Mapping

from ..job import netaddr
from . import remote
from .supervise import REMOTE_GRACE_SECONDS, Worker, spawn
from ..errors import InvalidInputError
from .elastic_discovery import is_local_host
from ..elastic.plan import Assignment
from ..elastic.worker import TIMEOUT_VAR, WORKER_VAR

__all__ = ["WorkerStarter", "REMOTE_GRACE_SECONDS"]

#: rexec's rank for elastic workers: a worker's rank changes with each generation, so rexec must not
#: remove shared-memory rings by rank (it still removes the socket files of dead processes).
_NO_RANK = -1
#: Variables the driver sets per worker; a value inherited from the launcher's environment is dropped.
_PLACE_VARS = ("RINGCOMM_RANK", "RINGCOMM_SIZE", "RINGCOMM_LOCAL_RANK", "RINGCOMM_LOCAL_SIZE",
               "RINGCOMM_CROSS_RANK", "RINGCOMM_CROSS_SIZE")


class WorkerStarter:
    """Knows which hosts are remote, which addresses reach the driver, and starts one worker on a host."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str], job_id: str, secret: bytes,
                 timeout: float, most_workers: int) -> None:
        self.args = args
        self.environ = dict(environ)
        self.job_id = job_id
        self.secret = secret
        self.timeout = timeout
        self.most_workers = most_workers
        self.interface: str | None = getattr(args, "network_interface", None)
        self._remote: dict[str, bool] = {}
        self._route: dict[str, str] = {}
        self.store_port = 0

    # ------------------------------------------------------------------ where

    def bind_host(self) -> str:
        """The address the driver's servers listen on: the chosen interface's, else every interface."""
        if self.interface:
            return netaddr.interface_address(self.interface)
        return "0.0.0.0"

    def is_remote(self, host: str) -> bool:
        """True when ``host`` is not this machine (its workers start through ssh)."""
        if host not in self._remote:
            local = is_local_host(host)
            if not local:
                try:
                    local = netaddr.is_local_host(host)
                except InvalidInputError:
                    local = False  # ssh will say what is wrong with the name; the host's failures count
            self._remote[host] = not local
        return self._remote[host]

    def address_toward(self, host: str) -> str:
        """The driver's address as seen from ``host``; raises InvalidInputError when no route leads there."""
        if not self.is_remote(host):
            return netaddr.interface_address(self.interface) if self.interface else "127.0.0.1"
        if host not in self._route:
            self._route[host] = (netaddr.interface_address(self.interface) if self.interface
                                 else netaddr.route_source(host))
        return self._route[host]

    def advertised(self, hosts: Iterable[str]) -> str:
        """The address a generation's rendezvous is announced at: one that every host in ``hosts`` reaches."""
        remote_hosts = [h for h in hosts if self.is_remote(h)]
        return self.address_toward(remote_hosts[0]) if remote_hosts else self.address_toward("localhost")

    # ------------------------------------------------------------------ what

    def env(self, wid: int, host: str, place: Assignment | None = None) -> dict[str, str]:
        """The environment of worker ``wid`` on ``host`` (the secret included; it goes over ssh's input).

        ``place``, the worker's seat in the generation it starts into, gives it horovodrun's
        ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ... and ``HOROVOD_HOSTNAME`` (its host as discovered), as
        Horovod's elastic driver does: they tell where the worker started, ``rank()`` where it is now.
        """
        env = dict(self.environ)
        for key in _PLACE_VARS:
            env.pop(key, None)
        env.update({
            WORKER_VAR: str(wid),
            TIMEOUT_VAR: repr(2 * self.timeout + 60.0),
            "RINGCOMM_RENDEZVOUS_ADDR": f"tcp://{self.address_toward(host)}:{self.store_port}",
            "RINGCOMM_SECRET": self.secret.hex(),
            "RINGCOMM_JOB_ID": self.job_id,
            "RINGCOMM_HOSTNAME": host,
            "PYTHONUNBUFFERED": "1",
        })
        if place is not None:
            env.update({
                "HOROVOD_HOSTNAME": host, "HOROVOD_ELASTIC": "1",
                "HOROVOD_RANK": str(place.rank), "HOROVOD_SIZE": str(place.size),
                "HOROVOD_LOCAL_RANK": str(place.local_rank), "HOROVOD_LOCAL_SIZE": str(place.local_size),
                "HOROVOD_CROSS_RANK": str(place.cross_rank), "HOROVOD_CROSS_SIZE": str(place.cross_size),
            })
        if "OMP_NUM_THREADS" not in self.environ and self.most_workers > 1:
            env["OMP_NUM_THREADS"] = "1"
        if self.args.start_timeout is not None:
            env["RINGCOMM_START_TIMEOUT"] = repr(float(self.args.start_timeout))
        if self.args.timeline_filename is not None:
            env["RINGCOMM_TIMELINE"] = self.args.timeline_filename
        if self.interface:
            env["RINGCOMM_NETWORK_INTERFACE"] = self.interface
        return env

    def start(self, wid: int, host: str, exits: "queue.Queue[Worker]", place: Assignment | None = None) -> Worker:
        """Start worker ``wid`` on ``host``; raises OSError (ssh or the program missing), InvalidInputError."""
        env = self.env(wid, host, place)
        if not self.is_remote(host):
            return spawn(wid, self.args.command, env, exits, host)
        forwarded = remote.forwarded_env(env)
        secret = forwarded.pop("RINGCOMM_SECRET")  # never on a command line: it goes through the ssh's input
        line = remote.remote_command(os.getcwd(), forwarded, self.args.command, sys.executable, self.job_id,
                                     _NO_RANK, REMOTE_GRACE_SECONDS, secret_on_stdin=True)
        argv = remote.ssh_argv(self.args.ssh_command, self.args.ssh_port, self.args.ssh_identity_file, host, line)
        worker = spawn(wid, argv, os.environ, exits, host, remote=True)
        worker.send_input(secret + "\n")
        return worker
