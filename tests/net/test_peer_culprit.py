"""Which lost rank a survivor blames (``PeerWatch.culprit``), with no sockets: the rules alone."""

from __future__ import annotations

import subprocess
import sys

from ringcomm.net.peers import PeerWatch


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_same_host_peer_that_died_before_connecting_is_blamed_over_the_rank_that_left_because_of_it():
    # rank 3 lost rank 0, which failed because rank 2 never connected; rank 0's notice saying so
    # did not arrive (it left at once), and rank 3's own check has not yet found rank 2 gone
    watch = PeerWatch(3, 4, 30.0, {}, 0, 0)
    watch.expect(0, "host vm, pid 10", None)
    watch.expect(2, "host vm, pid 12", dead_pid())
    watch.lost[0] = "host vm, pid 10"
    assert watch.culprit() == 2
    err = watch.lost_error(2)
    assert "rank 3: lost rank 2 (host vm, pid 12): it never connected to this rank after the rendezvous: " \
           "its process" in str(err) and "ended" in str(err)


def test_a_peer_still_awaited_whose_process_runs_is_not_blamed():
    import os

    watch = PeerWatch(3, 4, 30.0, {}, 0, 0)
    watch.expect(2, "host vm", os.getpid())  # alive: maybe slow to connect
    watch.lost[0] = "host vm"
    assert watch.culprit() == 0
    assert 2 in watch.unconnected
