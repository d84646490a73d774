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


def _both_gone_before_connecting(tmp_path, notice: str | None) -> PeerWatch:
    """Rank 3's view: ranks 0 and 2, on its host, both ended before either connected to it."""
    watch = PeerWatch(3, 4, 30.0, {}, 0, 0, notice_path=lambda r: str(tmp_path / f"lost-{r}"))
    rank0, rank2 = dead_pid(), dead_pid()
    watch.expect(0, "host vm, pid 10", rank0)
    watch.expect(2, "host vm, pid 12", rank2)
    if notice is not None:
        (tmp_path / "lost-0").write_text(notice.format(rank0=rank0))
    watch.check_peers()
    return watch


def test_the_notice_file_a_leaving_rank_left_names_the_rank_it_lost(tmp_path):
    # rank 0 lost rank 2 and left before rank 3 connected to it: no socket could carry its notice
    watch = _both_gone_before_connecting(tmp_path, "{rank0} 2\n")
    assert sorted(watch.never_connected) == [0, 2]
    assert watch.culprit() == 2
    err = str(watch.lost_error(2))
    assert err.startswith("rank 3: lost rank 2 (host vm, pid 12): it never connected to this rank") and \
        "rank 0 reported losing it too" in err, err


def test_without_a_notice_file_the_lowest_rank_that_never_connected_is_blamed(tmp_path):
    assert _both_gone_before_connecting(tmp_path, None).culprit() == 0


def test_a_notice_file_from_another_process_is_ignored(tmp_path):
    # a job started again under the same derived id finds the last one's file: its pid is not rank 0's
    assert _both_gone_before_connecting(tmp_path, "1 2\n").culprit() == 0
    assert _both_gone_before_connecting(tmp_path, "{rank0} two\n").culprit() == 0


def test_a_failing_rank_leaves_a_notice_file_only_for_a_same_host_peer_it_never_connected_to(tmp_path):
    import os

    def failing_rank0(connected: set[int]) -> PeerWatch:
        watch = PeerWatch(0, 4, 30.0, {}, 0, 0, notice_path=lambda r: str(tmp_path / f"lost-{r}"))
        for peer in (1, 2, 3):
            watch.expect(peer, "host vm", os.getpid())
        watch.authenticated |= connected
        watch.lost[2] = "host vm"
        return watch

    failing_rank0({1, 3}).lost_error(2)
    assert not (tmp_path / "lost-0").exists()  # rank 1 and 3 got the notice on their sockets
    failing_rank0({1}).lost_error(2)
    assert (tmp_path / "lost-0").read_text() == f"{os.getpid()} 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lost-0"]  # nothing half-made left
