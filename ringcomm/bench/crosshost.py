"""Allreduce across two hosts, ringcomm vs gloo, over a link of a chosen rate.

The two hosts are network namespaces on this machine joined by a veth pair
(root only), each end shaped with a token bucket (``tc tbf``) to the rate
asked for.  ringcomm runs as a user runs it across hosts: the launcher in
host a with ``-H a:P,b:P`` and an ssh look-alike that starts host b's ranks
inside its namespace; gloo runs ``P`` plain processes in each namespace
meeting at host a's address.  Rounds alternate (ringcomm, gloo, ringcomm,
...) so the machine's drift hits both; each system's per-op times (slowest
rank) are pooled over rounds.  Each round also times a raw TCP round trip of
each size between the two hosts (``raw``: one connection, no collective,
:mod:`ringcomm.bench._tcp_rtt`), the link's floor for a small allreduce, and a
plain-socket exchange of each size (``exchange``: each host sends S bytes
while it receives S, :mod:`ringcomm.bench.cluster`), the practical ceiling
for a large one: the report gives ringcomm's and gloo's share of it.

Link bounds, for 2 hosts and an allreduce of S bytes on a full-duplex link
of rate R: a flat ring of N ranks pushes 2(N-1)/N x S across the link in
each direction; a hierarchical allreduce (reduce within each host first)
pushes 2(H-1)/H x S = S.  The report gives each system's time against both.

    python -m ringcomm.bench crosshost --rates 1gbit 10gbit --sizes 1M 16M 64M
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _netns, _procs, _timing, _util, cluster

SYSTEMS = ("ringcomm", "gloo", "ringcomm-flat", "ringcomm-onepiece", "ringcomm-ring", "ringcomm-lane", "ringcomm-zmq",
           cluster.PLAIN_RING)
#: a raw TCP round trip of each size between the hosts, timed in every round beside the systems asked for
RAW = "raw"
#: a plain-socket exchange of each size between the hosts (:mod:`ringcomm.bench.cluster`), also in every round
EXCHANGE = cluster.EXCHANGE
#: ringcomm with the hierarchical allreduce off (RINGCOMM_HIERARCHICAL_ALLREDUCE=0): one ring over every rank
FLAT = "ringcomm-flat"
#: ringcomm's hierarchical allreduce in one piece (RINGCOMM_HIERARCHICAL_PIECE_BYTES=0): its phases one after another
ONEPIECE = "ringcomm-onepiece"
#: ringcomm with recursive doubling off (RINGCOMM_DOUBLING_ALLREDUCE_BYTES=0): medium sizes take the ring
RING = "ringcomm-ring"
#: ringcomm with the small-op lane across hosts on (RINGCOMM_NET_LANE_BYTES=-1: bound by job size)
LANE = "ringcomm-lane"
#: ringcomm with every payload on ZeroMQ (RINGCOMM_STREAM_MIN_BYTES=0): no TCP stream per direction
ZMQ = "ringcomm-zmq"
#: a ring allreduce in plain Python on the exchange's connections (:data:`ringcomm.bench.cluster.PLAIN_RING`):
#: the exchange plus only the sum and the ring's order, the ceiling for an allreduce on these CPUs
PLAIN_RING = cluster.PLAIN_RING
#: the extra systems' columns in the table
EXTRA = {FLAT: "one flat ring (hierarchical off)", ONEPIECE: "hierarchical in one piece",
         RING: "ring instead of recursive doubling", LANE: "small-op lane on", ZMQ: "payloads on ZeroMQ",
         PLAIN_RING: "plain-socket ring, with the sum"}


@dataclasses.dataclass
class CrossHostConfig:
    rates: Sequence[str] = ("1gbit", "10gbit")
    sizes: Sequence[int] = (1 << 20, 16 << 20, 64 << 20)
    ranks_per_host: int = 2
    iters: int = 5
    warmup: int = 2
    repeats: int = 3
    systems: Sequence[str] = ("ringcomm", "gloo")
    job_timeout: float = 600.0
    #: time ops back to back after one barrier (as a training loop runs them), not each after its own
    loop: bool = False


def link_bounds(nbytes: int, ranks: int, hosts: int, rate_bits: int) -> dict[str, float]:
    """Seconds an allreduce of ``nbytes`` needs at least on the link: flat ring and hierarchical."""
    per_second = rate_bits / 8
    return {"flat_ring_s": 2 * (ranks - 1) / ranks * nbytes / per_second,
            "hierarchical_s": 2 * (hosts - 1) / hosts * nbytes / per_second}


def _ringcomm(hosts: _netns.TwoHosts, cfg: CrossHostConfig, plan: str, out: str,
              extra: dict[str, str] | None = None) -> _procs.JobResult:
    p = cfg.ranks_per_host
    argv = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", str(2 * p),
            "-H", f"{hosts.addr['a']}:{p},{hosts.addr['b']}:{p}", "--ssh-command", str(hosts.ssh),
            "--network-interface", hosts.interface,
            sys.executable, "-m", "ringcomm.bench._rc_worker", "--op", "allreduce", "--plan", plan,
            "--warmup", str(cfg.warmup), "--out", out, "--deadline", str(_timing.worker_deadline(cfg.job_timeout)),
            *(["--loop"] if cfg.loop else [])]
    return _procs.run_job([hosts.exec_argv("a", argv)], _util.worker_env(True, extra), cfg.job_timeout)


def _gloo(hosts: _netns.TwoHosts, cfg: CrossHostConfig, plan: str, out: str) -> _procs.JobResult:
    p = cfg.ranks_per_host
    port = _util.free_port()
    env = _util.worker_env(False, {"GLOO_SOCKET_IFNAME": hosts.interface})
    commands = []
    for rank in range(2 * p):
        side = "a" if rank < p else "b"
        argv = [sys.executable, "-m", "ringcomm.bench._gloo_worker", "--rank", str(rank), "--world-size", str(2 * p),
                "--port", str(port), "--master-addr", hosts.addr["a"], "--op", "allreduce", "--plan", plan,
                "--warmup", str(cfg.warmup), "--out", out, "--deadline", str(_timing.worker_deadline(cfg.job_timeout)),
                *(["--loop"] if cfg.loop else [])]
        commands.append(hosts.exec_argv(side, argv))
    return _procs.run_job(commands, env, cfg.job_timeout)


def _raw(hosts: _netns.TwoHosts, cfg: CrossHostConfig, plan: str, out: str) -> _procs.JobResult:
    port = _util.free_port()
    common = ["--port", str(port), "--plan", plan, "--warmup", str(max(cfg.warmup, 20)),
              "--deadline", str(_timing.worker_deadline(cfg.job_timeout))]
    worker = [sys.executable, "-m", "ringcomm.bench._tcp_rtt"]
    commands = [hosts.exec_argv("b", [*worker, "--serve", hosts.addr["b"], *common]),
                hosts.exec_argv("a", [*worker, "--connect", hosts.addr["b"], "--out", out, *common])]
    return _procs.run_job(commands, _util.worker_env(False), cfg.job_timeout)


def _exchange(hosts: _netns.TwoHosts, cfg: CrossHostConfig, plan: str, out: str,
              system: str = cluster.EXCHANGE) -> _procs.JobResult:
    p = cfg.ranks_per_host
    job = cluster.ClusterConfig(hosts=f"{hosts.addr['a']}:{p},{hosts.addr['b']}:{p}", warmup=cfg.warmup,
                                ssh_command=str(hosts.ssh), network_interface=hosts.interface,
                                job_timeout=cfg.job_timeout, loop=cfg.loop)
    argv = cluster.job_argv(job, system, plan, out)
    return _procs.run_job([hosts.exec_argv("a", argv)], _util.worker_env(True), cfg.job_timeout)


def run(cfg: CrossHostConfig) -> dict[str, Any]:
    """Measure; returns the JSON-ready section (or one with ``skipped`` saying why nothing ran)."""
    why = _netns.shaping_unavailable_reason()
    section: dict[str, Any] = {"rates": list(cfg.rates), "sizes": list(cfg.sizes), "hosts": 2,
                               "ranks_per_host": cfg.ranks_per_host, "iters": cfg.iters, "repeats": cfg.repeats, "loop": cfg.loop,
                               "runs": [], "summary": [], "skipped": why}
    if why is not None:
        _util.log(f"crosshost skipped: {why}")
        return section
    plan = ",".join(f"{s}:{cfg.iters}" for s in cfg.sizes)
    runners = {RAW: _raw, EXCHANGE: _exchange, "ringcomm": _ringcomm, "gloo": _gloo,
               FLAT: lambda h, c, p, o: _ringcomm(h, c, p, o, {"RINGCOMM_HIERARCHICAL_ALLREDUCE": "0"}),
               ONEPIECE: lambda h, c, p, o: _ringcomm(h, c, p, o, {"RINGCOMM_HIERARCHICAL_PIECE_BYTES": "0"}),
               RING: lambda h, c, p, o: _ringcomm(h, c, p, o, {"RINGCOMM_DOUBLING_ALLREDUCE_BYTES": "0"}),
               LANE: lambda h, c, p, o: _ringcomm(h, c, p, o, {"RINGCOMM_NET_LANE_BYTES": "-1"}),
               ZMQ: lambda h, c, p, o: _ringcomm(h, c, p, o, {"RINGCOMM_STREAM_MIN_BYTES": "0"}),
               PLAIN_RING: lambda h, c, p, o: _exchange(h, c, p, o, PLAIN_RING)}
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        hosts = _netns.TwoHosts(Path(tmp))
        try:
            for rate in cfg.rates:
                hosts.shape(rate)
                for repeat in range(cfg.repeats):
                    for system in (RAW, EXCHANGE, *cfg.systems):
                        _util.log(f"crosshost {rate} {system} (round {repeat + 1}/{cfg.repeats}) ...")
                        out = os.path.join(tmp, f"{system}-{rate}-{repeat}.json")
                        ticks = _util.cpu_ticks()
                        result = runners[system](hosts, cfg, plan, out)
                        steal = _util.steal_share(ticks, _util.cpu_ticks())
                        section["runs"].append(_procs.job_record(result, out, system=system, rate=rate, repeat=repeat,
                                                                 steal=steal))
                        if not result.ok:
                            _util.log(f"  FAILED: {section['runs'][-1]['error']}")
        finally:
            hosts.close()
    section["summary"] = summarize(section["runs"], cfg)
    return section


def summarize(runs: Sequence[dict[str, Any]], cfg: CrossHostConfig) -> list[dict[str, Any]]:
    rows = []
    ranks = 2 * cfg.ranks_per_host
    for rate in cfg.rates:
        for size in cfg.sizes:
            row: dict[str, Any] = {"rate": rate, "bytes": size, "systems": {},
                                   **link_bounds(size, ranks, 2, _netns.tc_rate_bits(rate))}
            at_rate = [r for r in runs if r["rate"] == rate]
            for system in (RAW, EXCHANGE, *cfg.systems):
                stats = cluster.pooled(at_rate, system, size)
                if stats is not None:
                    row["systems"][system] = stats
            have = row["systems"]
            if "ringcomm" in have and "gloo" in have:
                row["gloo_over_ringcomm"] = have["gloo"]["median_s"] / have["ringcomm"]["median_s"]
                row["gloo_over_ringcomm_rounds"] = cluster.paired_ratios(at_rate, "gloo", "ringcomm", size)
            if "ringcomm" in have and RAW in have:
                row["ringcomm_over_raw"] = have["ringcomm"]["median_s"] / have[RAW]["median_s"]
            cluster.ceiling_shares(row, 2, ("ringcomm", "gloo"))
            rows.append(row)
    return rows


def markdown(section: dict[str, Any]) -> str:
    if section.get("skipped"):
        return f"### Across two hosts\n\nskipped: {section['skipped']}\n"
    p = section["ranks_per_host"]
    extra = [name for name in EXTRA if any(name in row["systems"] for row in section["summary"])]
    timing = "ops back to back" if section.get("loop") else "a barrier before each op"
    lines = [f"### Allreduce across 2 hosts x {p} ranks (veth shaped with tc tbf; median per op, {timing}, "
             f"{section['repeats']} alternating rounds)", "",
             "| link | size | ringcomm (p99) | gloo (p99) | gloo/ringcomm (pooled; paired rounds' median, range) | "
             "raw TCP round trip | ringcomm/raw | "
             "plain-socket exchange | ringcomm's share | gloo's share | ringcomm vs flat-ring bound | ringcomm vs hierarchical bound |" + "".join(f" {EXTRA[name]} |" for name in extra),
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    for row in section["summary"]:
        have = row["systems"]
        rc_ = have.get("ringcomm", {}).get("median_s")
        ratio = cluster.ratio_text(row)
        over_raw = f"{row['ringcomm_over_raw']:.1f}x" if "ringcomm_over_raw" in row else "n/a"
        flat = f"{row['flat_ring_s'] / rc_:.0%}" if rc_ else "n/a"
        hier = f"{row['hierarchical_s'] / rc_:.0%}" if rc_ else "n/a"
        cells = [row["rate"], _util.format_size(row["bytes"]), cluster.with_p99(have, "ringcomm"),
                 cluster.with_p99(have, "gloo"), ratio, _util.format_ms(have.get(RAW, {}).get("median_s")), over_raw,
                 _util.format_ms(have.get(EXCHANGE, {}).get("median_s")),
                 cluster.share_text(row, "ringcomm"), cluster.share_text(row, "gloo"), flat, hier]
        for name in extra:
            cells.append(_util.format_ms(have.get(name, {}).get("median_s")))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Bounds: the link time a flat ring needs (2(N-1)/N x S per direction) and a hierarchical "
              "allreduce needs (2(H-1)/H x S); a percentage is bound / measured time.  raw: one TCP round "
              "trip of the size between the hosts (no collective), the floor for a small allreduce.  exchange: each host "
              "sends S bytes while it receives S, plain TCP from Python, the ceiling for a large one (2(H-1)/H x S per "
              "host); a share is the exchange's time / the system's time."]
    cpu = cluster.cpu_text(section["summary"], (EXCHANGE, "ringcomm", "gloo", *extra),
                           lambda row: f"{row['rate']} {_util.format_size(row['bytes'])}", _util.usable_cores())
    if cpu:  # both hosts share this machine's cores: near 100%, the op waits on a core, not on the link
        lines += ["", cpu]
    steal = _util.steal_text(section["runs"])
    if steal:  # both hosts are this machine: a busy hypervisor slows every system, unevenly between rounds
        lines += ["", steal]
    return "\n".join(lines) + "\n"
