"""Ranks on one machine in separate containers: the same host name, but each rank in its own pid
namespace (pid 1 in every container), or with a /dev/shm of its own (``docker run --net=host``,
Kubernetes pods with ``hostNetwork``).  Made with ``unshare`` as root; skipped elsewhere.

Ranks that cannot share /dev/shm run as separate hosts over TCP, with a warning naming them; ranks
in separate pid namespaces share memory but never look up each other's pids.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import start_torchrun_job

_JOB = textwrap.dedent("""
    import os, numpy as np, ringcomm as rc
    from ringcomm import runtime
    rc.init()
    r, n = rc.rank(), rc.size()
    ok = True
    for count in (1000, 3_000_000):  # the small-op lane, then the ring with 12 MB payloads
        x = np.full(count, r + 1, np.float32)
        rc.allreduce(x, op=rc.Sum, name=f"a{count}", out=x)
        ok &= bool((x == n * (n + 1) / 2).all())
        got = rc.allgather(np.full(count, r, np.float32), name=f"g{count}")
        ok &= bool(np.array_equal(got, np.repeat(np.arange(n, dtype=np.float32), count)))
    hosts = [p["host"] for p in runtime.current("x").engine.peer_table]
    stats = runtime.current("x").engine._link.stats
    print("RESULT", r, ok, os.getpid(), ",".join(hosts), stats.get("cross_memory", 0), flush=True)
    rc.shutdown()
""")

_PRIVATE_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"']
_OWN_PIDS = ["unshare", "-p", "-f"]


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "needs Linux namespaces"
    if os.geteuid() != 0:
        return "needs root for unshare -p and a private tmpfs on /dev/shm"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    for wrap in (_OWN_PIDS + ["true"], _PRIVATE_SHM[:-1] + ["mount -t tmpfs -o size=1m tmpfs /dev/shm"]):
        probe = subprocess.run(wrap, capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            return f"cannot make namespaces ({' '.join(wrap[:3])}): {probe.stderr.strip()}"
    return None


_REASON = _why_not()
pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]


def _run(tmp_path, wraps: list[list[str]]) -> tuple[list[list[str]], list[str]]:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    world = len(wraps)
    procs = start_torchrun_job([str(script)], world, [{"RINGCOMM_HOSTNAME": "box"}] * world, wrap=wraps,
                               RINGCOMM_CROSS_MEMORY_MIN_BYTES="262144")
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    results = [line.split()[1:] for out in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == world and all(ok == "True" for _, ok, *_ in results), outs
    return results, outs


@pytest.mark.timeout(90)
def test_ranks_each_in_its_own_pid_namespace_share_memory_and_leave_pids_alone(tmp_path) -> None:
    results, outs = _run(tmp_path, [_OWN_PIDS] * 3)
    assert [pid for _, _, pid, _, _ in results] == ["1", "1", "1"]  # one pid, three processes
    assert all(hosts == "box,box,box" for _, _, _, hosts, _ in results)  # one host: shared memory
    assert all(lent == "0" for *_, lent in results)  # no reads of another namespace's pid
    assert not any("report the host name" in out for out in outs)


@pytest.mark.timeout(90)
def test_a_rank_with_a_dev_shm_of_its_own_runs_as_another_host_with_a_warning(tmp_path) -> None:
    results, outs = _run(tmp_path, [[], [], _PRIVATE_SHM])
    assert all(hosts == "box#0,box#0,box#1" for _, _, _, hosts, _ in results), results
    assert "ranks 0-2 report the host name 'box' but do not share /dev/shm" in outs[0]
    assert "box#0 (ranks 0-1), box#1 (rank 2)" in outs[0]
