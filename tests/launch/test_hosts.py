"""Host lists: -H, hostfiles, rank placement, Slurm's compressed node lists (no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringcomm.job.hosts import (
    Host,
    assign,
    expand_nodelist,
    expand_tasks_per_node,
    parse_hostfile,
    parse_hosts,
    place_by_host,
    separate_by_machine,
    separation_notice,
)

pytestmark = pytest.mark.pure


def test_dash_h_lists_hosts_in_order_with_their_slots() -> None:
    assert parse_hosts("hostA:2,hostB:4") == [Host("hostA", 2), Host("hostB", 4)]
    assert parse_hosts(" node-1.example.com:1 , 10.0.0.2 ") == [Host("node-1.example.com", 1), Host("10.0.0.2", 1)]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a:2,a:1", "host 'a' is listed twice"),
        ("a:2,", "empty entry"),
        ("a:two", "'a:two' is not host:slots"),
        ("a:0", "has 0 slots"),
        ("a b:2", "'a b' is not a host name"),
        ("", "empty entry"),
    ],
)
def test_bad_dash_h_says_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hosts(spec)


def test_hostfile_with_comments_blank_lines_and_default_slots() -> None:
    text = "# the cluster\n\nnode1 slots=4\n  node2   slots=2   # half of it\nnode3\nnode4 slots=2 max_slots=8\n"
    assert parse_hostfile(text) == [Host("node1", 4), Host("node2", 2), Host("node3", 1), Host("node4", 2)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 slots=4\nnode2 slots four\n", "hosts.txt, line 2: 'node2 slots four' is not 'host slots=N'"),
        ("node1 slots=0\n", "line 1: host 'node1' has 0 slots"),
        ("# nothing\n\n", "no hosts given"),
        ("a slots=1\na slots=2\n", "host 'a' is listed twice"),
    ],
)
def test_bad_hostfile_names_the_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text, "hosts.txt")


def test_ranks_fill_hosts_in_order() -> None:
    got = [(p.rank, p.host, p.local_rank, p.local_size, p.cross_rank, p.cross_size)
           for p in assign([Host("a", 2), Host("b", 3), Host("c", 4)], 4)]
    assert got == [
        (0, "a", 0, 2, 0, 2),
        (1, "a", 1, 2, 0, 2),
        (2, "b", 0, 2, 1, 2),
        (3, "b", 1, 2, 1, 2),
    ]  # c gets no rank, so it is not one of the job's hosts


def test_too_few_slots_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"-np 5 needs 5 slots but the hosts give 4 \(a:2, b:2\)"):
        assign([Host("a", 2), Host("b", 2)], 5)


@given(st.lists(st.sampled_from("abcde"), min_size=1, max_size=30))
def test_placement_from_host_names_is_consistent(hosts: list[str]) -> None:
    places = place_by_host(hosts)
    order = list(dict.fromkeys(hosts))
    for p in places:
        same = [q.rank for q in places if q.host == p.host]
        assert p.local_rank == same.index(p.rank) and p.local_size == len(same)
        assert p.cross_rank == order.index(p.host) and p.cross_size == len(order)


@given(st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["m1", "m2", "m3"])), min_size=1, max_size=12))
def test_ranks_of_one_host_name_on_different_machines_run_as_separate_hosts(ranks: list[tuple[str, str]]) -> None:
    names = [n for n, _ in ranks]
    machines = [["boot", m, 7] for _, m in ranks]
    labels = separate_by_machine(names, machines)
    for (n1, m1), l1 in zip(ranks, labels):
        for (n2, m2), l2 in zip(ranks, labels):
            assert (l1 == l2) == ((n1, m1) == (n2, m2))  # one host exactly where name and machine agree
    for name in set(names):
        if len({m for n, m in ranks if n == name}) == 1:  # a name on one machine keeps its name
            assert all(label == name for n, label in zip(names, labels) if n == name)
    assert separation_notice(names, machines) is None or len(set(labels)) > len(set(names))


def test_the_notice_names_the_ranks_what_differs_and_the_fix() -> None:
    names = ["box"] * 4 + ["other"]
    containers = [["b", 1, 9], ["b", 2, 9], ["b", 2, 9], ["b", 1, 9], ["c", 5, 5]]
    assert separate_by_machine(names, containers) == ["box#0", "box#1", "box#1", "box#0", "other"]
    text = separation_notice(names, containers)
    assert text is not None
    assert "ranks 0-3 report the host name 'box' but do not share /dev/shm" in text
    assert "box#0 (ranks 0, 3), box#1 (ranks 1-2)" in text and "--ipc=host --net=host" in text
    networks = separation_notice(["h", "h"], [["b", 1, 9], ["b", 1, 8]])
    assert networks is not None and "are in different network namespaces" in networks
    machines = separation_notice(["h", "h"], [["b", 1, 9], ["x", 2, 8]])
    assert machines is not None and "different machines (their boot ids differ)" in machines
    assert "box#0 (rank 0)" in str(separation_notice(["box", "box"], [[1], [2]]))
    assert "RINGCOMM_HOSTNAME" in machines and "/dev/shm" not in machines
    assert separation_notice(["a", "a", "b"], [[1], [1], [2]]) is None


@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 4)), min_size=1, max_size=5, unique_by=lambda t: t[0]),
       st.integers(1, 20))
def test_assign_uses_the_first_slots(hosts: list[tuple[str, int]], num_proc: int) -> None:
    listed = [Host(n, s) for n, s in hosts]
    slots = [n for n, s in hosts for _ in range(s)]
    if num_proc > len(slots):
        with pytest.raises(ValueError):
            assign(listed, num_proc)
        return
    assert [p.host for p in assign(listed, num_proc)] == slots[:num_proc]


@pytest.mark.parametrize(
    "spec, nodes",
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a[1],b[2-3]c", ["a1", "b2c", "b3c"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_nodelist_examples(spec: str, nodes: list[str]) -> None:
    assert expand_nodelist(spec) == nodes


@pytest.mark.parametrize(
    "spec, message",
    [("node[1-3", "never closed"), ("node]1", "without"), ("node[a-b]", "not a number"),
     ("node[3-1]", "runs backwards"), ("a,,b", "empty entry"), ("n[[1]]", "nested"), ("n[]", "not a number")],
)
def test_bad_nodelist_says_why(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_nodelist(spec)


_prefix = st.text("abcxyz-", min_size=1, max_size=5).filter(lambda s: not s.startswith("-"))


@st.composite
def _groups(draw: st.DrawFn) -> tuple[str, list[str]]:
    """One node-list item and the names it stands for, built the way Slurm compresses lists."""
    prefix = draw(_prefix)
    numbers = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6, unique=True))
    width = draw(st.integers(1, 4))
    names, parts = [], []
    for n in sorted(numbers):
        if parts and isinstance(parts[-1], list) and parts[-1][1] == n - 1 and draw(st.booleans()):
            parts[-1][1] = n  # extend the previous range
        else:
            parts.append([n, n])
        names.append(prefix + str(n).zfill(width))
    body = ",".join(str(a).zfill(width) if a == b else f"{str(a).zfill(width)}-{str(b).zfill(width)}"
                    for a, b in parts)
    if len(names) == 1 and draw(st.booleans()):
        return names[0], names  # a lone node is often written without brackets
    return f"{prefix}[{body}]", names


@given(st.lists(_groups(), min_size=1, max_size=4))
def test_compressed_nodelists_expand_to_their_nodes(groups: list[tuple[str, list[str]]]) -> None:
    spec = ",".join(item for item, _ in groups)
    assert expand_nodelist(spec) == [name for _, names in groups for name in names]


def test_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="not N or N"):
        expand_tasks_per_node("2(3)")
