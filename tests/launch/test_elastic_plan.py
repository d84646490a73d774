"""Pure tests of elastic training: rank assignment, blacklisting, discovery parsing, the sampler's
re-partitioning, State/ObjectState/TorchState and the ``run`` decorator's recovery loop (no sockets)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.launch.elastic_discovery import DiscoveryError, HostDiscoveryScript, is_local_host, parse_hosts
from ringcomm.elastic.plan import Blacklist, Member, assign_ranks, free_slots, new_worker_hosts

pytestmark = pytest.mark.pure

HOSTS = ["localhost", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
members_st = st.lists(st.sampled_from(HOSTS), min_size=1, max_size=12).map(
    lambda hosts: [Member(i * 3 + 1, h) for i, h in enumerate(hosts)])


# ----------------------------------------------------------------------------- rank assignment


@given(members_st)
def test_assign_ranks_keeps_order_and_gives_consistent_local_and_cross_ranks(members):
    out = assign_ranks(members)
    assert [a.wid for a in out] == [m.wid for m in members]  # survivors first keep rank order: rank 0 has state
    assert [a.rank for a in out] == list(range(len(members)))
    assert all(a.size == len(members) for a in out)
    by_host = collections.defaultdict(list)
    for a in out:
        by_host[a.host].append(a)
    for group in by_host.values():
        assert [a.local_rank for a in group] == list(range(len(group)))
        assert all(a.local_size == len(group) for a in group)
    by_local = collections.defaultdict(list)
    for a in out:
        by_local[a.local_rank].append(a)
    for group in by_local.values():
        assert [a.cross_rank for a in group] == list(range(len(group)))
        assert all(a.cross_size == len(group) for a in group)
        assert len({a.host for a in group}) == len(group)


def test_assign_ranks_refuses_duplicate_workers():
    with pytest.raises(ValueError, match="unique"):
        assign_ranks([Member(1, "a"), Member(1, "b")])


# ----------------------------------------------------------------------------- new workers, blacklist


@given(st.dictionaries(st.sampled_from(HOSTS), st.integers(1, 4), max_size=4), members_st,
       st.sets(st.sampled_from(HOSTS)), st.integers(1, 16))
def test_new_workers_respect_slots_limit_and_blacklist(hosts, running, blocked, limit):
    running = [m for m in running if m.host in hosts and sum(r.host == m.host for r in running) <= hosts[m.host]]
    bl = Blacklist(failures=1, cooldown=100.0)
    for h in blocked:
        bl.record_failure(h, now=0.0)
    new = new_worker_hosts(hosts, running, bl, now=1.0, limit=limit)
    assert len(running) + len(new) <= max(limit, len(running))
    assert not set(new) & blocked
    used = collections.Counter(m.host for m in running) + collections.Counter(new)
    assert all(used[h] <= hosts[h] for h in new)
    # as many as the limit and the free slots allow
    free = sum(free_slots(hosts, running, bl, now=1.0).values())
    assert len(new) == max(0, min(free, limit - len(running)))
    # after the cooldown the blacklisted hosts are usable again
    later = new_worker_hosts(hosts, running, bl, now=1000.0, limit=limit)
    assert len(later) >= len(new)


def test_new_workers_fill_hosts_in_discovery_order():
    running = [Member(0, "a")]
    assert new_worker_hosts({"a": 2, "b": 2, "c": 1}, running, Blacklist(), 0.0, limit=4) == ["a", "b", "b"]


def test_blacklist_needs_repeated_failures_and_cooldown_doubles():
    bl = Blacklist(failures=2, cooldown=10.0, max_cooldown=25.0)
    assert not bl.record_failure("h", 0.0) and not bl.blacklisted("h", 0.0)
    assert bl.record_failure("h", 1.0) and bl.blacklisted("h", 10.9) and not bl.blacklisted("h", 11.0)
    assert not bl.record_failure("h", 5.0)  # failures while blacklisted do not count
    assert not bl.blacklisted("other", 5.0)
    bl.record_failure("h", 20.0)
    assert bl.record_failure("h", 20.0) and bl.blacklisted("h", 39.9) and not bl.blacklisted("h", 40.0)  # 2 x 10
    bl.record_failure("h", 50.0)
    assert bl.record_failure("h", 50.0) and bl.until("h") == 75.0  # 40 s capped at 25
    with pytest.raises(ValueError):
        Blacklist(failures=0)


# ----------------------------------------------------------------------------- discovery


def test_parse_hosts():
    text = "localhost:2\n\n# spare\n127.0.0.2\n127.0.0.3:0\nlocalhost:3  # again\n"
    assert parse_hosts(text, default_slots=4) == {"127.0.0.2": 4, "localhost": 3}
    for bad in ("h:x", "h:-1", ":3", "a b:2"):
        with pytest.raises(DiscoveryError, match="line 1"):
            parse_hosts(bad, 1)


@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9.\-]{0,12}", fullmatch=True), st.integers(1, 64), max_size=6))
def test_parse_hosts_round_trip(hosts):
    assert parse_hosts("\n".join(f"{h}:{n}" for h, n in hosts.items()), 1) == hosts


def test_discovery_script_output_and_failures(tmp_path):
    assert HostDiscoveryScript("printf 'localhost:2\\n127.0.0.2\\n'", default_slots=3).find() == {
        "localhost": 2, "127.0.0.2": 3}
    with pytest.raises(DiscoveryError, match="exited with code 3: boom"):
        HostDiscoveryScript("echo boom >&2; exit 3").find()


def test_local_hosts():
    assert is_local_host("localhost") and is_local_host("127.0.0.7") and is_local_host("::1")
    assert not is_local_host("10.1.2.3") and not is_local_host("no-such-host.invalid")


# ----------------------------------------------------------------------------- launcher flags


@pytest.mark.parametrize("argv, message", [
    (["-np", "2", "--min-np", "1", "python"], "--min-np need --host-discovery-script or -H/--hostfile"),
    (["-np", "3", "-H", "localhost:2,127.0.0.2:2", "--min-np", "4", "python"], "--min-np 4 is larger than -np 3"),
    (["-np", "2", "--host-discovery-script", "x", "--min-np", "3", "python"], "--min-np 3 is larger than -np 2"),
    (["-np", "4", "--host-discovery-script", "x", "--max-np", "3", "python"], "--max-np 3 is smaller than -np 4"),
    (["-np", "2", "--host-discovery-script", "x", "--elastic-timeout", "0", "python"], "--elastic-timeout must be > 0"),
    (["-np", "2", "--host-discovery-script", "x", "-H", "localhost:2", "python"], "exclude each other"),
])
def test_elastic_flags_are_validated(argv, message, capsys):
    from ringcomm.launch.launcher import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_fixed_hosts_with_min_np_are_an_elastic_job_over_those_hosts(tmp_path):
    """horovodrun's fault tolerance without scaling: -H (or --hostfile) with --min-np, no discovery script."""
    from ringcomm.launch.elastic_discovery import FixedHosts
    from ringcomm.launch.args import is_elastic
    from ringcomm.launch.launcher import parse_args

    args = parse_args(["-np", "2", "--min-np", "2", "-H", "localhost:2,127.0.0.2:2", "python", "train.py"])
    assert is_elastic(args) and args.fixed_hosts == {"localhost": 2, "127.0.0.2": 2}
    assert FixedHosts(args.fixed_hosts).find() == {"localhost": 2, "127.0.0.2": 2}
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.2 slots=3\n")
    args = parse_args(["-np", "2", "--reset-limit", "1", "--hostfile", str(hostfile), "python", "train.py"])
    assert is_elastic(args) and args.fixed_hosts == {"localhost": 1, "127.0.0.2": 3}
    static = parse_args(["-np", "2", "-H", "localhost:2", "python", "train.py"])
    assert not is_elastic(static) and static.fixed_hosts is None
    assert parse_args(["-np", "2", "--host-discovery-script", "./h.sh", "python"]).fixed_hosts is None


def test_elastic_flags_parse():
    from ringcomm.launch.launcher import parse_args

    args = parse_args(["-np", "4", "--min-np", "2", "--max-np", "6", "--host-discovery-script", "./h.sh",
                       "--reset-limit", "3", "python", "train.py"])
    assert (args.num_proc, args.min_np, args.max_np, args.reset_limit, args.elastic_timeout) == (4, 2, 6, 3, 600.0)
    assert args.host_discovery_script == "./h.sh" and args.command == ["python", "train.py"]
