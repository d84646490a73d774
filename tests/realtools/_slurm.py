"""A single-node Slurm cluster for the real-tool tests: munged, slurmctld and slurmd in a temp dir.

Started as root from Debian's ``slurm-wlm`` and ``munge`` packages; every file
(configuration, state, logs, the munge socket) lives under one directory, and
the daemons listen on free ports, so two clusters never meet and nothing in
/etc is touched.  Client commands (srun, sbatch, sinfo) find the cluster
through ``SLURM_CONF`` in :meth:`SlurmCluster.env`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: The daemons and client commands the cluster needs; a missing one skips the tests that use it.
TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm", "/usr/lib/slurm")
PMIX_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu/pmix2", "/usr/lib/aarch64-linux-gnu/pmix2", "/usr/lib/x86_64-linux-gnu",
                 "/usr/lib/aarch64-linux-gnu", "/usr/lib")


def missing_tools(which: Callable[[str], str | None] = shutil.which, sbin: str = "/usr/sbin") -> list[str]:
    """The cluster's tools found neither on PATH (``which``) nor in ``sbin``."""
    return [t for t in TOOLS if which(t) is None and not Path(sbin, t).exists()]


def cluster_unavailable(missing: Sequence[str], is_root: bool, host: str,
                        resolve: Callable[[str], str] = socket.gethostbyname) -> str | None:
    """Why a cluster cannot be started here (what to install or change), or None when it can."""
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    if not is_root:
        return "starting slurmd and munged for the test needs root"
    try:
        resolve(host)
    except OSError:
        return f"this machine's name {host!r} does not resolve: Slurm's node list names it"
    return None


def _holds_file(directory: str, name: str) -> bool:
    """Whether ``name`` is in ``directory`` or any folder below it."""
    root = Path(directory)
    return root.is_dir() and next(root.glob(f"**/{name}"), None) is not None


def mpi_plugin_missing(name: str, plugin_dirs: Sequence[str] = PLUGIN_DIRS,
                       pmix_dirs: Sequence[str] = PMIX_LIB_DIRS) -> str | None:
    """Why ``srun --mpi=<name>`` cannot work here (a package to install), or None if it can.

    Slurm's ``mpi/pmix`` plugin loads the unversioned ``libpmix.so``, which only
    Debian's ``libpmix-dev`` provides; without it srun fails with "can not load
    PMIx library" although the plugin file is present.
    """
    if not any(Path(d, f"mpi_{name}.so").exists() for d in plugin_dirs):
        return f"Slurm's mpi/{name} plugin is not installed"
    if name == "pmix" and not any(_holds_file(d, "libpmix.so") for d in pmix_dirs):
        return "Slurm's mpi/pmix plugin cannot load libpmix.so (Debian: apt-get install libpmix-dev)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``with SlurmCluster(tmpdir) as cluster: subprocess.run(["srun", ...], env=cluster.env())``."""

    def __init__(self, root: Path, cpus: int = 8) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.node = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self._procs: list[subprocess.Popen] = []

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        ctld_port, slurmd_port = _free_ports(2)
        # The key must be readable by munged only; a fresh one per cluster.
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self.munge_socket = r / "munge" / "munge.socket"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=ringcommtest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SlurmdParameters=config_overrides",  # more CPUs than the machine has: ranks share cores
                    "ReturnToService=2",
                    "MpiDefault=none",
                    "JobCompType=jobcomp/none",
                    "AccountingStorageType=accounting_storage/none",
                    "KillWait=5",
                    "InactiveLimit=0",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
                    "",
                ]
            )
        )

    def start(self, timeout: float = 60.0) -> None:
        self._write_config()
        r = self.root
        env = self.env()
        munged = subprocess.run(
            [_tool("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={r / 'munge' / 'munge.key'}",
             f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'munge' / 'munged.log'}",
             f"--seed-file={r / 'munge' / 'munged.seed'}"],
            capture_output=True, text=True, timeout=30,
        )
        if munged.returncode != 0:
            raise RuntimeError(f"munged did not start: {munged.stderr.strip()}")
        # -D: stay in the foreground, so the cluster's processes are ours to stop; -i: ignore old state.
        self._procs.append(subprocess.Popen([_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._procs.append(subprocess.Popen([_tool("slurmd"), "-D", "-f", str(self.conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.args[0]}, status {p.returncode}):\n{self.logs()}")
            out = subprocess.run([_tool("sinfo"), "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True,
                                 timeout=20)
            state = out.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node is not up after {timeout:.0f} s (sinfo: {state!r}):\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name} (last lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        pidfile = self.root / "munge" / "munged.pid"
        try:
            pid = int(pidfile.read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # munged is not our child: poll until it is gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
