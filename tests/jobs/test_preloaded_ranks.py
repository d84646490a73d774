"""The suite's preloaded ranks (tests/_preload.py) behave as ``python PROGRAM`` would, as far as the
tests that use them can see: argv, environment, folder, streams, exit status, signals, a killed
client, and a string-hash seed of their own per rank index."""

from __future__ import annotations

import array
import os
import signal
import subprocess
import sys
import time

import pytest
from _launcher_helpers import wait_gone
from _preload import enabled, rank_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

if not enabled():
    pytest.skip("preloaded ranks are off here (TESTS_PRELOAD=0, or not Linux)", allow_module_level=True)
pytest.importorskip("torch")


def run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*rank_python(2), "-c", code, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env}, cwd="/")


def test_argv_environment_folder_and_streams_are_the_callers() -> None:
    code = ("import os, sys; print(sys.argv, repr(sys.path[0]), os.getcwd(), os.environ['PROBE'], __name__); "
            "print('to stderr', file=sys.stderr); print(sys.stdin.read())")
    proc = subprocess.run([*rank_python(2), "-c", code, "a", "b"], input="from stdin", capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PROBE": "42"}, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "['-c', 'a', 'b'] '' / 42 __main__\nfrom stdin\n"
    assert proc.stderr == "to stderr\n"


def test_a_program_file_runs_as_main_with_its_folder_first_on_the_path(tmp_path) -> None:
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "prog.py").write_text("import sys, helper_mod\nif __name__ == '__main__':\n"
                                      "    print(sys.argv[1:], helper_mod.VALUE)\n    sys.exit(4)\n")
    proc = subprocess.run([*rank_python(2), str(tmp_path / "prog.py"), "x"], capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout) == (4, "['x'] 7\n"), proc.stderr


@pytest.mark.parametrize(("code", "status"), [
    ("import sys; sys.exit(3)", 3),
    ("raise ValueError('boom')", 1),
    ("import sys; sys.exit('a message')", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
])
def test_the_exit_status_is_the_programs(code: str, status: int) -> None:
    proc = run(code)
    assert proc.returncode == status, proc.stderr
    if status == 1:
        assert "boom" in proc.stderr or "a message" in proc.stderr


def test_atexit_functions_and_non_daemon_threads_finish_before_the_end() -> None:
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n")
    proc = run(code)
    assert proc.stdout == "thread done\natexit ran\n", proc.stderr


def test_a_signal_to_the_client_reaches_the_program_and_a_killed_client_takes_it_down() -> None:
    # the main thread wakes every 0.1 s: the kernel may hand a signal sent to the process to another of
    # its threads (torch's, in a preloaded child), and Python runs the handler when the main thread next
    # runs, not while it sleeps
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda s, f: (print('usr1', flush=True), sys.exit(9)))\n"
            "print(os.getpid(), flush=True)\nfor _ in range(500):\n    time.sleep(0.1)\n")
    proc = subprocess.Popen([*rank_python(2), "-c", code], stdout=subprocess.PIPE, text=True)
    int(proc.stdout.readline())
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 9 and proc.stdout.read() == "usr1\n"
    proc = subprocess.Popen([*rank_python(2), "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait(timeout=30)
    assert not wait_gone([child], timeout=20), f"the program (pid {child}) outlived its killed client"


def test_ranks_of_one_job_have_their_own_hash_seeds_and_torch_threads_follow_omp() -> None:
    code = "import torch; print(hash('ringcomm'), torch.get_num_threads())"
    outs = [subprocess.run([*rank_python(2), "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "RINGCOMM_RANK": str(r), "OMP_NUM_THREADS": "1"}).stdout.split()
            for r in (0, 1)]
    assert outs[0][1] == outs[1][1] == "1"
    assert outs[0][0] != outs[1][0], "ranks 0 and 1 share a string-hash seed"


def test_the_client_imports_nothing_heavy() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", *rank_python(2)[1:], "-c", "pass"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "numpy" not in proc.stderr and "torch" not in proc.stderr, proc.stderr[-2000:]


def test_a_client_that_leaves_half_way_does_not_stop_the_server() -> None:
    import socket

    import _preload

    path = rank_python(2)[3].split(":")[0]
    server = _preload._servers[0][0]
    for payload in (b"", b"\x00\x00\x10\x00{"):  # nothing at all; a request cut short
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            if payload:
                sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    time.sleep(0.5)
    assert server.poll() is None, "the preload server died"
    assert run("print('still serving')").stdout == "still serving\n"
    assert _preload._servers[0][0] is server
