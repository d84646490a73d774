"""The small-op lane when a signal handler raises on the thread that waits in it.

A rank's program may end from a signal handler (``sys.exit`` on SIGTERM or SIGUSR1,
KeyboardInterrupt on SIGINT) while its main thread waits in the lane.  If the handler
runs while that thread waits to take the lane's lock back from the sweeper (which holds
it while it finishes an op), the exception must still leave the lock as it found it:
otherwise the ``with`` around the wait releases the sweeper's lock, nobody holds it any
more in name, and ``shutdown()`` waits for it forever (the rank neither ends nor fails,
and its peers wait for its next post).

One process plays rank 0 of a two-rank lane (conftest's ``lane_pair``); the test holds
the lock the way the sweeper does and plays rank 1 through a second view of the region.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from ringcomm.lane.handle import LaneHandle
from ringcomm.shm import futex, slots as shm
from ringcomm.core import wire
from ringcomm.errors import ShutdownError
from ringcomm.handles import Entry

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not (futex.available() and shm.available()), reason="needs futexes and /dev/shm (Linux x86-64)"),
]


class Interrupted(Exception):
    pass


def _allreduce(name: str) -> Entry:
    x = np.ones(16, np.float32)
    req = wire.Request(name, wire.ALLREDUCE, "float32", (x.shape,), 1)
    return Entry(req, [x], LaneHandle(name))


def test_a_handler_raising_while_the_waiter_takes_the_lock_back_leaves_the_lock_usable(lane_pair):
    lane_driver, peer, submitted = lane_pair
    entry = _allreduce("x")
    assert lane_driver.submit(entry, others=0)  # posted fast; rank 1 has not posted
    main = threading.get_ident()
    state: dict[str, object] = {}

    def sweeper_like() -> None:
        time.sleep(0.3)  # the waiter is asleep on rank 1's counter by now (it holds no lock there)
        with lane_driver._cond:  # held as the sweeper holds it while it finishes an op
            peer.set_off()  # wakes the waiter: it leaves its futex sleep and blocks taking the lock
            time.sleep(0.3)
            signal.pthread_kill(main, signal.SIGUSR1)  # the handler raises on the blocked waiter
            time.sleep(0.3)
            state["held while the handler ran"] = lane_driver._cond._lock.locked()  # type: ignore[attr-defined]
        state["released"] = True

    def raise_interrupted(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, raise_interrupted)
    helper = threading.Thread(target=sweeper_like)
    try:
        helper.start()
        with pytest.raises(Interrupted):
            entry.handle.wait()
        helper.join(5)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert state == {"held while the handler ran": True, "released": True}
    # the lock is free and works: the op resolves (rank 1 went off, so it diverts to the engine)
    assert lane_driver._cond.acquire(timeout=2)
    lane_driver._cond.release()
    with pytest.raises(TimeoutError):  # it resolves: rank 1 went off, so it goes to the engine
        entry.handle.wait(timeout=0)
    assert submitted == [entry]


def test_shutdown_after_an_interrupted_wait_returns_and_fails_what_the_peer_never_posted(lane_pair):
    lane_driver, peer, submitted = lane_pair
    entry = _allreduce("y")
    assert lane_driver.submit(entry, others=0)
    main = threading.get_ident()

    def raise_interrupted(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, raise_interrupted)
    try:
        threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            entry.handle.wait()
    finally:
        signal.signal(signal.SIGUSR1, old)
    started = time.monotonic()
    lane_driver.close(timeout=0.5)  # rank 1 never posts: the op fails instead of waiting
    assert time.monotonic() - started < 5
    with pytest.raises(ShutdownError):
        entry.handle.wait(timeout=1)
    assert peer.read_below(0) == 1  # rank 0 reads no more: a peer reusing the slot does not wait for it
