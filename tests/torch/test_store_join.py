"""The join through torch's store (ringcomm_torch/distributed/store_join.py), in memory: whatever an earlier
attempt left in the store, and in whatever order the ranks look at it, every rank takes this join's plan."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from ringcomm_torch.distributed import store_join as sj  # noqa: E402

pytestmark = pytest.mark.pure


class DictStore:
    """The part of torch's Store the join uses."""

    def __init__(self, values: dict[str, bytes] | None = None) -> None:
        self.values = dict(values or {})

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, k: str) -> bytes:
        return self.values[k]

    def set(self, k: str, v: bytes) -> None:
        self.values[k] = bytes(v)


def _join(store: DictStore, size: int, tag: str, schedule: list[int], hosts: list[str],
          steps_allowed: int = 10_000) -> tuple[list[str] | None, dict[int, dict]]:
    """Run one join of ``size`` ranks on ``store``, the ranks taking turns in ``schedule``'s order (then round
    robin); nonces and the body carry ``tag``.  Returns rank 0's host list and each follower's plan."""
    leader = sj.Leader(size, f"{tag}-z", hosts[0])
    followers = {r: sj.Follower(r, f"{tag}-n{r}", hosts[r]) for r in range(1, size)}
    said_hello: set[int] = set()
    plans: dict[int, dict] = {}
    planned = False
    turns = schedule + [r % size for r in range(steps_allowed)]
    for r in turns:
        if planned and len(plans) == size - 1:
            break
        if r == 0:
            if not planned and sj.lead_step(store, leader):
                store.set(*leader.plan({"rendezvous": f"tcp://{tag}", "secret": "", "job": tag}))
                planned = True
        elif r not in said_hello:
            store.set(*followers[r].hello())
            said_hello.add(r)
        elif r not in plans:
            got = sj.follow_step(store, followers[r])
            if got is not None:
                plans[r] = got
    return leader.hostnames(), plans


@settings(max_examples=150, deadline=None)
@given(size=st.integers(2, 5), data=st.data())
def test_a_join_never_takes_an_earlier_attempts_values(size, data):
    """An earlier attempt (complete, or cut off at any point) left its keys; the next join, in any order,
    gives every rank the new plan and the new host names, never the old ones."""
    store = DictStore()
    old_hosts = [f"old{r}" for r in range(size)]
    cut = data.draw(st.integers(0, 200), label="earlier attempt's steps before it died")
    _join(store, size, "old", data.draw(st.lists(st.integers(0, size - 1), max_size=30)), old_hosts,
          steps_allowed=cut)
    new_hosts = [f"new{r}" for r in range(size)]
    hosts, plans = _join(store, size, "new", data.draw(st.lists(st.integers(0, size - 1), max_size=60)), new_hosts)
    assert hosts == new_hosts
    assert sorted(plans) == list(range(1, size))
    for plan in plans.values():
        assert plan["rendezvous"] == "tcp://new" and plan["hosts"] == new_hosts and plan["join"] == "new-z"


def test_a_stale_plan_and_a_stale_hello_are_passed_over():
    """The case torchrun's restarts hit: the last attempt's plan is in the store when a restarted rank looks."""
    store = DictStore()
    _join(store, 3, "old", [], ["a", "b", "c"])
    assert json.loads(store.values[sj.key("plan")])["join"] == "old-z"
    fresh = sj.Follower(2, "n2", "c")
    store.set(*fresh.hello())
    assert sj.follow_step(store, fresh) is None  # the old seen/2 answers another nonce; the old plan is not taken
    assert fresh.join is None
    # rank 0 of the new join reads rank 1's old hello (and rank 2's new one): both get an answer
    leader = sj.Leader(3, "z", "a")
    assert not sj.lead_step(store, leader) and leader.waiting_for() == [1, 2]
    assert sj.follow_step(store, fresh) is None  # rank 2 acks rank 0's answer; the old plan is still not taken
    assert fresh.join == "z"
    late = sj.Follower(1, "n1", "b")
    store.set(*late.hello())
    assert sj.follow_step(store, late) is None and late.join is None  # seen/1 answers the old hello
    assert not sj.lead_step(store, leader) and leader.waiting_for() == [1]  # answers the new hello
    assert sj.follow_step(store, late) is None and late.join == "z"  # acks it
    assert sj.lead_step(store, leader) and leader.hostnames() == ["a", "b", "c"]
    store.set(*leader.plan({"rendezvous": "tcp://x:1", "secret": "", "job": "j"}))
    assert sj.follow_step(store, late)["rendezvous"] == "tcp://x:1"
    assert sj.follow_step(store, fresh)["join"] == "z"


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"[1, 2]", b'{"nonce": 3, "host": "h"}', b"not json"])
def test_values_of_another_program_are_ignored(raw):
    leader = sj.Leader(2, "z", "a")
    assert leader.on_hello(1, raw) is None
    follower = sj.Follower(1, "n", "b")
    assert follower.on_seen(raw) is None and follower.on_plan(raw) is None


def test_the_plan_needs_every_host_and_the_keys_of_a_join():
    leader = sj.Leader(3, "z", "a")
    with pytest.raises(ValueError, match=r"waiting for ranks \[1, 2\]"):
        leader.plan({})
    assert sj.keys_of_join(3) == ["ringcomm/plan", "ringcomm/hello/1", "ringcomm/seen/1", "ringcomm/ack/1",
                                  "ringcomm/hello/2", "ringcomm/seen/2", "ringcomm/ack/2"]


def test_follow_times_out_naming_what_it_waited_for():
    with pytest.raises(sj.JoinTimeout, match="rank 0 to answer this rank's hello"):
        sj.follow(DictStore(), sj.Follower(1, "n", "b"), deadline=0.0)
    with pytest.raises(sj.JoinTimeout, match=r"rank\(s\) \[1\]"):
        sj.lead(DictStore(), sj.Leader(2, "z", "a"), deadline=0.0)
