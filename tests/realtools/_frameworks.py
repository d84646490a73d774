"""Shared helpers of the framework tests (Lightning, Accelerate): launch a job each way, read its results."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from _tools import HERE, PYTHON, env, free_port, module_missing, results, run

LIGHTNING_JOB = str(HERE.parent / "workers" / "lightning_job.py")
ACCELERATE_JOB = str(HERE.parent / "workers" / "accelerate_job.py")

#: Seconds a killed rank may take to end the whole job, counted from the line the rank prints before it dies.
KILL_BOUND_S = 10.0


def need_module(module: str) -> None:
    """Skip the calling test module, naming the package and the extra, where ``module`` is not installed."""
    why = module_missing(module, "frameworks")
    if why is not None:
        pytest.skip(why, allow_module_level=True)


def job_env(tmp: Path) -> dict[str, str]:
    # one thread per rank on a 2-core machine; Accelerate reads no user configuration from the home folder
    return env(OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf"), PYTHONUNBUFFERED="1")


def ringcomm_run(np_: int, script: str, *args: str) -> list[str]:
    return [PYTHON, "-m", "ringcomm.launch.launcher", "-np", str(np_), PYTHON, script, *args]


def torchrun(np_: int, script: str, *args: str) -> list[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_), script, *args]


def accelerate_launch(np_: int, script: str, *args: str) -> list[str]:
    # --multi_gpu is Accelerate's name for "several processes through torchrun"; the job asks for the CPU itself
    return [PYTHON, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(np_), "--num_machines",
            "1", "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no",
            script, *args]


def plain(script: str, *args: str) -> list[str]:
    """No launcher: the framework starts the other ranks itself."""
    return [PYTHON, script, *args]


#: What gloo prints when its threads abort the interpreter's exit (a process group, or the DDP reducer
#: holding one, torn down in the wrong order): after the ranks printed their records, at times.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_job(cmd: list[str], size: int, tmp: Path, timeout: float = 100, reference: bool = False) -> list[dict]:
    """Run a job that must succeed; its ranks' RESULT records, one per rank, in rank order.

    ``reference``: a gloo job run only for its numbers, where gloo's abort at exit
    (:data:`GLOO_TEARDOWN_ABORT`) after every rank printed its record is no failure of the job under test.
    """
    proc = run(cmd, timeout=timeout, env=job_env(tmp), cwd=tmp)
    both = f"{' '.join(cmd)}\nexit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    recs = results(proc.stdout)
    aborted_after = reference and GLOO_TEARDOWN_ABORT in proc.stderr and len(recs) == size
    assert proc.returncode == 0 or aborted_after, both
    assert [r["rank"] for r in recs] == list(range(size)), both
    assert all(r["size"] == size for r in recs), both
    assert len({r["digest"] for r in recs}) == 1, f"the ranks' parameters differ:\n{both}"
    return recs


def params(out: Path) -> dict:
    import torch

    return torch.load(out / "params.pt", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def killed_job(cmd: list[str], tmp: Path, timeout: float = 100) -> tuple[int, str, float]:
    """Run a job one of whose ranks kills itself: its exit status, its output (stdout and stderr merged)
    and the seconds from the dying rank's last line ("... kills itself ...") to the end of the job."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env(tmp),
                            cwd=tmp, start_new_session=True)
    lines: list[str] = []
    died_at: list[float] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "kills itself with SIGKILL" in line and not died_at:
                died_at.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the job did not end within {timeout} s of its start:\n{''.join(lines)[-6000:]}") from None
    ended = time.monotonic()
    reader.join(timeout=10)
    text = "".join(lines)
    assert died_at, f"no rank killed itself:\n{text[-6000:]}"
    return code, text, ended - died_at[0]
