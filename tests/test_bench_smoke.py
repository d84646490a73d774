"""Smoke test of ``python -m ringcomm.bench``: it runs, measures both systems and writes sane JSON.

No timing thresholds: the benchmark is a measuring tool, and this machine is shared.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _preload import rank_python
from conftest import needs_torch
from ringcomm.bench import _util, collectives, report

ROOT = Path(__file__).resolve().parent.parent


def _preloaded() -> list[str]:
    """``--rank-python`` for ranks that start with torch imported (tests/_preload.py): the benches' own
    figures do not matter here, their runs do."""
    return ["--rank-python", shlex.join(rank_python(2))]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def test_sizes_and_bandwidth_formulas() -> None:
    assert [_util.parse_size(s) for s in ("4K", "64k", "1M", "16MiB", "1G", "512")] == [
        4096, 65536, 1 << 20, 16 << 20, 1 << 30, 512]
    with pytest.raises(ValueError):
        _util.parse_size("4Q")
    assert _util.format_size(4096) == "4 KiB" and _util.format_size(64 << 20) == "64 MiB"
    # 16 MiB allreduce at np=2 in 10.3 ms: 1.63 GB/s (ANCHORS.md)
    assert collectives.bus_bandwidth("allreduce", 16 << 20, 2, 0.0103) / 1e9 == pytest.approx(1.63, abs=0.01)
    assert collectives.bus_bandwidth("allgather", 4000, 4, 1.0) == pytest.approx(3000)
    assert collectives.bus_bandwidth("broadcast", 4000, 4, 2.0) == pytest.approx(2000)
    assert report.sig(0.0123456) == "0.0123" and report.sig(293.4) == "293" and report.sig(None) == "n/a"


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_allreduce_bench_writes_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "allreduce", "--np", "2", "--sizes", "4K", "64K",
           "--iters", "3", "--repeats", "1", "--warmup", "1", "--job-timeout", "50",
           "--json", str(out), "--out-dir", str(tmp_path), "--no-plot", "--encrypt"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads(out.read_text())
    assert data["meta"]["cpu_count"] >= 1 and data["meta"]["python"] and data["meta"]["date"]
    section = data["collectives"]["allreduce"]
    assert section["op"] == "allreduce" and section["nps"] == [2] and section["sizes"] == [4096, 65536]
    assert {"ringcomm", "gloo", "ringcomm-encrypted"} <= set(section["systems"])

    runs = {r["system"]: r for r in section["runs"]}
    for system in ("ringcomm", "gloo", "ringcomm-encrypted"):
        run = runs[system]
        assert run["ok"] and run["np"] == 2, run
        assert [r["bytes"] for r in run["results"]] == [4096, 65536]
        for res in run["results"]:
            assert len(res["times_s"]) == 3 and all(t > 0 for t in res["times_s"])

    assert [(row["np"], row["bytes"]) for row in section["summary"]] == [(2, 4096), (2, 65536)]
    for row in section["summary"]:
        rc_, gloo = row["systems"]["ringcomm"], row["systems"]["gloo"]
        for stats in (rc_, gloo):
            assert stats["median_ms"] > 0 and stats["busbw_gbps"] > 0 and stats["samples"] == 3
        # bus bandwidth from the median latency: 2(N-1)/N * bytes / time
        assert rc_["busbw_gbps"] == pytest.approx(row["bytes"] / (rc_["median_ms"] / 1e3) / 1e9)
        ratio = row["ratio_ringcomm_over_gloo"]
        assert ratio["latency"] == pytest.approx(rc_["median_ms"] / gloo["median_ms"])
        assert ratio["busbw"] == pytest.approx(rc_["busbw_gbps"] / gloo["busbw_gbps"])
        assert math.isclose(ratio["latency"] * ratio["busbw"], 1.0, rel_tol=1e-9)
        cost = row["ratio_encrypted_over_plain"]  # --encrypt: RINGCOMM_ENCRYPT=1 vs the plain ringcomm run
        assert cost["latency"] == pytest.approx(row["systems"]["ringcomm-encrypted"]["median_ms"] / rc_["median_ms"])
        # the median is the median of the raw per-iteration times
        raw = next(r for r in runs["ringcomm"]["results"] if r["bytes"] == row["bytes"])["times_s"]
        assert rc_["median_ms"] == pytest.approx(sorted(raw)[1] * 1e3)

    assert "| 2 | 4 KiB |" in proc.stdout and "latency ratio" in proc.stdout
    assert "ringcomm encrypted ms" in proc.stdout and "encrypted/plain latency" in proc.stdout


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_resources_bench_measures_rss_and_idle_cpu_of_both_systems(tmp_path: Path) -> None:
    """The memory target as a check: 200 allreduces of 4 MiB allocate nothing per op that stays."""
    out = tmp_path / "res.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "resources", "--ops", "200", "--bytes", "4M", "--idle", "1",
           "--json", str(out), "--out-dir", str(tmp_path), "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["resources"]
    runs = {r["system"]: r for r in section["runs"]}
    assert set(runs) == {"ringcomm", "gloo"} and all(r["ok"] for r in runs.values())
    for run in runs.values():
        assert [r["rank"] for r in sorted(run["ranks"], key=lambda r: r["rank"])] == [0, 1]
        for rank in run["ranks"]:
            assert set(rank["rss_mib"]) == {"10", "100", "200"} and rank["rss_mib"]["10"] > 10
            assert 0 <= rank["idle_cpu_percent"] < 100 and rank["threads"] >= 1
    assert runs["ringcomm"]["max_rss_growth_percent"] < 5.0, runs["ringcomm"]
    assert "### Resources: np=2, 200 allreduces of 4 MiB" in proc.stdout


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_training_bench_runs_every_setup_and_the_bounds(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "training", *_preloaded(), "--np", "2", "--steps", "3", "--warmup", "1",
           "--repeats", "1", "--json", str(out), "--out-dir", str(tmp_path), "--no-plot", "--job-timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["training"]
    runs = {r["setup"]: r for r in section["runs"]}
    assert {"single", "ddp", "ringcomm", "lockstep", "independent"} <= set(runs)
    for setup in ("single", "ddp", "ringcomm", "lockstep", "independent"):
        assert runs[setup]["ok"] and runs[setup]["img_per_s"] > 0, runs[setup]
    both = runs["independent"]
    assert len(both["rank_seconds"]) == 2 and both["images"] == 2 * 32 * 3  # two processes' images, summed
    assert both["img_per_s"] > max(both["images"] / 2 / s for s in both["rank_seconds"])
    pairs = {r["of"] for r in section["ratios"] + section["bound_ratios"]}
    assert pairs == {"ringcomm/ddp", "lockstep/ddp", "independent/ddp", "ringcomm/lockstep"}
    assert "bound: independent processes" in proc.stdout and "ringcomm / lockstep img/s" in proc.stdout


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_exchange_only_training_runs_ringcomm_against_ddp_on_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "exchange.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "training", *_preloaded(), "--model", "exchange", "--np", "2", "--steps", "2",
           "--warmup", "1", "--repeats", "1", "--setups", "ddp", "ddp_ringcomm", "ringcomm", "--json", str(out),
           "--out-dir", str(tmp_path), "--no-plot", "--job-timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["training"]
    assert section["model"].startswith("exchange only") and section["device"] == "cpu"
    runs = {r["setup"]: r for r in section["runs"]}
    # the GPU run's rows, on the CPU (its bound, the independent processes, runs in the test above)
    assert set(runs) == {"ddp", "ddp_ringcomm", "ringcomm"}
    assert all(r["ok"] and r["img_per_s"] > 0 for r in runs.values()), runs
    assert "Training step (exchange only, cpu)" in proc.stdout


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_fsdp_setups_run_only_when_named_and_compare_the_backends(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "training", *_preloaded(), "--np", "2", "--steps", "2", "--warmup", "1",
           "--repeats", "1", "--setups", "fsdp", "fsdp_ringcomm", "--json", str(out), "--out-dir", str(tmp_path),
           "--no-plot", "--job-timeout", "60"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    section = json.loads(out.read_text())["training"]
    runs = {r["setup"]: r for r in section["runs"]}
    assert set(runs) == {"single", "fsdp", "fsdp_ringcomm"}, set(runs)
    assert all(r["ok"] and r["img_per_s"] > 0 for r in runs.values()), runs
    assert {r["of"] for r in section["bound_ratios"]} == {"fsdp_ringcomm/fsdp"}
    assert 'FSDP2 ("ringcomm" backend)' in proc.stdout


def test_latency_percentiles_and_raw_round_trip() -> None:
    from ringcomm.bench import latency

    assert latency.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert latency.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 99) == 5.0
    assert latency.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 10) == 1.0
    assert math.isnan(latency.percentile([], 50))
    times = latency.raw_round_trip(4096, 20, warmup=2)
    assert len(times) == 20 and all(t > 0 for t in times)


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_latency_bench_reports_percentiles_and_idle_cpu(tmp_path: Path) -> None:
    out = tmp_path / "lat.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "latency", "--np", "2", "--ops", "20", "--warmup", "2",
           "--repeats", "1", "--idle", "0.2", "--systems", "ringcomm", "gloo", "--job-timeout", "50",
           "--json", str(out), "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())["latency"]
    row = data["summary"][0]
    assert set(row["systems"]) == {"raw", "ringcomm", "gloo"}
    for system in ("raw", "ringcomm", "gloo"):
        st = row["systems"][system]
        assert 0 < st["p10_ms"] <= st["p50_ms"] <= st["p90_ms"] <= st["p99_ms"]
    assert row["systems"]["ringcomm"]["idle_cpu_s"] is not None and row["systems"]["ringcomm"]["idle_cpu_s"] >= 0
    assert len(next(r for r in data["runs"] if r["system"] == "ringcomm")["times_s"]) == 20
    assert "allreduce latency" in proc.stdout and "gloo/ringcomm p50" in proc.stdout


def test_crosshost_link_bounds() -> None:
    from ringcomm.bench import _netns, crosshost

    assert _netns.tc_rate_bits("1gbit") == 10**9 and _netns.tc_rate_bits("500mbit") == 5 * 10**8
    with pytest.raises(ValueError):
        _netns.tc_rate_bits("fast")
    b = crosshost.link_bounds(64 << 20, 4, 2, 10**9)
    # 2 hosts x 2 ranks: a flat ring pushes 1.5 S across the link, a hierarchical allreduce S
    assert b["flat_ring_s"] == pytest.approx(1.5 * (64 << 20) * 8 / 1e9)
    assert b["hierarchical_s"] == pytest.approx((64 << 20) * 8 / 1e9)


@settings(max_examples=25, deadline=None)
@given(hosts=st.integers(2, 5), count=st.integers(0, 300), seg_bytes=st.sampled_from([4, 12, 64, 1 << 20]),
       seed=st.integers(0, 2**32 - 1))
def test_the_plain_ring_sums_over_any_number_of_members_and_segments(hosts: int, count: int, seg_bytes: int,
                                                                     seed: int) -> None:
    """The crosshost and cluster benchmarks' plain-socket ring (the ceiling for an allreduce on the hosts'
    CPUs) really is an allreduce: members joined by socket pairs all end with the sum."""
    import socket
    import threading

    from ringcomm.bench._cluster_worker import plain_ring_allreduce

    rng = np.random.default_rng(seed)
    data = [rng.integers(-1000, 1000, count).astype(np.float32) for _ in range(hosts)]  # sums exact in float32
    links = [socket.socketpair() for _ in range(hosts)]  # member i sends on links[i][0], reads links[i - 1][1]
    bufs = [d.copy() for d in data]
    errors: list[BaseException] = []

    def member(i: int) -> None:
        try:
            plain_ring_allreduce(links[i][0], links[i - 1][1], i, hosts, bufs[i], np.empty_like(bufs[i]), seg_bytes)
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for a, b in links:
        a.close()
        b.close()
    assert not errors and not any(t.is_alive() for t in threads), errors
    expected = np.sum(data, axis=0, dtype=np.float64) if count else np.zeros(0)
    for buf in bufs:
        np.testing.assert_array_equal(buf, expected.astype(np.float32))


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_crosshost_bench_runs_both_systems_over_a_shaped_link(tmp_path: Path) -> None:
    from ringcomm.bench import _netns

    why = _netns.shaping_unavailable_reason()
    if why is not None:
        pytest.skip(why)
    out = tmp_path / "xh.json"
    cmd = [sys.executable, "-m", "ringcomm.bench", "crosshost", "--rates", "1gbit", "--sizes", "64K", "1M",
           "--iters", "2", "--warmup", "1", "--repeats", "1", "--systems", "ringcomm", "gloo", "plain-ring",
           "--json", str(out), "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())["crosshost"]
    assert data["skipped"] is None
    assert [(r["rate"], r["bytes"], sorted(r["systems"])) for r in data["summary"]] == [
        ("1gbit", size, ["exchange", "gloo", "plain-ring", "raw", "ringcomm"]) for size in (65536, 1 << 20)]
    for row in data["summary"]:  # the raw TCP round trip: the link's floor, timed in the same round
        raw = row["systems"]["raw"]
        assert 0 < raw["median_s"] <= raw["p99_s"] and row["ringcomm_over_raw"] > 0
        # the plain-socket exchange: each system's share of it (2 hosts: the ceiling is the exchange's time)
        assert row["ceiling_s"] == row["systems"]["exchange"]["median_s"]
        assert row["ringcomm_share"] == pytest.approx(row["ceiling_s"] / row["systems"]["ringcomm"]["median_s"])
        assert row["gloo_share"] > 0
    # 1 MiB at 1 Gbit/s: the wire's 8.4 ms less what the shaper's burst lets through; far below a second
    exchange = data["summary"][1]["systems"]["exchange"]["median_s"]
    assert 0 < exchange < 1.0
    assert "gloo/ringcomm" in proc.stdout and "raw TCP round trip" in proc.stdout and "plain-socket exchange" in proc.stdout
    assert "plain-socket ring, with the sum" in proc.stdout  # its check summed right, or its job failed
    # every job says how much of the host's CPU the hypervisor took while it ran (this kernel has the column)
    assert all(0 <= r["steal"] < 1 for r in data["runs"]), [r["steal"] for r in data["runs"]]
    assert "CPU time the hypervisor took (steal)" in proc.stdout
    # and each system's CPU per op on its busiest rank, from every rank's own count over the timed ops
    for r in data["runs"]:
        if r["system"] in ("ringcomm", "gloo", "exchange"):
            for res in r["results"]:
                assert len(res["rank_cpu_s"]) == 4 and all(u >= 0 and s >= 0 for u, s in res["rank_cpu_s"]), res
    assert all(row["systems"][system]["cpu_per_op_s"] >= 0 for row in data["summary"]
               for system in ("ringcomm", "gloo", "exchange"))
    assert "CPU per op on each system's busiest rank" in proc.stdout and "cores all ranks together kept busy" in proc.stdout


def test_cpu_per_op_is_the_busiest_ranks_median_over_the_rounds_and_its_share_of_a_core() -> None:
    from ringcomm.bench import cluster

    def job(repeat: int, cpu: list[list[float]], times: list[float]) -> dict:
        return {"ok": True, "system": "ringcomm", "repeat": repeat,
                "results": [{"bytes": 4096, "iters": 2, "times_s": times, "rank_cpu_s": cpu}]}

    runs = [job(0, [[0.010, 0.002], [0.004, 0.004]], [0.02, 0.02]),  # busiest rank: 12 ms for 2 ops
            job(1, [[0.020, 0.010], [0.001, 0.001]], [0.02, 0.02]),  # 30 ms
            job(2, [[0.008, 0.002], [0.010, 0.006]], [0.02, 0.02]),  # 16 ms
            {"ok": True, "system": "gloo", "repeat": 0, "results": [{"bytes": 4096, "iters": 2, "times_s": [0.01]}]}]
    stats = cluster.pooled(runs, "ringcomm", 4096)
    assert stats is not None and stats["cpu_per_op_s"] == pytest.approx(0.008)  # median of 6, 15, 8 ms per op
    gloo = cluster.pooled(runs, "gloo", 4096)
    assert gloo is not None and "cpu_per_op_s" not in gloo  # a job from before the workers counted it
    row = {"bytes": 4096, "systems": {"ringcomm": stats, "gloo": gloo}}
    text = cluster.cpu_text([row], ["ringcomm", "gloo"], lambda r: "4 KiB")
    assert text is not None and text.endswith("4 KiB: ringcomm 8 ms (40%).")  # 8 ms of CPU per 20 ms op
    assert cluster.cpu_text([{"bytes": 4096, "systems": {"gloo": gloo}}], ["gloo"], lambda r: "") is None
    # every rank on this machine: how many of its cores the ranks kept busy (10, 16 and 13 ms per 20 ms op)
    assert stats["all_ranks_cpu_per_op_s"] == pytest.approx(0.013)
    text = cluster.cpu_text([row], ["ringcomm"], lambda r: "4 KiB", cores=2)
    assert text is not None and "of this machine's 2 cores" in text and text.endswith("ringcomm 8 ms (40%; all ranks 0.7 cores).")


def test_the_hypervisors_share_of_the_cpu_between_two_samples(tmp_path: Path) -> None:
    from ringcomm.bench import _util

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n")
    assert _util.cpu_ticks(str(stat)) == (40, 1000)
    stat.write_text("cpu  200 0 100 1600 20 0 0 80 0 0\n")  # 1000 ticks later, 40 of them stolen
    assert _util.steal_share((40, 1000), _util.cpu_ticks(str(stat))) == pytest.approx(0.04)
    assert _util.steal_share((40, 1000), (40, 1000)) is None  # no time passed: no share
    stat.write_text("intr 1 2 3\n")
    assert _util.cpu_ticks(str(stat)) is None and _util.cpu_ticks(str(tmp_path / "none")) is None
    text = _util.steal_text([{"steal": 0.01}, {"steal": 0.2}, {"steal": None}, {}])
    assert text == ("CPU time the hypervisor took (steal) on the host that ran the benchmark, per job: median 10.5%, "
                    "most 20.0% (2 jobs).")
    assert _util.steal_text([{"steal": None}]) is None


def test_ratios_pair_each_round_with_itself_and_skip_a_round_one_system_lost() -> None:
    from ringcomm.bench import cluster

    def run(system: str, repeat: int, times: list[float], ok: bool = True) -> dict:
        return {"system": system, "repeat": repeat, "ok": ok,
                "results": [{"bytes": 64, "times_s": times}, {"bytes": 8, "times_s": [9.0]}]}

    runs = [run("ringcomm", 0, [1.0, 1.0, 5.0]), run("gloo", 0, [2.0, 2.0]),
            run("ringcomm", 1, [4.0]), run("gloo", 1, [6.0]),   # a slow round for both: its ratio is still 1.5
            run("ringcomm", 2, [1.0]), run("gloo", 2, [1.0], ok=False),
            run("gloo", 3, [3.0]), run("ringcomm", 3, [2.0])]   # order within a round does not matter
    assert cluster.paired_ratios(runs, "gloo", "ringcomm", 64) == [2.0, 1.5, 1.5]
    assert cluster.paired_ratios(runs, "gloo", "ringcomm", 8) == [1.0, 1.0, 1.0]
    assert cluster.paired_ratios(runs, "gloo", "ringcomm", 16) == []
    row = {"gloo_over_ringcomm": 1.234, "gloo_over_ringcomm_rounds": [2.0, 1.5, 1.5]}
    assert cluster.ratio_text(row) == "1.23; rounds 1.50 (1.50-2.00)"
    assert cluster.ratio_text({"gloo_over_ringcomm": 1.2, "gloo_over_ringcomm_rounds": [1.2]}) == "1.20"
    assert cluster.ratio_text({}) == "n/a"


def test_cluster_hosts_and_the_ceiling_shares() -> None:
    from ringcomm.bench import cluster

    assert cluster.host_slots("a:2,b:2") == [("a", 2), ("b", 2)]
    assert cluster.host_slots("node1,10.0.0.2:4") == [("node1", 1), ("10.0.0.2", 4)]
    for bad in ("a:0", "a:x", ":2"):
        with pytest.raises(ValueError, match="NAME:SLOTS"):
            cluster.host_slots(bad)
    # 4 hosts: an allreduce moves 2(H-1)/H = 1.5 x S out of each host, so the ceiling is 1.5 x the exchange
    row = {"systems": {"exchange": {"median_s": 0.1}, "ringcomm": {"median_s": 0.2}, "gloo": {"median_s": 0.3}}}
    cluster.ceiling_shares(row, 4, ("ringcomm", "gloo"))
    assert row["ceiling_s"] == pytest.approx(0.15)
    assert row["ringcomm_share"] == pytest.approx(0.75) and row["gloo_share"] == pytest.approx(0.5)
    alone = {"systems": {"ringcomm": {"median_s": 0.2}}}
    cluster.ceiling_shares(alone, 2, ("ringcomm",))  # no exchange timed: no ceiling, no share
    assert "ceiling_s" not in alone and cluster.share_text(alone, "ringcomm") == "n/a"
    argv = cluster.job_argv(cluster.ClusterConfig(hosts="a:2,b:2", ssh_port=2222, network_interface="eth1",
                                                  python="/opt/py"), "gloo", "1024:3", "/tmp/o.json")
    assert argv[:6] == ["/opt/py", "-m", "ringcomm.launch.launcher", "-np", "4", "-H"]
    assert argv[argv.index("--ssh-port") + 1] == "2222" and argv[argv.index("--network-interface") + 1] == "eth1"
    assert argv[argv.index("--system") + 1] == "gloo" and "--ssh-command" not in argv


@needs_torch
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_cluster_bench_runs_on_two_hosts_as_a_user_runs_it(hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``bench cluster -H`` started on host a, reaching host b over (look-alike) ssh, as on a user's cluster."""
    out = tmp_path / "cluster.json"
    argv = [sys.executable, "-m", "ringcomm.bench", "cluster", "-H", f"{hosts.addr['a']}:1,{hosts.addr['b']}:1",
            "--ssh-command", str(hosts.ssh), "--network-interface", hosts.interface, "--sizes", "1M",
            "--iters", "3", "--warmup", "1", "--repeats", "1", "--systems", "ringcomm", "gloo", "plain-ring",
            "--json", str(out), "--out-dir", str(tmp_path)]
    proc = subprocess.run(hosts.exec_argv("a", argv), capture_output=True, text=True, timeout=220, env=_env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())["cluster"]
    assert [r["system"] for r in data["runs"]] == ["exchange", "ringcomm", "gloo", "plain-ring"]
    assert all(r["ok"] for r in data["runs"])  # the plain ring's job checks its sum before it times
    (row,) = data["summary"]
    assert sorted(row["systems"]) == ["exchange", "gloo", "plain-ring", "ringcomm"]
    assert row["ringcomm_share"] > 0 and row["gloo_share"] > 0 and row["gloo_over_ringcomm"] > 0
    assert "plain-socket exchange" in proc.stdout and "ringcomm's share" in proc.stdout
    assert "plain-socket ring, with the sum | ringcomm's share of it" in proc.stdout


@pytest.mark.timeout(60)
def test_a_job_that_times_out_says_where_its_worker_waited() -> None:
    """A worker still running just before its job's timeout prints every thread's stack, and the
    bench keeps enough of a timed-out job's output to show it: here a server no client ever reaches."""
    from ringcomm.bench import _procs, _timing

    timeout = 4.0
    worker = [sys.executable, "-m", "ringcomm.bench._tcp_rtt", "--serve", "127.0.0.1", "--port",
              str(_util.free_port()), "--plan", "4096:1", "--deadline", str(_timing.worker_deadline(timeout))]
    result = _procs.run_job([worker], _util.worker_env(False), timeout)
    assert result.timed_out and not result.ok
    text = result.describe()
    assert "every thread's stack follows" in text, text
    assert "in accept" in text and "in serve" in text, text  # the main thread, waiting in listener.accept()


@pytest.mark.timeout(60)
def test_a_worker_whose_imports_were_slow_still_shows_its_stacks_before_the_timeout() -> None:
    """The worker's deadline counts from its start, not from the end of its imports (``import torch``
    takes seconds on a loaded machine): the stacks come out before the bench stops the job."""
    from ringcomm.bench import _procs, _timing

    timeout = 8.0
    code = ("import time; time.sleep(4); from ringcomm.bench._timing import start_watchdog; "
            f"start_watchdog({_timing.worker_deadline(timeout)}); time.sleep(60)")
    result = _procs.run_job([[sys.executable, "-c", code]], _util.worker_env(False), timeout)
    assert result.timed_out and "every thread's stack follows" in result.describe(), result.describe()


@pytest.mark.timeout(60)
def test_a_benchmark_worker_stuck_holding_the_gil_still_ends_after_its_deadline() -> None:
    # ctypes.PyDLL keeps the GIL through the C call, as a backend stuck in C++ may: the watchdog
    # thread cannot run, and faulthandler's timer (a C thread) must end the process instead.
    code = ("from ringcomm.bench._timing import start_watchdog; start_watchdog(0.5); "
            "import ctypes; ctypes.PyDLL(None).sleep(40)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=_env())
    assert proc.returncode != 0 and time.monotonic() - start < 20, (proc.returncode, proc.stderr[-2000:])
    assert "Timeout" in proc.stderr  # faulthandler's report: every thread's stack


@pytest.mark.timeout(60)
def test_raw_tcp_round_trip_echoes_every_size_of_the_plan() -> None:
    import threading

    from ringcomm.bench import _tcp_rtt

    port = _util.free_port()
    plan = [(1, 5), (4096, 7), (1 << 20, 2)]
    server = threading.Thread(target=_tcp_rtt.serve, args=("127.0.0.1", port, plan, 2), daemon=True)
    server.start()
    results = _tcp_rtt.connect("127.0.0.1", port, plan, 2)
    server.join(timeout=10)
    assert not server.is_alive()
    assert [(r["bytes"], len(r["times_s"])) for r in results] == [(1, 5), (4096, 7), (1 << 20, 2)]
    assert all(t > 0 for r in results for t in r["times_s"])


@needs_torch
@pytest.mark.parametrize("command", [["training"], ["allreduce", "--np", "2"]])
def test_device_cuda_without_a_gpu_says_so_before_starting_a_job(tmp_path: Path, command: list[str]) -> None:
    if _util.cuda_missing() is None:
        pytest.skip("this machine has a GPU that torch sees")
    proc = subprocess.run([sys.executable, "-m", "ringcomm.bench", *command, "--device", "cuda", "--no-plot",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert "--device cuda needs a GPU that torch can see" in proc.stderr and "leave --device out" in proc.stderr
    assert not list(tmp_path.iterdir())  # no job ran, no report was written


def test_rank_python_starts_every_rank_and_the_launcher_stays_this_interpreter() -> None:
    from ringcomm.bench import _launch
    from ringcomm.bench.__main__ import build_parser

    assert build_parser().parse_args(["training", "--rank-python", "numactl -N 0 python3"]).rank_python
    with pytest.raises(SystemExit):  # the commands that start no ranks of their own do not take it
        build_parser().parse_args(["ceiling", "--rank-python", "python3"])
    try:
        _launch.use_python(["numactl", "-N", "0", "python3"])
        assert _launch.ringcomm_commands(2, "m", ["--x"]) == [[sys.executable, "-m", "ringcomm.launch.launcher", "-np",
                                                               "2", "numactl", "-N", "0", "python3", "-m", "m", "--x"]]
        assert all(cmd[:4] == ["numactl", "-N", "0", "python3"] for cmd in _launch.gloo_commands(2, "m", [], 1))
    finally:
        _launch.use_python([])
    assert _launch.python() == [sys.executable]


HIDE_TORCH = """
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hide())
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_without_torch_the_benches_skip_gloo_and_the_torch_benches_say_why(tmp_path: Path) -> None:
    """The core needs only numpy, pyzmq and msgpack: without torch (hidden from every process here)
    the collectives run ringcomm alone and say why gloo is missing; the torch benches exit at once,
    and ``import ringcomm_torch`` names the fix."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_TORCH)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "ringcomm.bench", "allreduce", "--np", "2", "--sizes", "4K", "--iters", "5",
           "--repeats", "1", "--no-plot", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gloo skipped (it comes with torch): torch is not installed here: pip install torch" in proc.stdout
    assert "| 2 | 4 KiB |" in proc.stdout, proc.stdout
    for command in ("training", "ddp", "backend"):
        proc = subprocess.run([sys.executable, "-m", "ringcomm.bench", command], capture_output=True, text=True,
                              timeout=60, env=env, cwd=tmp_path)
        assert proc.returncode == 2 and "pip install torch" in proc.stderr, (command, proc.stderr)
    proc = subprocess.run([sys.executable, "-c", "import ringcomm_torch"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)
    assert "ringcomm_torch needs torch, which is not installed here: pip install 'ringcomm[torch]'" in proc.stderr
