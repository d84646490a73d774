"""Host lists: ``-H`` strings, hostfiles, Slurm node lists, and which rank runs where.

Pure functions, no I/O (the launcher reads the hostfile and passes its text).

Example::

    >>> hosts = parse_hosts("hostA:2,hostB:2")
    >>> [(p.host, p.local_rank, p.cross_rank) for p in assign(hosts, 3)]
    [('hostA', 0, 0), ('hostA', 1, 0), ('hostB', 0, 1)]
    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from ..errors import InvalidInputError

__all__ = [
    "Host",
    "Placement",
    "parse_hosts",
    "parse_hostfile",
    "assign",
    "place_by_host",
    "separate_by_machine",
    "separation_notice",
    "expand_nodelist",
    "expand_tasks_per_node",
]

#: What a host name may look like (names, IPv4 addresses, dotted domains); no spaces, colons or quotes.
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


@dataclasses.dataclass(frozen=True)
class Host:
    """A host and how many ranks it may run."""

    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank runs: its host and its place among that host's ranks and among the hosts."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def _host(name: str, slots: int, where: str) -> Host:
    if not _HOST_RE.fullmatch(name):
        raise InvalidInputError(f"{where}: {name!r} is not a host name (letters, digits, '.', '-', '_')")
    if slots < 1:
        raise InvalidInputError(f"{where}: host {name!r} has {slots} slots; it needs at least 1")
    return Host(name, slots)


def _no_duplicates(hosts: list[Host], where: str) -> list[Host]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise InvalidInputError(f"{where}: host {host.name!r} is listed twice; give it once with all its slots")
        seen.add(host.name)
    if not hosts:
        raise InvalidInputError(f"{where}: no hosts given")
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """``"hostA:2,hostB:2"`` -> hosts in that order (``hostA`` alone means one slot).

    Example:
        >>> parse_hosts("a:2,b")
        [Host(name='a', slots=2), Host(name='b', slots=1)]
    """
    where = f"-H {spec!r}"
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise InvalidInputError(f"{where}: empty entry; write host:slots,host:slots (e.g. -H a:2,b:2)")
        name, sep, slots = item.rpartition(":")
        if not sep:
            name, slots = item, "1"
        if not slots.isdigit():
            raise InvalidInputError(f"{where}: {item!r} is not host:slots (slots must be a number, e.g. {name}:2)")
        hosts.append(_host(name, int(slots), where))
    return _no_duplicates(hosts, where)


def parse_hostfile(text: str, path: str = "hostfile") -> list[Host]:
    """Hosts from a hostfile: one ``host slots=N`` per line (``host`` alone: 1 slot), ``#`` comments.

    Example:
        >>> parse_hostfile("# two nodes\\nnode1 slots=4\\nnode2 slots=4  # the second\\n")
        [Host(name='node1', slots=4), Host(name='node2', slots=4)]
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}, line {number}"
        fields = line.split()
        slots = 1
        for field in fields[1:]:
            key, sep, value = field.partition("=")
            if key not in ("slots", "max_slots") or not sep or not value.isdigit():
                raise InvalidInputError(f"{where}: {raw.strip()!r} is not 'host slots=N'")
            if key == "slots":
                slots = int(value)
        hosts.append(_host(fields[0], slots, where))
    return _no_duplicates(hosts, path)


def assign(hosts: list[Host], num_proc: int) -> list[Placement]:
    """Place ``num_proc`` ranks: fill each host's slots in order, then the next host.

    Hosts that get no rank are not part of the job (they do not count in ``cross_size``).
    """
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise InvalidInputError(f"-np {num_proc} needs {num_proc} slots but the hosts give {total} ({listed})")
    names: list[str] = []
    for host in hosts:
        names += [host.name] * min(host.slots, num_proc - len(names))
    return place_by_host(names)


def place_by_host(hosts: list[str]) -> list[Placement]:
    """Placements from each rank's host name: local ranks in rank order, hosts in order of first rank.

    Example:
        >>> [(p.local_rank, p.local_size, p.cross_rank) for p in place_by_host(["a", "b", "a"])]
        [(0, 2, 0), (0, 1, 1), (1, 2, 0)]
    """
    order: dict[str, int] = {}
    counts: dict[str, int] = {}
    for name in hosts:
        order.setdefault(name, len(order))
        counts[name] = counts.get(name, 0) + 1
    seen: dict[str, int] = {}
    placements = []
    for rank, name in enumerate(hosts):
        local = seen.get(name, 0)
        seen[name] = local + 1
        placements.append(Placement(rank, name, local, counts[name], order[name], len(order)))
    return placements


def separate_by_machine(names: Sequence[str], machines: Sequence[Sequence[object]]) -> list[str]:
    """Each rank's host as the job treats it: its host name, or ``name#k`` where ranks that report
    one name run on different machines (``machines[r]``: what rank r sees, compared whole), ``k``
    numbering that name's machines in order of their first rank.

    Example:
        >>> separate_by_machine(["a", "a", "b", "a"], [[1], [2], [1], [1]])
        ['a#0', 'a#1', 'b', 'a#0']
    """
    seen: dict[str, list[tuple]] = {}
    for name, found in zip(names, machines, strict=True):
        kinds = seen.setdefault(name, [])
        if tuple(found) not in kinds:
            kinds.append(tuple(found))
    return [name if len(seen[name]) == 1 else f"{name}#{seen[name].index(tuple(found))}"
            for name, found in zip(names, machines, strict=True)]


def separation_notice(names: Sequence[str], machines: Sequence[Sequence[object]]) -> str | None:
    """Why :func:`separate_by_machine` split a host name, and what to do about it; None if it split none.

    ``machines[r]`` is what :func:`ringcomm.job.identity.machine` gave on rank r: ``[boot id, /dev/shm's
    device, network namespace]``, the parts this names when they differ.
    """
    labels = separate_by_machine(names, machines)
    lines = []
    for name in dict.fromkeys(names):
        ranks = [r for r, n in enumerate(names) if n == name]
        groups = list(dict.fromkeys(labels[r] for r in ranks))
        if len(groups) == 1:
            continue
        first = [next(r for r in ranks if labels[r] == label) for label in groups]
        differ = [i for i in range(3) if len({_part(machines[r], i) for r in first}) > 1]
        parts = ", ".join(f"{label} ({_ranks([r for r in ranks if labels[r] == label])})" for label in groups)
        if 0 in differ:
            why, fix = "run on different machines (their boot ids differ)", \
                "give each machine its own host name, or set RINGCOMM_HOSTNAME"
        else:
            why = " and ".join(("", "do not share /dev/shm", "are in different network namespaces")[i] for i in differ)
            fix = ("for shared memory between them, run them in one container, or give them one /dev/shm and "
                   "one network (docker run --ipc=host --net=host)")
        lines.append(f"{_ranks(ranks)} report the host name {name!r} but {why or 'differ'}: they run as "
                     f"separate hosts {parts} and reach each other over TCP; {fix}")
    return "; ".join(lines) if lines else None


def _part(found: Sequence[object], i: int) -> object:
    return found[i] if i < len(found) else None


def _ranks(ranks: Sequence[int]) -> str:
    """``ranks 0-3, 6`` for ranks 0, 1, 2, 3 and 6; ``rank 2`` for rank 2 alone."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


# --------------------------------------------------------------------------- Slurm


def _split_top_level(text: str, what: str) -> list[str]:
    """Split on commas outside ``[...]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise InvalidInputError(f"{what} {text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InvalidInputError(f"{what} {text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InvalidInputError(f"{what} {text!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, spec: str) -> list[str]:
    """``01-03,07`` -> ``['01', '02', '03', '07']`` (zero padding kept from the range's start)."""
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InvalidInputError(f"node list {spec!r}: [{body}] holds {item!r}, not a number or a range a-b")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise InvalidInputError(f"node list {spec!r}: range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's compressed node list -> node names, in order (``SLURM_NODELIST``, ``scontrol show hostnames``).

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5,rack[1-2]-n[1-2]")
        ['node01', 'node02', 'node03', 'node07', 'gpu5', 'rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    nodes: list[str] = []
    for item in _split_top_level(spec.strip(), "node list"):
        if not item:
            raise InvalidInputError(f"node list {spec!r}: empty entry")
        names = [""]
        for m in re.finditer(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            literal, brackets = m.group(1), m.group(2)
            names = [n + literal for n in names]
            if brackets is not None:
                names = [n + suffix for n in names for suffix in _expand_range_set(brackets, spec)]
        for name in names:
            if not _HOST_RE.fullmatch(name):
                raise InvalidInputError(f"node list {spec!r}: {name!r} is not a node name")
        nodes += names
    return nodes


def expand_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` -> tasks on each node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise InvalidInputError(f"tasks per node {spec!r}: {item!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
