"""Ranks that start with torch already imported: a test-only stand-in for ``python`` in a job's command.

``import torch`` costs 3-4 CPU-seconds per process, and the torch jobs of the suite spend most of
their CPU on it: the suite starts dozens of them on two cores. Here a *preload server* imports
torch once and forks a child for each rank that asks; the child then runs the rank's program as
``python`` would (``__main__``, ``sys.argv``, ``sys.path``, environment, working folder, standard
streams, exit status).

    cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "2", *rank_python(2), script]

- :func:`rank_python` returns ``[sys.executable, THIS_FILE, "run"]``: a small client, started by the
  launcher as the rank. It sends its argv, environment, working folder and its three standard
  streams (``SCM_RIGHTS``) to a server, waits for the child's end and exits as the child did (the
  same code, or killed by the same signal). SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2
  sent to the client go on to the child; if the client dies (SIGKILL), the server kills the child.
- One server per rank index (``RINGCOMM_RANK``, ``RANK``), so ranks of one job do not share
  a string-hash seed, as separate interpreters would not.
- The child sets torch's thread count from ``OMP_NUM_THREADS`` when the rank's environment has it
  (the server's OpenMP read its own environment when it loaded).
- The child ends as the interpreter would (non-daemon threads, then atexit functions, then the
  streams flushed) but skips tearing the modules down, a second of CPU with torch loaded.
- Use it only where a test checks what the program does, not what the process is: the rank's pid is
  the child's; a signal that cannot be caught (SIGSTOP, SIGKILL) sent to the client does not reach
  it; and the child lives in the server's namespaces (mount, network), resource limits and cgroup,
  so a job in a small ``/dev/shm`` or in a network namespace must not use it.  The child also has
  torch's thread from the start: a signal sent to the process may land there, and Python then runs
  the handler when the main thread next runs, not while it waits in one long call.
  ``TESTS_PRELOAD=0`` in pytest's environment turns it off (plain ``python``).
"""

from __future__ import annotations

import array
import atexit
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_SOCKET_ENV = "TESTS_PRELOAD_SOCKETS"
_servers: dict[int, tuple[subprocess.Popen, str]] = {}
_folder: list[str] = []


# ---------------------------------------------------------------- pytest's side


def enabled() -> bool:
    return (os.environ.get("TESTS_PRELOAD", "1") != "0" and sys.platform.startswith("linux")
            and hasattr(os, "pidfd_open"))


def rank_python(np_: int) -> list[str]:
    """What a job's command runs in place of ``python`` for its ``np_`` ranks: the client of started
    preload servers (one per rank index, started here on first use), or plain ``python``."""
    if not enabled():
        return [sys.executable]
    _start(np_)
    return [sys.executable, os.path.abspath(__file__), "run", ":".join(_servers[i][1] for i in range(np_))]


def _start(np_: int) -> None:
    from conftest import job_env

    if not _folder:
        _folder.append(tempfile.mkdtemp(prefix="ringcomm-tests-preload-"))
        atexit.register(_stop_all)
    starting = []
    for i in range(np_):
        if i in _servers and _servers[i][0].poll() is None:
            continue
        path = os.path.join(_folder[0], f"server-{i}.sock")
        if os.path.exists(path):
            os.unlink(path)
        env = job_env()
        env.pop("OMP_NUM_THREADS", None)  # each child sets torch's threads from its own environment
        log = open(os.path.join(_folder[0], f"server-{i}.log"), "ab")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path], env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        _servers[i] = (proc, path)
        starting.append(i)
    deadline = time.monotonic() + 120
    for i in starting:
        proc, path = _servers[i]
        while not os.path.exists(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(_folder[0], f"server-{i}.log"), "rb") as f:
                    raise RuntimeError(f"preload server {i} did not start: {f.read()[-3000:]!r}")
            time.sleep(0.05)


def _stop_all() -> None:
    for proc, _ in _servers.values():
        proc.kill()
        proc.wait()
    _servers.clear()
    if _folder:
        import shutil

        shutil.rmtree(_folder[0], ignore_errors=True)


# ---------------------------------------------------------------- the client (the rank's process)


def _client(paths: str, program: list[str]) -> None:
    rank = int(os.environ.get("RINGCOMM_RANK") or os.environ.get("RANK") or 0)
    choices = paths.split(":")
    child: list[int] = []  # the program's pid, once the server says it
    early: list[int] = []  # signals that came before that: the program may run (and print) before then

    def forward(signum: int, frame: object) -> None:
        if not child:
            early.append(signum)
            return
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(choices[rank % len(choices)])
    request = json.dumps({"argv": program, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    sock.sendmsg([struct.pack("!I", len(request)) + request],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    pid = struct.unpack("!i", _recv_exactly(sock, 4))[0]
    child.append(pid)
    for signum in early:
        forward(signum, None)
    reply = _recv_exactly(sock, 4)
    if len(reply) < 4:
        sys.stderr.write("preload server: the connection closed before the rank ended\n")
        os._exit(1)
    status = struct.unpack("!i", reply)[0]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


# ---------------------------------------------------------------- the server


def _serve(path: str) -> tuple[dict, list[int]] | None:
    """Import what every rank imports, then fork a child per request. Returns (request, fds) in a
    child, which then runs the program; the server itself never returns."""
    import selectors

    import numpy  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import zmq  # noqa: F401

    from ringcomm.launch.guard import _die_with_parent

    _die_with_parent(signal.SIGKILL)
    default_threads = torch.get_num_threads()
    import gc

    gc.freeze()  # the children's collections skip what is here before them (and copy none of its pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, client)
    while True:
        for key, _ in sel.select():
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError, struct.error) as exc:  # a client gone before it asked
                    print(f"preload server: dropped a request: {exc!r}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    conn.close()
                    for pidfd, (_, client) in children.items():
                        os.close(pidfd)
                        client.close()
                    _die_with_parent(signal.SIGKILL)
                    request["default_threads"] = default_threads
                    return request, fds
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, ("exit", pidfd))
                sel.register(conn, selectors.EVENT_READ, ("client", pidfd))
                conn.sendall(struct.pack("!i", pid))
            elif key.data[0] == "exit":
                pidfd = key.data[1]
                pid, conn = children.pop(pidfd)
                _, status = os.waitpid(pid, 0)
                sel.unregister(pidfd)
                os.close(pidfd)
                if conn in sel.get_map():
                    sel.unregister(conn)
                try:
                    conn.sendall(struct.pack("!i", status))
                except OSError:
                    pass
                conn.close()
            else:  # the client sent nothing else, so readable means it is gone: the child goes too
                pid, _ = children[key.data[1]]
                sel.unregister(key.fileobj)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The client's request and its three streams; raises if the client leaves before it is whole."""
    fds = array.array("i")
    conn.settimeout(30)  # a client that stops half-way must not hold up the others
    data, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    try:
        if len(fds) != 3:
            raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
        (size,) = struct.unpack("!I", data[:4])
        body = data[4:]
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise ValueError("the client closed the connection mid-request")
            body += chunk
        conn.settimeout(None)
        return json.loads(body), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _become(request: dict, fds: list[int]) -> None:
    """In the child: take the rank's streams, environment and folder, then run its program as
    ``python PROGRAM...`` would, leaving the interpreter's own exit to end the process."""
    import runpy

    import torch

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for sig in _FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   errors="backslashreplace", line_buffering=True,
                                                   write_through=unbuffered)
    threads = env.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else request["default_threads"])
    for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1
    _end(code)


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code & 0xFF
    print(stop.code, file=sys.stderr)
    return 1


def _end(code: int) -> None:
    """End as the interpreter does (wait for non-daemon threads, then the atexit functions, then flush
    the streams), but skip tearing down the modules: for a process with torch loaded that is a
    second of CPU, and in a forked child it would also copy every page the server shares with it."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _client(sys.argv[2], sys.argv[3:])
    else:
        sys.path.pop(0)  # this file's folder is not a program's import path
        child = _serve(sys.argv[2])
        del sys.argv[1:]
        if child is not None:
            _become(*child)
