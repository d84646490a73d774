"""Starting elastic workers (ringcomm.launch.elastic_starter) and calling off a rendezvous round, in one process.

- which discovered hosts are remote, and the driver's address each host is told;
- a remote worker's ssh command line: the same -p / -i handling as static jobs, the secret only on the ssh's
  input, rexec told no rank (an elastic worker's rank changes with each generation);
- ``RendezvousServer.abort``: ranks waiting in ``register`` get ``RendezvousAbortedError`` at once, later ones
  too, while a completed round still answers a late retry.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import queue
import shlex
import time

import pytest

from ringcomm.launch import elastic_starter as starter_mod
from ringcomm.launch.elastic_starter import WorkerStarter
from ringcomm.errors import RendezvousAbortedError, RendezvousError
from ringcomm.net.rendezvous import RendezvousServer, register

SECRET = b"k" * 32
REMOTE = "192.0.2.7"  # TEST-NET-1: never an address of this machine


def make_args(**over: object) -> argparse.Namespace:
    base = dict(command=["python", "train.py", "--lr", "0.1"], ssh_command="ssh -o BatchMode=yes", ssh_port=2222,
                ssh_identity_file="/keys/id", network_interface=None, start_timeout=None, timeline_filename=None)
    base.update(over)
    return argparse.Namespace(**base)


@pytest.fixture
def starter(monkeypatch: pytest.MonkeyPatch) -> WorkerStarter:
    monkeypatch.setattr(starter_mod.netaddr, "route_source", lambda host: "10.9.9.1")
    env = {"PATH": "/usr/bin", "HOME": "/root", "RINGCOMM_RANK": "5", "SSH_AUTH_SOCK": "/tmp/a", "LR": "0.1"}
    made = WorkerStarter(make_args(), env, "ab12cd34", SECRET, timeout=30.0, most_workers=4)
    made.store_port = 4242
    return made


def test_local_names_start_here_and_other_hosts_over_ssh(starter: WorkerStarter) -> None:
    assert not starter.is_remote("localhost") and not starter.is_remote("127.0.0.3")
    assert starter.is_remote(REMOTE) and starter.is_remote("no-such-host.invalid")


def test_each_host_is_told_the_driver_address_that_routes_from_it(starter: WorkerStarter) -> None:
    assert starter.bind_host() == "0.0.0.0"  # hosts may appear later: every interface, requests authenticated
    assert starter.advertised(["localhost", "127.0.0.2"]) == "127.0.0.1"
    assert starter.advertised(["localhost", REMOTE]) == "10.9.9.1"
    here, there = starter.env(0, "localhost"), starter.env(3, REMOTE)
    assert here["RINGCOMM_RENDEZVOUS_ADDR"] == "tcp://127.0.0.1:4242"
    assert there["RINGCOMM_RENDEZVOUS_ADDR"] == "tcp://10.9.9.1:4242"
    assert (there["RINGCOMM_ELASTIC_WORKER"], there["RINGCOMM_HOSTNAME"], there["OMP_NUM_THREADS"]) == ("3", REMOTE, "1")
    assert "RINGCOMM_RANK" not in there and there["RINGCOMM_SECRET"] == SECRET.hex()


def test_a_chosen_interface_is_bound_advertised_and_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starter_mod.netaddr, "interface_address", lambda name: {"eth7": "10.1.1.5"}[name])
    made = WorkerStarter(make_args(network_interface="eth7"), {}, "j", SECRET, timeout=5.0, most_workers=1)
    assert made.bind_host() == "10.1.1.5" and made.advertised([REMOTE]) == "10.1.1.5"
    env = made.env(0, REMOTE)
    assert env["RINGCOMM_NETWORK_INTERFACE"] == "eth7" and "OMP_NUM_THREADS" not in env


class FakeWorker:
    def __init__(self) -> None:
        self.remote = True
        self.sent: list[str] = []

    def send_input(self, text: str) -> None:
        self.sent.append(text)


def test_a_remote_worker_is_an_ssh_with_the_secret_on_its_input_only(starter: WorkerStarter,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    fake = FakeWorker()

    def fake_spawn(wid, argv, env, exits, host="", remote=False):  # noqa: ANN001, ANN202 - a test double
        calls.append((wid, list(argv), host, remote))
        return fake

    monkeypatch.setattr(starter_mod, "spawn", fake_spawn)
    worker = starter.start(3, REMOTE, queue.Queue())
    assert worker is fake and fake.sent == [SECRET.hex() + "\n"]
    (wid, argv, host, remote), = calls
    assert (wid, host, remote) == (3, REMOTE, True)
    assert argv[:7] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/keys/id"] and argv[7] == REMOTE
    line = argv[8]
    assert SECRET.hex() not in line and "RINGCOMM_SECRET" not in line
    words = shlex.split(line.partition("&& exec ")[2])
    assert "RINGCOMM_ELASTIC_WORKER=3" in words and "RINGCOMM_RENDEZVOUS_ADDR=tcp://10.9.9.1:4242" in words
    assert "SSH_AUTH_SOCK=/tmp/a" not in words and "HOME=/root" not in words  # session variables stay here
    tail = words[words.index("ringcomm.launch.rexec"):]
    assert tail[tail.index("--rank") + 1] == "-1" and "--secret-on-stdin" in tail
    assert tail[tail.index("--") + 1:] == ["python", "train.py", "--lr", "0.1"]


def test_a_local_worker_is_a_child_with_its_environment(starter: WorkerStarter, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_spawn(wid, argv, env, exits, host="", remote=False):  # noqa: ANN001, ANN202 - a test double
        seen.update(argv=list(argv), env=dict(env), remote=remote)
        return FakeWorker()

    monkeypatch.setattr(starter_mod, "spawn", fake_spawn)
    starter.start(1, "127.0.0.2", queue.Queue())
    assert seen["argv"] == ["python", "train.py", "--lr", "0.1"] and not seen["remote"]
    assert seen["env"]["RINGCOMM_SECRET"] == SECRET.hex() and seen["env"]["RINGCOMM_HOSTNAME"] == "127.0.0.2"


def test_abort_answers_the_waiting_ranks_at_once_and_refuses_later_ones() -> None:
    with RendezvousServer(size=3, secret=SECRET) as server:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(register, server.address, SECRET, r, 3, {"r": r}, 30.0, 1) for r in (0, 1)]
            deadline = time.monotonic() + 5
            while len(server.registrations(1)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            start = time.monotonic()
            server.abort("worker 2 exited with code 3")
            for future in waiting:
                with pytest.raises(RendezvousAbortedError, match="called off: worker 2 exited with code 3"):
                    future.result(timeout=10)
            assert time.monotonic() - start < 5.0  # not the 30 s register timeout
        with pytest.raises(RendezvousAbortedError):
            register(server.address, SECRET, 2, 3, {"r": 2}, 5.0, 1)
        assert issubclass(RendezvousAbortedError, RendezvousError)


def test_a_completed_round_still_answers_a_late_retry_after_abort() -> None:
    with RendezvousServer(size=2, secret=SECRET) as server:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            tables = [f.result(10) for f in [pool.submit(register, server.address, SECRET, r, 2, {"r": r}, 10.0, 0)
                                             for r in (0, 1)]]
        server.abort("too late to matter")
        assert register(server.address, SECRET, 1, 2, {"r": 1}, 5.0, 0) == tables[1] == [{"r": 0}, {"r": 1}]


def test_a_worker_is_told_horovodruns_variables_for_the_seat_it_starts_in(starter: WorkerStarter) -> None:
    from ringcomm.elastic.plan import Assignment

    seat = Assignment(wid=5, host="127.0.0.2", rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2)
    env = starter.env(5, "127.0.0.2", seat)
    told = {k: env[k] for k in env if k.startswith("HOROVOD_")}
    assert told == {"HOROVOD_HOSTNAME": "127.0.0.2", "HOROVOD_ELASTIC": "1", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4",
                    "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1",
                    "HOROVOD_CROSS_SIZE": "2"}
    assert not any(k.startswith("HOROVOD_") for k in starter.env(5, "127.0.0.2"))  # no seat given: none
