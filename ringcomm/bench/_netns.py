"""Two "hosts" on one machine: network namespaces joined by a veth pair, and an ssh look-alike.

Used by the multi-host tests and by ``python -m ringcomm.bench crosshost``.

:class:`TwoHosts` creates namespaces ``rcmh-<pid>-<n>-a`` and ``-b`` (names
unique to this test process, so users sharing the machine never collide),
each with loopback up and one end of a veth pair carrying its own address
(the end is called ``rceth0`` in both, so ``--network-interface rceth0``
names it on every host).
Its ``ssh`` script behaves like ssh as the launcher sees it: ``SSH [OPTIONS]
HOST 'COMMAND LINE'`` runs the line with ``sh -c`` inside HOST's namespace,
in ``/``, with an empty environment (``env -i``), in a session of its own
(so signals to the ssh's process group do not reach it, as with a real
remote host), and ends when the line ends.  Every call's arguments (but the
line) are appended to ``ssh.log``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from pathlib import Path

_counter = itertools.count()


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or ``None`` when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the suite as root to test multi-host launch"
    for tool in ("ip", "setsid"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed (iproute2 / util-linux), so no network namespaces can be made"
    probe = f"rcmh-{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def shaping_unavailable_reason() -> str | None:
    """Why links between namespaces cannot be shaped here (``tc``), or ``None`` when they can."""
    why = unavailable_reason()
    if why is None and shutil.which("tc") is None:
        why = "'tc' is not on PATH (iproute2; usually /usr/sbin), so no link can be shaped"
    return why


def tc_rate_bits(rate: str) -> int:
    """Bits per second of a ``tc`` rate such as ``1gbit``, ``500mbit``, ``10gbit``."""
    text = rate.strip().lower()
    for suffix, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    raise ValueError(f"not a tc rate: {rate!r} (use e.g. 1gbit, 500mbit)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class TwoHosts:
    """Namespaces ``a`` (10.213.N.1) and ``b`` (10.213.N.2) on one veth link; ``close()`` removes them."""

    def __init__(self, workdir: Path) -> None:
        n = next(_counter)
        tag = f"{os.getpid()}-{n}"
        self.ns = {"a": f"rcmh-{tag}-a", "b": f"rcmh-{tag}-b"}
        subnet = f"10.213.{n % 250}"
        self.addr = {"a": f"{subnet}.1", "b": f"{subnet}.2"}
        link = f"rcmh{os.getpid() % 100000}x{n % 100}"  # interface names: at most 15 characters
        self.ifname = {"a": link + "a", "b": link + "b"}
        self.interface = "rceth0"
        self._made: list[str] = []
        try:
            for side in ("a", "b"):
                _ip("netns", "add", self.ns[side])
                self._made.append(self.ns[side])
            _ip("link", "add", self.ifname["a"], "type", "veth", "peer", "name", self.ifname["b"])
            for side in ("a", "b"):
                ns, dev = self.ns[side], self.ifname[side]
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "link", "set", "dev", dev, "name", self.interface)
                _ip("-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", self.interface)
                _ip("-n", ns, "link", "set", self.interface, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        self.ssh = workdir / "fake-ssh"
        self.ssh_log = workdir / "ssh.log"
        self.ssh_lines = workdir / "ssh-lines.log"  # the remote command lines, as a process list shows them
        cases = "\n".join(f'  {self.addr[s]}) ns={self.ns[s]} ;;' for s in ("a", "b"))
        self.ssh.write_text(
            "#!/bin/sh\n"
            'opts=""\n'
            'while [ $# -gt 2 ]; do opts="$opts $1"; shift; done\n'
            f'echo "$opts $1" >> {self.ssh_log}\n'
            f'printf "%s\\n" "$2" >> {self.ssh_lines}\n'
            'case "$1" in\n'
            f"{cases}\n"
            '  *) echo "ssh: Could not resolve hostname $1: Name or service not known" >&2; exit 255 ;;\n'
            "esac\n"
            "cd /\n"
            'exec setsid -w ip netns exec "$ns" env -i PATH=/usr/bin:/bin HOME=/ sh -c "$2"\n'
        )
        self.ssh.chmod(0o755)

    def shape(self, rate: str) -> None:
        """Limit both directions of the link to ``rate`` (``tc`` units: ``1gbit``, ``10gbit``) with a token
        bucket on each end; ``"none"`` removes the limit."""
        for side in ("a", "b"):
            ns = self.ns[side]
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", self.interface, "root"],
                           capture_output=True)
            if rate == "none":
                continue
            bits = tc_rate_bits(rate)
            burst = max(256 * 1024, bits // 8 // 250)  # at least one timer tick's worth of bytes
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.interface, "root", "tbf",
                   "rate", rate, "burst", str(burst), "latency", "100ms"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"cannot shape the link in network namespace {ns} to {rate}: "
                                   f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr.strip()}")

    def exec_argv(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``side``."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def pids(self, side: str) -> list[int]:
        """Processes running inside namespace ``side``."""
        out = subprocess.run(["ip", "netns", "pids", self.ns[side]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def wait_empty(self, timeout: float = 5.0, sides: tuple[str, ...] = ("a", "b")) -> dict[str, list[int]]:
        """Wait until no process runs in the ``sides`` namespaces; returns what is still running per side."""
        deadline = time.monotonic() + timeout
        while True:
            left = {side: self.pids(side) for side in sides}
            if not any(left.values()) or time.monotonic() > deadline:
                return {side: pids for side, pids in left.items() if pids}
            time.sleep(0.05)

    def close(self) -> None:
        """Kill anything left inside, delete the namespaces (the veth pair goes with them)."""
        for ns in self._made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in out.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        # a veth pair not yet moved into a namespace when setup failed
        subprocess.run(["ip", "link", "del", self.ifname["a"]], capture_output=True)
