"""Memory and idle CPU, ringcomm next to gloo: RSS growth over many allreduces, CPU of an idle job.

Issue-5 targets this measures: the RSS after 1,000 allreduces of 64 MiB is
within 5% of the RSS after 10 (nothing proportional to the tensor is
allocated per op), and an idle job uses < 1% CPU per rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

from . import _launch, _timing, _util

_MODULE = "ringcomm.bench._resource_worker"


@dataclasses.dataclass
class ResourceConfig:
    """World size, allreduce size and count, idle seconds, and the systems to run."""

    np_: int = 2
    nbytes: int = 64 << 20
    ops: int = 1000
    idle: float = 10.0
    systems: tuple[str, ...] = ("ringcomm", "gloo")
    job_timeout: float = 1200.0


def _summary(record: dict[str, Any], ops: int) -> dict[str, Any]:
    ranks = record["ranks"]
    growth = [100 * (r["rss_mib"][str(ops)] / r["rss_mib"]["10"] - 1) for r in ranks]
    return {"max_rss_growth_percent": max(growth), "rss_growth_percent": growth,
            "max_idle_cpu_percent": max(r["idle_cpu_percent"] for r in ranks),
            "median_op_ms": _util.median(r["op_seconds"] for r in ranks) * 1e3}


def run(cfg: ResourceConfig) -> dict[str, Any]:
    """One job per system; returns the JSON-ready section."""
    runs: list[dict[str, Any]] = []
    systems, notes = list(cfg.systems), list[str]()
    _launch.skip_gloo(systems, notes)
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        for system in systems:
            out = os.path.join(tmp, f"{system}.json")
            args = ["--system", system, "--bytes", str(cfg.nbytes), "--ops", str(cfg.ops), "--idle", str(cfg.idle),
                    "--out", out, "--deadline", str(_timing.worker_deadline(cfg.job_timeout))]
            _util.log(f"resources: {system}, np={cfg.np_}, {cfg.ops} x {_util.format_size(cfg.nbytes)} "
                      f"then {cfg.idle:g} s idle ...")
            job = _launch.run_system(system, cfg.np_, _MODULE, args, cfg.job_timeout)
            if not job.ok:
                _util.log(f"  FAILED: {job.describe()}")
                runs.append({"system": system, "ok": False, "error": job.describe()})
                continue
            with open(out, encoding="utf-8") as f:
                record = json.load(f)
            runs.append({"ok": True, **record, **_summary(record, cfg.ops)})
    return {"np": cfg.np_, "bytes": cfg.nbytes, "ops": cfg.ops, "idle_s": cfg.idle, "runs": runs, "notes": notes}


def markdown(section: dict[str, Any]) -> str:
    """The resources table."""
    lines = [f"### Resources: np={section['np']}, {section['ops']} allreduces of "
             f"{_util.format_size(section['bytes'])}, then {section['idle_s']:g} s idle", "",
             "| system | RSS after 10 ops (MiB, per rank) | RSS after last op | max RSS growth | "
             "max idle CPU per rank | threads | ms per op |", "|---|---|---|---|---|---|---|"]
    for r in section["runs"]:
        if not r["ok"]:
            lines.append(f"| {r['system']} | failed | | | | | |")
            continue
        ranks = r["ranks"]
        first = ", ".join(f"{x['rss_mib']['10']:.0f}" for x in ranks)
        last = ", ".join(f"{x['rss_mib'][str(section['ops'])]:.0f}" for x in ranks)
        threads = ", ".join(str(x["threads"]) for x in ranks)
        lines.append(f"| {r['system']} | {first} | {last} | {r['max_rss_growth_percent']:.2f}% | "
                     f"{r['max_idle_cpu_percent']:.2f}% | {threads} | {r['median_op_ms']:.1f} |")
    notes = section.get("notes", [])
    lines += [""] * bool(notes) + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
