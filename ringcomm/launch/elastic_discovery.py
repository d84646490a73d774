"""Host discovery for elastic jobs: run the user's script, parse ``host:slots`` lines.

The script (``ringcomm-run --host-discovery-script SCRIPT``) prints the hosts
available right now, one per line; a line without ``:slots`` gets
``--slots-per-host`` slots.  Blank lines and ``#`` comments are ignored::

    $ cat discover.sh
    #!/bin/sh
    echo localhost:2
    echo 127.0.0.2:1

    >>> parse_hosts("localhost:2\\n127.0.0.2\\n", default_slots=1)
    {'localhost': 2, '127.0.0.2': 1}

A host that is this machine under some name (``localhost``, ``127.0.0.x``,
this host's name, or a name that resolves to a loopback address) gets local
workers; any other host gets them through ssh (:mod:`ringcomm.launch.elastic_starter`).
Several names for this machine act as several hosts, which is how elastic
jobs are tested on one machine.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import subprocess

from ..errors import InvalidInputError

__all__ = ["parse_hosts", "HostDiscoveryScript", "FixedHosts", "DiscoveryError", "is_local_host"]


class DiscoveryError(InvalidInputError):
    """The discovery script failed or printed something that is not ``host[:slots]`` lines."""


def parse_hosts(text: str, default_slots: int) -> dict[str, int]:
    """``{host: slots}`` in the order the hosts were printed; a host printed twice keeps its last count."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots = line.rpartition(":") if line.count(":") == 1 else (line, "", "")
        if not sep:
            name, count = line, default_slots
        elif slots.isdigit():
            count = int(slots)
        else:
            raise DiscoveryError(f"discovery line {number}: {raw!r} is not host or host:slots (slots a number)")
        if not name or any(c.isspace() for c in name):
            raise DiscoveryError(f"discovery line {number}: {raw!r} has no valid host name")
        hosts.pop(name, None)
        if count > 0:
            hosts[name] = count
    return hosts


@functools.lru_cache(maxsize=256)
def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine: localhost, a loopback address, or this host's own name."""
    if name in ("localhost", "localhost.localdomain", "ip6-localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except (OSError, ValueError):
        return False


class HostDiscoveryScript:
    """Runs ``script`` (through the shell) and parses what it prints.

        >>> HostDiscoveryScript("echo localhost:2", default_slots=1).find()
        {'localhost': 2}
    """

    def __init__(self, script: str, default_slots: int = 1, timeout: float = 30.0) -> None:
        self.script = script
        self.default_slots = default_slots
        self.timeout = timeout

    def find(self) -> dict[str, int]:
        """The hosts available now; raises :class:`DiscoveryError` when the script fails."""
        try:
            done = subprocess.run(self.script, shell=True, capture_output=True, text=True, timeout=self.timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"host discovery script {self.script!r} ran longer than {self.timeout:.0f} s") from None
        except OSError as exc:
            raise DiscoveryError(f"cannot run host discovery script {self.script!r}: {exc}") from None
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-3:]
            raise DiscoveryError(
                f"host discovery script {self.script!r} exited with code {done.returncode}"
                + (": " + " | ".join(tail) if tail else "")
            )
        return parse_hosts(done.stdout, self.default_slots)


class FixedHosts:
    """The hosts of ``-H``/``--hostfile`` in an elastic job without a discovery script (Horovod's fault
    tolerance without scaling): always the same; a failed worker's host is blacklisted as usual.

        >>> FixedHosts({"localhost": 2, "127.0.0.2": 2}).find()
        {'localhost': 2, '127.0.0.2': 2}
    """

    def __init__(self, hosts: dict[str, int]) -> None:
        self.hosts = dict(hosts)

    def find(self) -> dict[str, int]:
        return dict(self.hosts)
