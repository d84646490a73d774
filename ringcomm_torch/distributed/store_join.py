"""How the ranks agree, through torch's store, on one join of the job, never reading an earlier one's values.

A launcher may hand the workers of a new attempt the same store as the last one (torchrun's
agent store outlives its restarts), so every key the ranks use may already hold a value a
dead process wrote.  Fixed keys are not enough (a restarted rank reads the last attempt's
plan before rank 0 writes the new one), and a launcher's attempt number is not either
(torchrun counts restarts per node: a node restarted only because another failed keeps its
count).  So each join is identified by random nonces, and a value counts only when it answers
this join's nonce:

1. every rank but 0 picks a nonce and writes ``hello/<r>`` = its host and nonce;
2. rank 0 picks its own nonce (the join's id) and answers each hello it reads with
   ``seen/<r>`` = ``<rank r's nonce>:<rank 0's nonce>`` -- a hello left by an earlier attempt
   is answered too, but nobody takes that answer, and rank 0 answers the fresh hello once
   rank r has overwritten it;
3. rank r takes only a ``seen/<r>`` that carries its own nonce, learns rank 0's nonce from it
   and writes ``ack/<r>`` = both nonces; rank 0 takes only an ack that carries both of the
   nonces it sent: then it knows rank r's host is this join's;
4. with every rank's host, rank 0 writes ``plan`` (the rendezvous address, the secret, the
   host names) under its nonce, and rank r takes only the plan that carries the nonce it
   learnt in step 3.

:class:`Leader` and :class:`Follower` are the two sides as pure objects (values in, writes
out); :func:`lead` and :func:`follow` run them against a store, polling until a deadline.

    >>> lead_ = Leader(2, "z", "hostA"); fol = Follower(1, "n", "hostB")
    >>> k, v = fol.hello(); lead_.on_hello(1, v)
    ('ringcomm/seen/1', b'n:z')
    >>> fol.on_seen(b'n:z')
    ('ringcomm/ack/1', b'n:z')
    >>> lead_.on_ack(1, b'n:z'), lead_.hostnames()
    (True, ['hostA', 'hostB'])
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

__all__ = ["PREFIX", "key", "Leader", "Follower", "lead", "follow", "lead_step", "follow_step", "keys_of_join",
           "JoinTimeout"]

#: Every key the "ringcomm" backend writes in torch's store starts with this.
PREFIX = "ringcomm/"
_POLL_SECONDS = (0.005, 0.05)  # first and longest pause between two looks at the store


def key(kind: str, rank: int | None = None) -> str:
    """The store key of one message of the join: ``ringcomm/plan``, ``ringcomm/hello/3``..."""
    return f"{PREFIX}{kind}" if rank is None else f"{PREFIX}{kind}/{rank}"


def keys_of_join(size: int) -> list[str]:
    """Every key a join of ``size`` ranks writes (rank 0 removes them once every rank has joined)."""
    return [key("plan")] + [key(kind, r) for r in range(1, size) for kind in ("hello", "seen", "ack")]


def _json(raw: bytes) -> dict[str, Any] | None:
    """``raw`` as a JSON object, or None (a value of another version or another program: not ours)."""
    try:
        value = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class Leader:
    """Rank 0's side: answers hellos, confirms them by their acks, then knows every rank's host."""

    def __init__(self, size: int, nonce: str, host: str) -> None:
        self.size = size
        self.nonce = nonce
        self._answered: dict[int, tuple[str, str]] = {}  # rank -> (its nonce, its host) answered in seen/<r>
        self._confirmed: dict[int, str] = {0: host}  # rank -> host, of this join

    def waiting_for(self) -> list[int]:
        """The ranks whose hello of this join is not confirmed yet."""
        return [r for r in range(self.size) if r not in self._confirmed]

    def on_hello(self, rank: int, raw: bytes) -> tuple[str, bytes] | None:
        """The value of ``hello/<rank>`` as read now -> the answer to write, if it is a new hello."""
        hello = _json(raw)
        if rank in self._confirmed or hello is None:
            return None
        nonce, host = hello.get("nonce"), hello.get("host")
        if not isinstance(nonce, str) or not isinstance(host, str) or self._answered.get(rank, ("",))[0] == nonce:
            return None
        self._answered[rank] = (nonce, host)
        return key("seen", rank), f"{nonce}:{self.nonce}".encode()

    def on_ack(self, rank: int, raw: bytes) -> bool:
        """The value of ``ack/<rank>`` as read now -> True once it confirms the hello answered last."""
        answered = self._answered.get(rank)
        if rank in self._confirmed:
            return True
        if answered is None or bytes(raw) != f"{answered[0]}:{self.nonce}".encode():
            return False
        self._confirmed[rank] = answered[1]
        return True

    def hostnames(self) -> list[str] | None:
        """Every rank's host name, in rank order, once every hello is confirmed."""
        if len(self._confirmed) < self.size:
            return None
        return [self._confirmed[r] for r in range(self.size)]

    def plan(self, body: dict[str, str]) -> tuple[str, bytes]:
        """The plan to publish: ``body`` (rendezvous, secret, job) with the host names and this join's nonce."""
        hosts = self.hostnames()
        if hosts is None:
            raise ValueError(f"the plan needs every rank's host; still waiting for ranks {self.waiting_for()}")
        return key("plan"), json.dumps({**body, "hosts": hosts, "join": self.nonce}).encode()


class Follower:
    """Rank r's side (r > 0): says hello, acks rank 0's answer to it, takes the plan of the same join."""

    def __init__(self, rank: int, nonce: str, host: str) -> None:
        self.rank = rank
        self.nonce = nonce
        self.host = host
        #: rank 0's nonce of this join, once its answer to this rank's hello came
        self.join: str | None = None

    def hello(self) -> tuple[str, bytes]:
        return key("hello", self.rank), json.dumps({"nonce": self.nonce, "host": self.host}).encode()

    def on_seen(self, raw: bytes) -> tuple[str, bytes] | None:
        """The value of ``seen/<rank>`` as read now -> the ack to write, if it answers this rank's hello."""
        mine, sep, join = bytes(raw).decode(errors="replace").partition(":")
        if not sep or mine != self.nonce or not join:
            return None
        self.join = join
        return key("ack", self.rank), f"{self.nonce}:{join}".encode()

    def on_plan(self, raw: bytes) -> dict[str, Any] | None:
        """The value of ``plan`` as read now -> the plan, if it is this join's."""
        plan = _json(raw)
        if self.join is None or plan is None or plan.get("join") != self.join:
            return None
        return plan


class JoinTimeout(TimeoutError):
    """The join did not complete before its deadline; ``waiting_for`` names the ranks (or what) it waited for."""

    def __init__(self, waiting_for: str) -> None:
        super().__init__(waiting_for)
        self.waiting_for = waiting_for


def _read(store: Any, k: str) -> bytes | None:
    """``k``'s value, or None while the store has no such key (never blocks on a missing key)."""
    if not store.check([k]):
        return None
    return bytes(store.get(k))


def _poll(step: Callable[[], bool], deadline: float, waiting_for: Callable[[], str]) -> None:
    """Call ``step`` until it returns True, pausing a little longer each time; JoinTimeout at ``deadline``."""
    pause = _POLL_SECONDS[0]
    while not step():
        if time.monotonic() >= deadline:
            raise JoinTimeout(waiting_for())
        time.sleep(pause)
        pause = min(pause * 2, _POLL_SECONDS[1])


def lead_step(store: Any, leader: Leader) -> bool:
    """One look at the store for rank 0: answer new hellos, take acks; True once every rank is confirmed."""
    for r in leader.waiting_for():
        hello = _read(store, key("hello", r))
        answer = leader.on_hello(r, hello) if hello is not None else None
        if answer is not None:
            store.set(*answer)
        ack = _read(store, key("ack", r))
        if ack is not None:
            leader.on_ack(r, ack)
    return not leader.waiting_for()


def follow_step(store: Any, follower: Follower) -> dict[str, Any] | None:
    """One look at the store for rank r (after its hello): ack rank 0's answer, then the plan once it is there."""
    if follower.join is None:
        seen = _read(store, key("seen", follower.rank))
        ack = follower.on_seen(seen) if seen is not None else None
        if ack is None:
            return None
        store.set(*ack)
    raw = _read(store, key("plan"))
    return follower.on_plan(raw) if raw is not None else None


def lead(store: Any, leader: Leader, deadline: float) -> list[str]:
    """Run rank 0's side until every rank's hello is confirmed; returns every rank's host name."""
    _poll(lambda: lead_step(store, leader), deadline,
          lambda: f"rank(s) {leader.waiting_for()} to say hello and take rank 0's answer")
    hosts = leader.hostnames()
    assert hosts is not None
    return hosts


def follow(store: Any, follower: Follower, deadline: float) -> dict[str, Any]:
    """Run rank r's side until it has this join's plan; returns the plan."""
    store.set(*follower.hello())
    found: list[dict[str, Any]] = []

    def step() -> bool:
        plan = follow_step(store, follower)
        if plan is not None:
            found.append(plan)
        return plan is not None

    _poll(step, deadline, lambda: "rank 0's plan (its rendezvous address)" if follower.join is not None
          else "rank 0 to answer this rank's hello")
    return found[0]
