"""Remote command lines (ringcomm.launch.remote) and the remote end that runs them (ringcomm.launch.rexec)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from _launcher_helpers import alive, kill_leftovers, wait_gone
from ringcomm.launch import remote, rexec


def test_host_specific_variables_stay_home() -> None:
    env = {"PATH": "/opt/venv/bin:/usr/bin", "PYTHONPATH": "/w", "HOSTNAME": "a", "HOME": "/home/me", "PWD": "/w",
           "SSH_AUTH_SOCK": "/tmp/agent", "BASH_FUNC_f%%": "() { :; }", "TMPDIR": "/tmp/me", "LR": "0.1",
           "CUDA_VISIBLE_DEVICES": "0,1", "RINGCOMM_RANK": "2", "bad-name": "x"}
    assert remote.forwarded_env(env) == {
        "PATH": "/opt/venv/bin:/usr/bin", "PYTHONPATH": "/w", "LR": "0.1", "CUDA_VISIBLE_DEVICES": "0,1",
        "RINGCOMM_RANK": "2",
    }


def test_ssh_argv_puts_options_before_the_host() -> None:
    assert remote.ssh_argv("ssh -o BatchMode=yes", 2222, "/k/id", "hostB", "true") == [
        "ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/k/id", "hostB", "true"]
    assert remote.ssh_argv("ssh", None, None, "h", "true") == ["ssh", "h", "true"]
    with pytest.raises(ValueError, match="--ssh-command is empty"):
        remote.ssh_argv("  ", None, None, "h", "true")


def test_a_command_line_too_long_for_a_remote_shell_is_refused() -> None:
    with pytest.raises(ValueError, match="more than a remote shell takes .* largest forwarded variables are BIG"):
        remote.remote_command("/", {"BIG": "x" * 200_000, "A": "1"}, ["true"], sys.executable, "j", 0, 1.0)


def run_with_input_open(argv: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end with its input an open pipe, as over ssh (end of input means: stop)."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)
    try:
        out, err = proc.stdout.read(), proc.stderr.read()
        proc.wait(20)
    finally:
        proc.kill()
        proc.stdin.close()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


SHOW = "import json, os, sys; print(json.dumps({'cwd': os.getcwd(), 'argv': sys.argv[1:], 'env': dict(os.environ)})); sys.exit(3)"


@pytest.mark.timeout(30)
def test_the_remote_line_recreates_directory_environment_and_arguments(tmp_path) -> None:
    """Run the line as sshd would: ``sh -c LINE`` in another directory with an empty environment."""
    tricky = "it's \"quoted\" $HOME `x` ; & | \\ \n new line, ü"
    env = {"PATH": os.environ["PATH"], "TRICKY": tricky, "EMPTY": "", "RINGCOMM_RANK": "2"}
    line = remote.remote_command(str(tmp_path), env, [sys.executable, "-c", SHOW, "a b", tricky],
                                 sys.executable, "job1", 2, 1.0)
    out = run_with_input_open(["env", "-i", "PATH=/usr/bin:/bin", "sh", "-c", line], cwd="/")
    assert out.returncode == 3, out.stderr
    seen = json.loads(out.stdout)
    assert seen["cwd"] == str(tmp_path)
    assert seen["argv"] == ["a b", tricky]
    assert {k: seen["env"].get(k) for k in env} == env


CHILD_AND_GRANDCHILD = """
import os, subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(os.getpid(), kid.pid, flush=True)
time.sleep(60)
"""

IGNORES_SIGTERM = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(os.getpid(), flush=True)
time.sleep(60)
"""


def _rexec(code: str, grace: float = 1.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ringcomm.launch.rexec", "--grace", str(grace), "--", sys.executable, "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.mark.timeout(30)
def test_end_of_input_stops_the_command_and_its_children() -> None:
    """ssh forwards no signals: when the launcher closes the ssh's input, the remote side stops everything."""
    proc = _rexec(CHILD_AND_GRANDCHILD)
    pids = [int(p) for p in proc.stdout.readline().split()]
    try:
        assert len(pids) == 2 and all(alive(p) for p in pids)
        start = time.monotonic()
        proc.stdin.close()
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert time.monotonic() - start < 3.0
        assert wait_gone(pids) == []
        assert "killed by" not in proc.stderr.read()  # stopping on request is not reported as a crash
    finally:
        kill_leftovers(pids)
        proc.kill()


@pytest.mark.timeout(30)
def test_a_command_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc = _rexec(IGNORES_SIGTERM, grace=0.5)
    pid = int(proc.stdout.readline())
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # a signal to the wrapper itself counts as a stop too
        assert proc.wait(10) == 128 + signal.SIGKILL
        assert 0.4 < time.monotonic() - start < 5.0
        assert not alive(pid)
    finally:
        kill_leftovers([pid])
        proc.kill()


@pytest.mark.timeout(30)
def test_exit_status_and_leftover_children_when_the_command_ends_by_itself() -> None:
    code = ("import subprocess, sys; kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print(kid.pid, flush=True); sys.exit(5)")
    proc = _rexec(code)
    kid = int(proc.stdout.readline())
    try:
        assert proc.wait(10) == 5
        assert wait_gone([kid]) == []
    finally:
        kill_leftovers([kid])


@pytest.mark.timeout(30)
def test_a_command_killed_by_a_signal_is_reported_since_ssh_cannot_carry_it() -> None:
    proc = run_with_input_open(
        [sys.executable, "-m", "ringcomm.launch.rexec", "--rank", "3", "--", sys.executable, "-c", "import os; os.abort()"]
    )
    assert proc.returncode == 128 + signal.SIGABRT
    assert "ringcomm.launch.rexec: rank 3 (pid" in proc.stderr and "was killed by SIGABRT" in proc.stderr


@pytest.mark.timeout(30)
def test_a_missing_program_is_reported() -> None:
    proc = subprocess.run([sys.executable, "-m", "ringcomm.launch.rexec", "--", "/nonexistent/program"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 127
    assert "cannot start '/nonexistent/program'" in proc.stderr


def test_files_of_dead_ranks_are_removed_and_live_ones_kept() -> None:
    job = secrets.token_hex(4)
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp = tempfile.gettempdir()
    files = {
        f"{tmp}/ringcomm-{job}-{dead.pid}-r2-0-data-3": False,
        f"{tmp}/ringcomm-{job}-{os.getpid()}-r2-0-data-3": True,  # a live process owns it
        f"/dev/shm/ringcomm-{job}-0-2-3": False,  # a ring rank 2 wrote to rank 3
        f"/dev/shm/ringcomm-{job}-0-3-2": True,  # rank 3's ring: not this rank's
        f"/dev/shm/ringcomm-{job}-0-lost-2": False,  # the notice rank 2 left as it failed
        f"/dev/shm/ringcomm-{job}-0-lost-3": True,
    }
    try:
        for path in files:
            open(path, "w").close()
        removed = rexec.remove_job_files(job, rank=2)
        assert sorted(removed) == sorted(p for p, keep in files.items() if not keep)
        assert {p: os.path.exists(p) for p in files} == files
    finally:
        for path in files:
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.timeout(30)
def test_the_secret_comes_through_the_input_and_the_input_still_stops_the_rank() -> None:
    """The launcher writes RINGCOMM_SECRET into the ssh's input, not onto a command line others can read."""
    code = "import os, sys, time; print(os.environ['RINGCOMM_SECRET'], flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringcomm.launch.rexec", "--grace", "1", "--secret-on-stdin", "--",
         sys.executable, "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        proc.stdin.write("00ff9a\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "00ff9a"
        proc.stdin.close()  # and the rest of the input is still watched: its end stops the rank
        assert proc.wait(10) == 128 + signal.SIGTERM
    finally:
        proc.kill()


@pytest.mark.timeout(30)
def test_no_secret_line_means_no_rank() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringcomm.launch.rexec", "--secret-on-stdin", "--", sys.executable, "-c", "print('ran')"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out, err = proc.communicate("not hex!\n", timeout=20)
    assert proc.returncode == 2 and "ran" not in out and "no job secret arrived" in err


def test_the_remote_line_refuses_to_carry_the_secret_when_it_goes_through_the_input() -> None:
    line = remote.remote_command("/w", {"A": "1"}, ["true"], "/py", "job1", 0, 2.0, secret_on_stdin=True)
    assert "--secret-on-stdin" in line
    with pytest.raises(ValueError):
        remote.remote_command("/w", {"RINGCOMM_SECRET": "ab"}, ["true"], "/py", "job1", 0, 2.0, secret_on_stdin=True)
