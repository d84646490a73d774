"""Allreduce on a user's own hosts: ringcomm vs gloo, against a plain-socket exchange of the same bytes.

Every job is started the way a user starts ringcomm across hosts: the
launcher with ``-H host1:P,host2:P`` (ssh to the other hosts), one worker
per rank (:mod:`ringcomm.bench._cluster_worker`).  Rounds alternate the
systems (exchange, ringcomm, gloo, exchange, ...) so a busy moment on the
cluster hits them all.

The exchange is the practical ceiling: the first rank of each host sends S
bytes to the next host's while receiving S bytes from the previous one, on
one TCP connection each way, from Python, with nothing else to do.  An
allreduce of S bytes over H hosts moves at least 2(H-1)/H x S bytes out of
each host, so no allreduce can take less than 2(H-1)/H times the exchange's
time on these links; the report gives each system's share of that bound.
``--systems ringcomm gloo plain-ring`` adds a ring allreduce written in plain
Python on the same connections (the exchange plus the sum and nothing else):
ringcomm's time over its time is what ringcomm itself costs on these CPUs.
Like the exchange, it runs between the hosts' first ranks only: with several
ranks per host it leaves out the reduction within each host.

    python -m ringcomm.bench cluster -H node1:1,node2:1 --sizes 16M 64M
    python -m ringcomm.bench cluster -H node1:4,node2:4 --network-interface eth0 --repeats 5

The workers run ``--python`` (default: this interpreter's path) on every
host: ringcomm, numpy and torch must be installed there at that path.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from . import _procs, _timing, _util

SYSTEMS = ("ringcomm", "gloo")
#: the plain-socket exchange, timed in every round beside the systems asked for
EXCHANGE = "exchange"
#: a ring allreduce in plain Python on the exchange's connections (:func:`ringcomm.bench._cluster_worker.plain_ring_allreduce`):
#: the exchange plus only the sum and the ring's order, the ceiling for an allreduce on the hosts' CPUs
PLAIN_RING = "plain-ring"
#: what ``--systems`` may name
CHOICES = (*SYSTEMS, PLAIN_RING)


@dataclasses.dataclass
class ClusterConfig:
    #: the launcher's ``-H``: ``host1:slots,host2:slots``
    hosts: str
    sizes: Sequence[int] = (16 << 20, 64 << 20)
    iters: int = 10
    warmup: int = 2
    repeats: int = 3
    systems: Sequence[str] = SYSTEMS
    ssh_command: str | None = None
    ssh_port: int | None = None
    network_interface: str | None = None
    python: str = sys.executable
    job_timeout: float = 600.0
    #: time ops back to back after one barrier (as a training loop runs them), not each after its own
    loop: bool = False


def host_slots(hosts: str) -> list[tuple[str, int]]:
    """``"a:2,b:2"`` -> ``[("a", 2), ("b", 2)]`` (a host without ``:slots`` has one)."""
    out = []
    for item in hosts.split(","):
        name, _, slots = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H {hosts!r}: each host is NAME or NAME:SLOTS with SLOTS >= 1, got {item!r}")
        out.append((name, int(slots)))
    return out


def job_argv(cfg: ClusterConfig, system: str, plan: str, out: str) -> list[str]:
    """The launcher's command line that times ``system`` on every slot of ``cfg.hosts``."""
    ranks = sum(slots for _, slots in host_slots(cfg.hosts))
    argv = [cfg.python, "-m", "ringcomm.launch.launcher", "-np", str(ranks), "-H", cfg.hosts]
    if cfg.ssh_command:
        argv += ["--ssh-command", cfg.ssh_command]
    if cfg.ssh_port:
        argv += ["--ssh-port", str(cfg.ssh_port)]
    if cfg.network_interface:
        argv += ["--network-interface", cfg.network_interface]
    return argv + [cfg.python, "-m", "ringcomm.bench._cluster_worker", "--system", system, "--op", "allreduce",
                   "--plan", plan, "--warmup", str(cfg.warmup), "--out", out,
                   "--deadline", str(_timing.worker_deadline(cfg.job_timeout)), *(["--loop"] if cfg.loop else [])]


def cluster_env() -> dict[str, str]:
    """The workers' environment: as on one host, except that gloo is not pinned to loopback (each gloo
    rank then uses the interface of its ringcomm address), unless the user set GLOO_SOCKET_IFNAME."""
    env = _util.worker_env(True)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def ceiling_shares(row: dict[str, Any], hosts: int, systems: Sequence[str]) -> None:
    """Add the allreduce ceiling (``ceiling_s``: 2(H-1)/H x the exchange's median) and each system's
    share of it (``<system>_share``: ceiling / the system's median) to a summary ``row``."""
    have = row["systems"]
    if EXCHANGE not in have or hosts < 2:
        return
    row["ceiling_s"] = 2 * (hosts - 1) / hosts * have[EXCHANGE]["median_s"]
    for system in systems:
        if system in have and have[system]["median_s"] > 0:
            row[f"{system}_share"] = row["ceiling_s"] / have[system]["median_s"]


def pooled(runs: Sequence[dict[str, Any]], system: str, size: int) -> dict[str, Any] | None:
    """One system's per-op times of one size, pooled over the rounds: median, p99, the rounds' medians."""
    chosen = [r for r in runs if r["ok"] and r["system"] == system]
    times = [t for r in chosen for res in r["results"] if res["bytes"] == size for t in res["times_s"]]
    if not times:
        return None
    stats = {"median_s": _util.median(times), "p99_s": _util.percentile(times, 99),
             "round_median_s": [_util.median(t for res in r["results"] if res["bytes"] == size for t in res["times_s"])
                                for r in chosen]}
    counted = [res for r in chosen for res in r["results"]
               if res["bytes"] == size and res.get("rank_cpu_s") and res.get("iters")]
    if counted:  # per round: the busiest rank's CPU per op (what limits a rank whose core is its own), and all ranks'
        stats["cpu_per_op_s"] = _util.median(max(u + s for u, s in res["rank_cpu_s"]) / res["iters"] for res in counted)
        stats["all_ranks_cpu_per_op_s"] = _util.median(sum(u + s for u, s in res["rank_cpu_s"]) / res["iters"]
                                                       for res in counted)
    return stats


def cpu_text(rows: Sequence[dict[str, Any]], systems: Sequence[str], label: Callable[[dict[str, Any]], str],
             cores: int | None = None) -> str | None:
    """A line on the CPU each system spends per op on its busiest rank, and the share of one core that is
    (CPU per op / time per op; near 100%, the op waits on that core, not on the link), or None when no
    job measured it.  With ``cores`` (every rank on this machine, which has that many), also how many of
    them all ranks together kept busy.

    >>> cpu_text([{"bytes": 1 << 20, "systems": {"gloo": {"median_s": 0.01, "cpu_per_op_s": 0.005}}}], ["gloo"],
    ...          lambda row: "1 MiB")
    "CPU per op on each system's busiest rank (its process's every thread, user and system; the share of one core it kept busy): 1 MiB: gloo 5 ms (50%)."
    """
    parts = []
    for row in rows:
        have = row["systems"]
        cells = []
        for system in systems:
            st = have.get(system, {})
            if "cpu_per_op_s" not in st or not st["median_s"] > 0:
                continue
            cell = f"{system} {_util.format_ms(st['cpu_per_op_s'])} ({st['cpu_per_op_s'] / st['median_s']:.0%}"
            if cores:
                cell += f"; all ranks {st['all_ranks_cpu_per_op_s'] / st['median_s']:.1f} cores"
            cells.append(cell + ")")
        if cells:
            parts.append(f"{label(row)}: " + ", ".join(cells))
    if not parts:
        return None
    kept = f", and how many of this machine's {cores} cores all ranks together kept busy" if cores else ""
    return (f"CPU per op on each system's busiest rank (its process's every thread, user and system; the share of one "
            f"core it kept busy{kept}): " + "; ".join(parts) + ".")


def paired_ratios(runs: Sequence[dict[str, Any]], num: str, den: str, size: int) -> list[float]:
    """Per round in which both ran: ``num``'s median per op / ``den``'s, in round order.  Rounds run the
    systems side by side, so these ratios see the same machine; the times pooled over rounds may not.

        paired_ratios(runs, "gloo", "ringcomm", 64 << 20) -> [1.21, 1.28, 1.16]
    """
    by: dict[tuple[str, int], float] = {}
    for r in runs:
        if r["ok"] and r["system"] in (num, den):
            times = [t for res in r["results"] if res["bytes"] == size for t in res["times_s"]]
            if times:
                by[(r["system"], r["repeat"])] = _util.median(times)
    rounds = sorted({rep for _, rep in by})
    return [by[(num, rep)] / by[(den, rep)] for rep in rounds if (num, rep) in by and (den, rep) in by]


def ratio_text(row: dict[str, Any]) -> str:
    """gloo/ringcomm of a summary row: pooled, then the paired rounds' median and range."""
    if "gloo_over_ringcomm" not in row:
        return "n/a"
    text = f"{row['gloo_over_ringcomm']:.2f}"
    rounds = row.get("gloo_over_ringcomm_rounds") or []
    if len(rounds) > 1:
        text += f"; rounds {_util.median(rounds):.2f} ({min(rounds):.2f}-{max(rounds):.2f})"
    return text


def run_rounds(cfg: ClusterConfig, tmp: str) -> list[dict[str, Any]]:
    """Every round's jobs (the exchange first, then the systems); returns one record per job."""
    plan = ",".join(f"{s}:{cfg.iters}" for s in cfg.sizes)
    runs = []
    for repeat in range(cfg.repeats):
        for system in (EXCHANGE, *cfg.systems):
            _util.log(f"cluster {system} (round {repeat + 1}/{cfg.repeats}) ...")
            out = os.path.join(tmp, f"{system}-{repeat}.json")
            ticks = _util.cpu_ticks()
            result = _procs.run_job([job_argv(cfg, system, plan, out)], cluster_env(), cfg.job_timeout)
            runs.append(_procs.job_record(result, out, system=system, repeat=repeat,
                                          steal=_util.steal_share(ticks, _util.cpu_ticks())))
            if not result.ok:
                _util.log(f"  FAILED: {runs[-1]['error']}")
    return runs


def run(cfg: ClusterConfig) -> dict[str, Any]:
    """Measure on the hosts of ``cfg``; returns the JSON-ready section."""
    slots = host_slots(cfg.hosts)
    section: dict[str, Any] = {"hosts": [h for h, _ in slots], "slots": [s for _, s in slots],
                               "sizes": list(cfg.sizes), "iters": cfg.iters, "repeats": cfg.repeats,
                               "systems": list(cfg.systems), "loop": cfg.loop, "runs": [], "summary": []}
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        section["runs"] = run_rounds(cfg, tmp)
    section["summary"] = summarize(section["runs"], cfg.sizes, len(slots), cfg.systems)
    return section


def summarize(runs: Sequence[dict[str, Any]], sizes: Sequence[int], hosts: int,
              systems: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        row: dict[str, Any] = {"bytes": size, "systems": {}}
        for system in (EXCHANGE, *systems):
            stats = pooled(runs, system, size)
            if stats is not None:
                row["systems"][system] = stats
        have = row["systems"]
        if "ringcomm" in have and "gloo" in have:
            row["gloo_over_ringcomm"] = have["gloo"]["median_s"] / have["ringcomm"]["median_s"]
            row["gloo_over_ringcomm_rounds"] = paired_ratios(runs, "gloo", "ringcomm", size)
        ceiling_shares(row, hosts, systems)
        rows.append(row)
    return rows


def with_p99(systems: dict[str, Any], system: str) -> str:
    """A system's median with its p99 in brackets, or ``n/a`` when it has no figures."""
    st = systems.get(system)
    return "n/a" if not st else f"{_util.format_ms(st['median_s'])} ({_util.format_ms(st.get('p99_s'))})"


def share_text(row: dict[str, Any], system: str) -> str:
    value = row.get(f"{system}_share")
    return "n/a" if value is None else f"{value:.0%}"


def markdown(section: dict[str, Any]) -> str:
    hosts = ", ".join(f"{h} x {s}" for h, s in zip(section["hosts"], section["slots"]))
    timing = "ops back to back" if section.get("loop") else "a barrier before each op"
    ring = any(PLAIN_RING in row["systems"] for row in section["summary"])
    lines = [f"### Allreduce on {hosts} (median per op, {timing}, {section['repeats']} alternating rounds)", "",
             "| size | ringcomm (p99) | gloo (p99) | gloo/ringcomm (pooled; paired rounds' median, range) | "
             "plain-socket exchange | ceiling | "
             "ringcomm's share | gloo's share |" + (" plain-socket ring, with the sum | ringcomm's share of it |" if ring else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if ring else "")]
    for row in section["summary"]:
        have = row["systems"]
        cells = [_util.format_size(row["bytes"])]
        cells += [with_p99(have, "ringcomm"), with_p99(have, "gloo")]
        cells.append(ratio_text(row))
        cells += [_util.format_ms(have.get(EXCHANGE, {}).get("median_s")), _util.format_ms(row.get("ceiling_s")),
                  share_text(row, "ringcomm"), share_text(row, "gloo")]
        if ring:
            plain, own = have.get(PLAIN_RING, {}).get("median_s"), have.get("ringcomm", {}).get("median_s")
            cells += [_util.format_ms(plain), f"{plain / own:.0%}" if plain and own else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "exchange: each host's first rank sends S bytes to the next host while receiving S from the "
              "previous one, plain TCP from Python.  ceiling: 2(H-1)/H x the exchange, the least time an allreduce "
              "of S can take on these links; a share is ceiling / the system's time."]
    cpu = cpu_text(section["summary"], (EXCHANGE, "ringcomm", "gloo", PLAIN_RING), lambda row: _util.format_size(row["bytes"]))
    if cpu:  # a system near 100% is bound by its CPU here, whatever the link could carry
        lines += ["", cpu]
    steal = _util.steal_text(section["runs"])
    if steal:  # the other hosts' steal is not measured: on cloud VMs, check theirs too (top's "st")
        lines += ["", steal + " The other hosts' is not measured."]
    return "\n".join(lines) + "\n"
