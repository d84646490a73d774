"""The tutorials' DDP scripts, CPU adaptations with only the backend name changed to "ringcomm".

Started the ways those tutorials start them: ``python -m torch.distributed.launch`` (the script
reads ``--local_rank``), torchrun, ``ringcomm-run`` and ``torch.multiprocessing.spawn`` with a
``tcp://`` URL.  Every rank ends with the same parameters, and the same as DDP on gloo.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPT = ROOT / "tests" / "workers" / "ddp_seed_launch_script.py"
SPAWN_SCRIPT = ROOT / "tests" / "workers" / "ddp_seed_spawn_script.py"

pytestmark = pytest.mark.multiprocess


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("RINGCOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(cmd: list[str], np_: int, reference: bool = False) -> list[dict]:
    """Each rank's record, in rank order.  ``reference``: a gloo job run only for its numbers; gloo at
    times aborts in its teardown after the ranks printed them ("terminate called without an active
    exception"), which is no failure of the job under test."""
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    got = sorted(_records(proc.stdout), key=lambda d: d["rank"])
    if not (reference and len(got) == np_):
        assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-6000:]}"
    assert [d["rank"] for d in got] == list(range(np_)) and all(d["size"] == np_ for d in got), out[-3000:]
    return got


def _records(text: str) -> list[dict]:
    """Every JSON object printed (ranks share one stdout, so two may stand on one line)."""
    decoder, out, i = json.JSONDecoder(), [], text.find('{"rank"')
    while i >= 0:
        obj, end = decoder.raw_decode(text, i)
        out.append(obj)
        i = text.find('{"rank"', end)
    return out


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


@pytest.mark.timeout(400)
def test_launch_style_script_under_torch_launch_torchrun_and_ringcomm_run() -> None:
    py = sys.executable
    launch = _ranks([py, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={_port()}",
                     str(LAUNCH_SCRIPT)], 2)
    assert [d["local_rank"] for d in launch] == [0, 1]  # the script's --local_rank argument
    run = _ranks([py, "-m", "ringcomm.launch.launcher", "-np", "2", py, str(LAUNCH_SCRIPT)], 2)
    gloo = _ranks([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
                   str(LAUNCH_SCRIPT), "--backend", "gloo"], 2, reference=True)
    reference = gloo[0]["digest"]
    for job in (launch, run, gloo):
        assert all(_same(d["digest"], reference) for d in job), (job, reference)
    assert launch[0]["losses"][-1] < launch[0]["losses"][0]  # it trains


@pytest.mark.timeout(300)
def test_spawn_style_script_with_a_tcp_url() -> None:
    py = sys.executable
    ring = _ranks([py, str(SPAWN_SCRIPT), "--dist-url", f"tcp://127.0.0.1:{_port()}", "--nprocs", "3"], 3)
    gloo = _ranks([py, str(SPAWN_SCRIPT), "--dist-url", f"tcp://127.0.0.1:{_port()}", "--nprocs", "3",
                   "--dist-backend", "gloo"], 3, reference=True)
    assert all(_same(d["digest"], gloo[0]["digest"]) for d in ring + gloo), (ring, gloo)
