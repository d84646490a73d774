"""Small-message latency: blocking ops back to back, percentiles per op, side by side.

For each world size, ``repeats`` rounds run one job per system in turn
(ringcomm, gloo, MPI through mpi4py when it and ``mpirun`` are installed),
each timing ``ops`` blocking allreduces of ``nbytes`` back to back after
``warmup`` untimed ones (the slowest rank's time per op).  Each round also
times a raw round trip of ``nbytes`` between two processes over a socketpair:
the machine's floor for waking a peer and handing it the data.  The summary
takes each percentile per round, then the median over rounds; ratios compare
percentiles measured in the same rounds.  ringcomm and gloo ranks then sleep
``idle`` seconds and report the CPU they burned meanwhile.

    python -m ringcomm.bench latency --np 2 4
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from . import _launch, _procs, _timing, _util
from ._util import percentile

SYSTEMS = ("ringcomm", "gloo", "mpi")
PERCENTILES = (10, 50, 90, 99)
WORKERS = {"ringcomm": "ringcomm.bench._rc_worker", "gloo": "ringcomm.bench._gloo_worker",
           "mpi": "ringcomm.bench._mpi_worker"}


@dataclasses.dataclass
class LatencyConfig:
    nps: Sequence[int] = (2, 4)
    nbytes: int = 4096
    ops: int = 1000
    warmup: int = 100
    repeats: int = 3
    idle: float = 2.0
    systems: Sequence[str] = SYSTEMS
    job_timeout: float = 300.0


def mpi_status() -> tuple[list[str] | None, str]:
    """(the mpirun command prefix, a description) or (None, why MPI is skipped)."""
    probe = subprocess.run([sys.executable, "-c", "import mpi4py, mpi4py.MPI as M; print(M.Get_library_version())"],
                           capture_output=True, text=True, timeout=60, env=_util.worker_env(False))
    if probe.returncode != 0:
        return None, "mpi4py is not installed (pip install mpi4py, with Open MPI or MPICH from the system's packages)"
    runner = shutil.which("mpirun") or shutil.which("mpiexec")
    if runner is None:
        return None, "mpi4py imports but neither mpirun nor mpiexec is on PATH"
    library = probe.stdout.strip().splitlines()[0] if probe.stdout.strip() else "MPI"
    prefix = [runner]
    if "Open MPI" in library:
        prefix.append("--oversubscribe")
    return prefix, library


def raw_round_trip(nbytes: int, count: int, warmup: int = 50) -> list[float]:
    """Seconds per round trip of ``nbytes`` between this process and a child over a socketpair."""
    parent, child = socket.socketpair()
    echo = ("import socket, sys\n"
            "s = socket.socket(fileno=int(sys.argv[1]))\n"
            "n = int(sys.argv[2]); buf = bytearray(n); view = memoryview(buf)\n"
            "while True:\n"
            "    got = 0\n"
            "    while got < n:\n"
            "        k = s.recv_into(view[got:])\n"
            "        if not k: sys.exit(0)\n"
            "        got += k\n"
            "    s.sendall(view)\n")
    proc = subprocess.Popen([sys.executable, "-c", echo, str(child.fileno()), str(nbytes)], pass_fds=[child.fileno()])
    child.close()
    payload = bytes(nbytes)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    times: list[float] = []
    try:
        for i in range(warmup + count):
            t0 = time.perf_counter()
            parent.sendall(payload)
            got = 0
            while got < nbytes:
                k = parent.recv_into(view[got:])
                if not k:
                    raise RuntimeError("the echo process closed the socket")
                got += k
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        parent.close()
        proc.wait(timeout=10)
    return times


def _run_one(system: str, np_: int, cfg: LatencyConfig, tmp: str, tag: str, mpirun: list[str] | None) -> dict[str, Any]:
    out = os.path.join(tmp, f"{tag}.json")
    args = ["--op", "allreduce", "--plan", f"{cfg.nbytes}:{cfg.ops}", "--warmup", str(cfg.warmup), "--loop",
            "--out", out, "--deadline", str(_timing.worker_deadline(cfg.job_timeout))]
    if system != "mpi" and cfg.idle > 0:
        args += ["--idle", str(cfg.idle)]
    if system == "mpi":
        assert mpirun is not None
        env = _util.worker_env(False, {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
        cmd = [*mpirun, "-np", str(np_), *_launch.python(), "-m", WORKERS["mpi"], *args]
        result = _procs.run_job([cmd], env, cfg.job_timeout)
    else:
        result = _launch.run_system(system, np_, WORKERS[system], args, cfg.job_timeout)
    record: dict[str, Any] = {"system": system, "np": np_, "ok": result.ok, "error": None, "times_s": [],
                              "idle_cpu_s": None}
    if not result.ok:
        record["error"] = result.describe()
        return record
    try:
        with open(out, encoding="utf-8") as f:
            payload = json.load(f)
        record["times_s"] = payload["results"][0]["times_s"]
        record["idle_cpu_s"] = payload.get("idle_cpu_s")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        record.update(ok=False, error=f"no results from rank 0: {exc}")
    return record


def run(cfg: LatencyConfig) -> dict[str, Any]:
    """Measure; returns the JSON-ready section (config, raw runs, summary, notes)."""
    notes: list[str] = []
    systems = list(cfg.systems)
    _launch.skip_gloo(systems, notes)
    mpirun: list[str] | None = None
    if "mpi" in systems:
        mpirun, what = mpi_status()
        if mpirun is None:
            systems.remove("mpi")
            notes.append(f"MPI skipped: {what}")
        else:
            notes.append(f"MPI: {what}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        for np_ in cfg.nps:
            for repeat in range(cfg.repeats):
                _util.log(f"latency np={np_} raw round trip (round {repeat + 1}/{cfg.repeats}) ...")
                runs.append({"system": "raw", "np": np_, "repeat": repeat, "ok": True, "error": None,
                             "times_s": raw_round_trip(cfg.nbytes, cfg.ops), "idle_cpu_s": None})
                for system in systems:
                    _util.log(f"latency np={np_} {system} (round {repeat + 1}/{cfg.repeats}) ...")
                    record = _run_one(system, np_, cfg, tmp, f"{system}-np{np_}-r{repeat}", mpirun)
                    record["repeat"] = repeat
                    runs.append(record)
                    if not record["ok"]:
                        _util.log(f"  FAILED: {record['error']}")
    return {"nbytes": cfg.nbytes, "ops": cfg.ops, "warmup": cfg.warmup, "repeats": cfg.repeats, "idle_s": cfg.idle,
            "nps": list(cfg.nps), "systems": ["raw", *systems], "notes": notes, "runs": runs,
            "summary": summarize(runs, cfg.nps, ["raw", *systems])}


def summarize(runs: Sequence[dict[str, Any]], nps: Sequence[int], systems: Sequence[str]) -> list[dict[str, Any]]:
    """Per np and system: each percentile's median over rounds (ms), mean, and the idle CPU."""
    rows = []
    for np_ in nps:
        row: dict[str, Any] = {"np": np_, "systems": {}}
        for system in systems:
            mine = [r for r in runs if r["np"] == np_ and r["system"] == system and r["ok"] and r["times_s"]]
            if not mine:
                continue
            stats: dict[str, Any] = {f"p{q}_ms": _util.median(percentile(r["times_s"], q) for r in mine) * 1e3 for q in PERCENTILES}
            stats["mean_ms"] = _util.median(sum(r["times_s"]) / len(r["times_s"]) for r in mine) * 1e3
            idle = [max(r["idle_cpu_s"]) for r in mine if r.get("idle_cpu_s")]
            stats["idle_cpu_s"] = max(idle) if idle else None
            stats["rounds"] = len(mine)
            row["systems"][system] = stats
        have = row["systems"]
        if "ringcomm" in have and "gloo" in have:
            row["gloo_over_ringcomm_p50"] = have["gloo"]["p50_ms"] / have["ringcomm"]["p50_ms"]
        if "ringcomm" in have and "raw" in have:
            row["ringcomm_over_raw_p50"] = have["ringcomm"]["p50_ms"] / have["raw"]["p50_ms"]
        if "ringcomm" in have:
            row["ringcomm_p99_over_p50"] = have["ringcomm"]["p99_ms"] / have["ringcomm"]["p50_ms"]
        rows.append(row)
    return rows


def markdown(section: dict[str, Any]) -> str:
    """The latency table and its ratios."""
    size = _util.format_size(section["nbytes"])
    lines = [f"### {size} allreduce latency, back to back (ms per op; median over {section['repeats']} rounds "
             f"of each percentile; {section['ops']} ops after {section['warmup']})", "",
             "| np | system | p10 | p50 | p90 | p99 | mean | idle CPU (s) |", "|---|---|---|---|---|---|---|---|"]
    for row in section["summary"]:
        for system, st in row["systems"].items():
            idle = f"{st['idle_cpu_s']:.3f} in {section['idle_s']:g} s" if st.get("idle_cpu_s") is not None else ""
            lines.append(f"| {row['np']} | {system} | {st['p10_ms']:.3f} | {st['p50_ms']:.3f} | {st['p90_ms']:.3f} | "
                         f"{st['p99_ms']:.3f} | {st['mean_ms']:.3f} | {idle} |")
    lines.append("")
    for row in section["summary"]:
        parts = []
        if "gloo_over_ringcomm_p50" in row:
            parts.append(f"gloo/ringcomm p50 {row['gloo_over_ringcomm_p50']:.2f}x")
        if "ringcomm_over_raw_p50" in row:
            parts.append(f"ringcomm/raw round trip p50 {row['ringcomm_over_raw_p50']:.1f}x")
        if "ringcomm_p99_over_p50" in row:
            parts.append(f"ringcomm p99/p50 {row['ringcomm_p99_over_p50']:.1f}x")
        if parts:
            lines.append(f"- np={row['np']}: " + ", ".join(parts))
    lines += [f"- {n}" for n in section["notes"]]
    return "\n".join(lines) + "\n"
