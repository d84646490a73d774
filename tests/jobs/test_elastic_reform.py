"""A worker that dies while a new world assembles: the others re-form at once, not after RINGCOMM_START_TIMEOUT.

The launcher knows the worker's process ended; it calls off that generation's rendezvous, so the workers
waiting there go back to it for the next world (at the job's start, inside their first ``init()``; when the
job grows, inside the reset).  Hosts are names of this machine (localhost, 127.0.0.x).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from _launcher_helpers import run_launcher

pytestmark = pytest.mark.multiprocess

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "elastic_hosts_worker.py")
#: What a worker waiting for a dead peer at the rendezvous would otherwise wait.
START_TIMEOUT = 60.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("when", ["start", "grow"])
def test_a_worker_dying_before_the_rendezvous_does_not_cost_the_start_timeout(tmp_path: Path, when: str) -> None:
    hosts = tmp_path / "hosts"
    if when == "start":  # worker 2 dies before its first init(); 0 and 1 wait in theirs
        hosts.write_text("localhost:1\n127.0.0.2:1\n127.0.0.3:1\n")
        flags, grow = ["-np", "3"], []
    else:  # the job grows onto 127.0.0.3 at step 3 (the driver looks every second, the job runs for 4 s or
        # more): the new worker dies while 0 and 1 wait to re-form
        hosts.write_text("localhost:1\n127.0.0.2:1\n")
        flags = ["-np", "2", "--max-np", "3"]
        grow = ["--grow-line", "127.0.0.3:1", "--grow-step", "3", "--hosts-file", str(hosts)]
    result, elapsed = run_launcher(
        "-v", *flags, "--min-np", "2", "--start-timeout", str(START_TIMEOUT), "--host-discovery-script",
        f"cat {hosts}", "--elastic-timeout", "30", sys.executable, WORKER, "--steps", "40", "--sleep", "0.1",
        "--die-on-host", "127.0.0.3", *grow, timeout=85,
    )
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert elapsed < START_TIMEOUT / 2, f"took {elapsed:.1f} s\n{err}"
    assert re.search(r"worker 2 on 127\.0\.0\.3 \(pid \d+\) exited with code 3", err), err
    assert "host 127.0.0.3 blacklisted" in err
    last = "generation 1" if when == "start" else "generation 2"
    assert f"{last}: 2 workers (worker 0@localhost -> rank 0, worker 1@127.0.0.2 -> rank 1)" in err, err
    done = re.findall(r"DONE worker=(\d) host=\S+ rank=\d size=(\d) step=(\d+) value=(\S+)", out)
    assert sorted(done) == [("0", "2", "40", "820"), ("1", "2", "40", "820")], out
