"""``python -m ringcomm.bench``: measure ringcomm side by side with the systems it competes with.

Subcommands (see ``python -m ringcomm.bench --help``):

``allreduce`` / ``allgather`` / ``broadcast``
    For each world size, alternate ringcomm jobs (started with the ringcomm
    launcher) and torch.distributed gloo jobs (plain subprocesses) on the same
    sizes, so machine drift hits both; report median latency, bus bandwidth
    and the ratios ringcomm/gloo.  A Horovod column appears only when
    ``import horovod.torch`` works.  ``--encrypt`` adds ringcomm with
    ``RINGCOMM_ENCRYPT=1`` (CURVE) and an encrypted/plain latency column.
``cluster``
    Allreduce on the user's own hosts (``-H node1:P,node2:P``, started over
    ssh as the launcher does): ringcomm and gloo alternated, against a
    plain-socket exchange of the same bytes between the hosts, the practical
    ceiling; the report gives each system's share of it.
``crosshost``
    The same on two network namespaces of this machine joined by a shaped
    veth link (root only): ``--rates 1gbit 10gbit``.
``ceiling``
    Throughput of one ZeroMQ PUSH->PULL stream (16 MiB messages, zero-copy
    send, ipc and tcp loopback) and of a NumPy 64 MiB copy.
``training``
    img/s of a small CNN: one process, DDP (gloo) and
    ``ringcomm_torch.DistributedOptimizer``, with scaling efficiency.
``all``
    Everything above with moderate defaults.

Output: a Markdown report on stdout; JSON with every raw number (and machine
information) and, when matplotlib is importable, a bus-bandwidth plot, under
``bench-results/`` unless ``--json`` / ``--plot`` / ``--out-dir`` say otherwise.

This is a measuring tool, never a pass/fail test: absolute numbers drift
between runs and machines, so only ratios measured in the same run mean much.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark CLI with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    from .__main__ import main as _main

    return _main(argv)
