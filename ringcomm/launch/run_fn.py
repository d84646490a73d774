"""``ringcomm.run``: run a Python function on N ranks and get each rank's return value (Horovod's ``horovod.run``).

    import ringcomm as horovod

    def train(lr):
        import ringcomm_torch as hvd
        hvd.init()
        return hvd.rank() * lr

    if __name__ == "__main__":
        print(horovod.run(train, args=(0.1,), np=2))     # [0.0, 0.1]

The ranks are started as ``ringcomm-run`` starts them (:func:`ringcomm.launch.launcher.run_job`), each
running :mod:`ringcomm.launch._run_task`.  The function and its arguments travel pickled through the
job's rendezvous store, and each rank's return value comes back the same way, so ranks on other
hosts (``hosts=``) work too.

Pickling is by reference (the standard :mod:`pickle`; ``cloudpickle`` when it is installed): the
function must be importable by the workers, i.e. defined at the top level of a module, or of the
script being run (that script is then imported by each worker under the name ``__mp_main__``, as
:mod:`multiprocessing` does, so its top-level code must sit under ``if __name__ == "__main__":``).
Lambdas, nested functions and functions typed into an interactive session need ``cloudpickle``;
without it they are refused with an error that says so.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import InvalidInputError, RingcommError

__all__ = ["run", "RunFunctionError"]

#: Rendezvous-store keys: the pickled function, and each rank's result or error.
PAYLOAD_KEY = "run_fn/payload"
RESULT_KEY = "run_fn/result/{rank}"
ERROR_KEY = "run_fn/error/{rank}"
#: Set in the workers' environment: a ``run()`` inside a worker is an unguarded script re-running itself.
WORKER_VAR = "RUN_BY_RINGCOMM_RUN"  # not RINGCOMM_*: those are settings, checked by init()


class RunFunctionError(RingcommError, RuntimeError):
    """The function of :func:`run` raised, or its process exited non-zero, on some rank."""


def _dumps(obj: object) -> tuple[bytes, bool]:
    """``obj`` pickled, and whether by ``cloudpickle`` (which sends ``__main__``'s functions by value)."""
    try:
        import cloudpickle  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), False
    return bytes(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), True


def _main_reference() -> dict[str, str]:
    """How a worker imports this process's ``__main__``: a script path, a module name, or nothing (interactive)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return {"module": spec.name}  # python -m pkg.mod
    path = getattr(main, "__file__", None)
    if path:
        return {"path": os.path.abspath(path)}
    return {}


def payload(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """The pickled job a rank runs; raises :class:`InvalidInputError` when ``func`` cannot be pickled by reference."""
    name = getattr(func, "__qualname__", repr(func))
    try:
        blob, by_value = _dumps((func, tuple(args), dict(kwargs)))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidInputError(
            f"ringcomm.run: cannot send {name} and its arguments to the ranks: {exc}. Functions travel by "
            "reference (pickle): define it at the top level of a module or of the script, not as a lambda or "
            "inside another function (or pip install cloudpickle, which ringcomm.run uses when installed)"
        ) from None
    needs_main = not by_value and b"__main__" in blob
    main = _main_reference() if needs_main else {}
    if needs_main and not main:
        raise InvalidInputError(
            f"ringcomm.run: {name} is defined in an interactive session (a REPL, python -c, a notebook), which "
            "the ranks cannot import: put it in a module or a script file (or pip install cloudpickle)")
    return pickle.dumps({"blob": blob, "main": main, "sys_path": list(sys.path)})


def _launcher_argv(
    num_proc: int, hosts: str | None, hostfile: str | None, start_timeout: float | None, ssh_port: int | None,
    ssh_identity_file: str | None, disable_cache: bool | None, output_filename: str | None, verbose: bool | None,
    use_gloo: bool | None, use_mpi: bool | None, mpi_args: str | None, network_interface: str | None,
    executable: str | None,
) -> list[str]:
    argv = ["-np", str(num_proc)]
    for flag, value in (("-H", hosts), ("--hostfile", hostfile), ("--start-timeout", start_timeout),
                        ("--ssh-port", ssh_port), ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename), ("--mpi-args", mpi_args),
                        ("--network-interfaces", network_interface)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, on in (("--disable-cache", disable_cache), ("--verbose", verbose), ("--gloo", use_gloo),
                     ("--mpi", use_mpi)):
        if on:
            argv.append(flag)
    return [*argv, "--", executable or sys.executable, "-m", "ringcomm.launch._run_task"]


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[float, float] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` ranks; returns their return values in rank order.

    The arguments are Horovod's ``horovod.run``'s (``np``, ``min_np`` and ``max_np`` are its
    deprecated spellings, warned about as it does).  ``hosts``/``hostfile``/``ssh_*``/
    ``network_interface``/``output_filename``/``start_timeout`` mean what the ``ringcomm-run`` flags
    of those names mean; ``use_gloo``/``use_mpi`` are accepted (ringcomm has one controller).
    The elastic arguments (``min_num_proc``, ``max_num_proc``, ``slots``, ``reset_limit``,
    ``cooldown_range``) are refused: run an elastic job with ``ringcomm-run --host-discovery-script``.

    Raises :class:`RunFunctionError` naming the first failing rank (with its exception and
    traceback) when the function raises or a rank's process fails, and
    :class:`~ringcomm.errors.InvalidInputError` for arguments that cannot work.
    """
    if np is not None:
        if num_proc == 1:
            num_proc = np
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
    if min_np is not None:
        min_num_proc = min_num_proc if min_num_proc is not None else min_np
        warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2)
    if max_np is not None:
        max_num_proc = max_num_proc if max_num_proc is not None else max_np
        warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2)
    if os.environ.get(WORKER_VAR):
        raise InvalidInputError(
            "ringcomm.run was called inside one of its own ranks: the script that calls it is imported by "
            "every rank, so put the call under if __name__ == '__main__':")
    if hosts is not None and hostfile is not None:
        raise InvalidInputError("ringcomm.run: give hosts or hostfile, not both")
    if use_gloo and use_mpi:
        raise InvalidInputError("ringcomm.run: use_gloo and use_mpi exclude each other")
    elastic = {k: v for k, v in (("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc), ("slots", slots),
                                 ("reset_limit", reset_limit), ("cooldown_range", cooldown_range)) if v is not None}
    if elastic:
        raise InvalidInputError(
            f"ringcomm.run: {', '.join(elastic)} ask for an elastic job, which ringcomm.run does not start; run "
            "an elastic script with ringcomm-run --host-discovery-script SCRIPT --min-np N python train.py")
    if not callable(func):
        raise InvalidInputError(f"ringcomm.run: func must be callable, got {type(func).__name__}")
    job = payload(func, args, kwargs or {})
    argv = _launcher_argv(num_proc, hosts, hostfile, start_timeout, ssh_port, ssh_identity_file, disable_cache,
                          output_filename, verbose, use_gloo, use_mpi, mpi_args, network_interface, executable)
    from . import args as launch_args, launcher

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = launch_args.parse_args(argv)
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise InvalidInputError(f"ringcomm.run: {message[-1] if message else 'invalid arguments'}") from None
    parsed.settings_env = {**parsed.settings_env, WORKER_VAR: "1"}
    collected = _Collector(parsed.num_proc, job)
    status = launcher.run_job(parsed, hooks=collected)
    return collected.outcome(status)


class _Collector:
    """The job's hooks: put the payload into the rendezvous store, read every rank's outcome back out."""

    def __init__(self, size: int, job: bytes) -> None:
        self.size = size
        self.job = job
        self.results: dict[int, bytes] = {}
        self.errors: dict[int, str] = {}

    def started(self, address: str, secret: bytes) -> None:
        from ..net.rendezvous import kv_set

        kv_set(address, secret, PAYLOAD_KEY, self.job, timeout=30.0)

    def finished(self, address: str, secret: bytes) -> None:
        from ..errors import RendezvousError
        from ..net.rendezvous import kv_get

        for rank in range(self.size):
            for key, into in ((RESULT_KEY, self.results), (ERROR_KEY, self.errors)):
                try:
                    value = kv_get(address, secret, key.format(rank=rank), timeout=0.05)
                except RendezvousError:
                    continue
                into[rank] = value if into is self.results else value.decode("utf-8", "replace")  # type: ignore[assignment]
                break

    def outcome(self, status: int) -> list[Any]:
        """The ranks' return values in rank order, or :class:`RunFunctionError` for the first failure."""
        if self.errors:
            rank = min(self.errors)
            text = self.errors[rank].rstrip()
            raise RunFunctionError(f"ringcomm.run: rank {rank} raised {text.splitlines()[-1] if text else '?'}"
                                   f"\n{text}")
        missing = [r for r in range(self.size) if r not in self.results]
        if status != 0 or missing:
            raise RunFunctionError(
                f"ringcomm.run: the job failed (launcher status {status}); ranks without a result: "
                f"{missing or 'none'} (see their output above)")
        # a rank imports the caller's script as __mp_main__: its classes come back under that name
        sys.modules.setdefault("__mp_main__", sys.modules["__main__"])
        return [pickle.loads(self.results[r]) for r in range(self.size)]
