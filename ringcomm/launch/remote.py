"""Command lines that start a rank on another host through ssh (or any ssh-like program).

A remote shell starts in the home directory with a fresh environment, so the
command line itself carries what the rank needs::

    cd /the/working/dir && exec env PATH=... RINGCOMM_RANK=2 ... \\
        /path/to/python -m ringcomm.launch.rexec --grace 2 --job JOB --rank 2 -- python train.py

:mod:`ringcomm.launch.rexec` runs the command in a process group of its own and
stops that group when its standard input closes -- which is what happens on
the remote side when ``ringcomm-run`` closes the ssh's input or the ssh dies
(ssh does not forward signals).

Example::

    >>> ssh_argv("ssh", 2222, None, "hostB", "cd /w && exec env A=1 true")
    ['ssh', '-p', '2222', 'hostB', 'cd /w && exec env A=1 true']
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from ..errors import InvalidInputError

__all__ = ["EXCLUDED_VARS", "EXCLUDED_PREFIXES", "forwarded_env", "remote_command", "ssh_argv", "MAX_COMMAND_BYTES"]

#: Variables that describe the launching host or session, not the job: never sent to other hosts.
EXCLUDED_VARS = frozenset({
    "HOSTNAME", "HOST", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "_", "MAIL",
    "TERM", "TERMCAP", "COLUMNS", "LINES", "DISPLAY", "XAUTHORITY", "TMPDIR", "TMUX", "TMUX_PANE", "STY",
    "WINDOW", "WINDOWID", "PS1", "PS2", "PROMPT_COMMAND", "LS_COLORS", "DBUS_SESSION_BUS_ADDRESS",
    "XDG_RUNTIME_DIR", "XDG_SESSION_ID", "XDG_SESSION_TYPE", "XDG_SESSION_CLASS", "XDG_SEAT", "XDG_VTNR",
    "KRB5CCNAME", "GPG_AGENT_INFO", "SUDO_USER", "SUDO_UID", "SUDO_GID", "SUDO_COMMAND",
})
#: Prefixes of variables never sent: the ssh session's own, and exported shell functions.
EXCLUDED_PREFIXES = ("SSH_", "BASH_FUNC_")
#: A shell command is one argument to the remote shell; Linux caps one argument at 128 KiB.
MAX_COMMAND_BYTES = 120 * 1024

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a remote rank gets: all but host- and session-specific variables.

    Example:
        >>> forwarded_env({"PATH": "/usr/bin", "HOSTNAME": "a", "SSH_AUTH_SOCK": "/tmp/x", "LR": "0.1"})
        {'PATH': '/usr/bin', 'LR': '0.1'}
    """
    return {
        k: v for k, v in env.items()
        if _NAME.fullmatch(k) and k not in EXCLUDED_VARS and not k.startswith(EXCLUDED_PREFIXES)
    }


def remote_command(
    cwd: str,
    env: Mapping[str, str],
    command: Sequence[str],
    python: str,
    job_id: str,
    rank: int,
    grace: float,
    secret_on_stdin: bool = False,
) -> str:
    """The shell command line that runs ``command`` as rank ``rank`` on a remote host.

    ``env`` is exported as it is (filter it with :func:`forwarded_env` first);
    ``python`` must exist at that path on the remote host (the same virtual
    environment everywhere, as with horovodrun).  With ``secret_on_stdin`` the
    remote end reads ``RINGCOMM_SECRET`` from the first line of its input
    instead: a command line is visible to every user in the process lists of
    both hosts, so ``env`` must then not hold the secret.
    """
    if secret_on_stdin and "RINGCOMM_SECRET" in env:
        raise ValueError("secret_on_stdin: RINGCOMM_SECRET must not be on the command line too")
    assignments = [f"{k}={v}" for k, v in sorted(env.items())]
    wrapper = [python, "-m", "ringcomm.launch.rexec", "--grace", f"{grace:g}", "--job", job_id, "--rank", str(rank),
               *(["--secret-on-stdin"] if secret_on_stdin else []), "--"]
    line = f"cd {shlex.quote(cwd)} && exec env {shlex.join([*assignments, *wrapper, *command])}"
    if len(line.encode()) > MAX_COMMAND_BYTES:
        biggest = sorted(env, key=lambda k: len(env[k]), reverse=True)[:3]
        raise InvalidInputError(
            f"the command line for rank {rank} is {len(line.encode())} bytes, more than a remote shell takes "
            f"({MAX_COMMAND_BYTES}); the largest forwarded variables are {', '.join(biggest)}: unset them"
        )
    return line


def ssh_argv(ssh_command: str, port: int | None, identity_file: str | None, host: str, line: str) -> list[str]:
    """``CMD [-p PORT] [-i FILE] HOST LINE`` -- ``ssh_command`` may hold options (``"ssh -o BatchMode=yes"``)."""
    argv = shlex.split(ssh_command)
    if not argv:
        raise InvalidInputError("--ssh-command is empty; give a program such as ssh")
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file is not None:
        argv += ["-i", identity_file]
    return [*argv, host, line]
