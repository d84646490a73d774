"""examples/ddp_digits.py, a plain DDP script whose only ringcomm word is the backend name, trains
under torchrun and under ringcomm-run, and with FSDP2 (``--fsdp``) instead of DDP."""

from __future__ import annotations

import sys

import pytest

from test_ddp_backend import ROOT, run

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.multiprocess
EXAMPLE = str(ROOT / "examples" / "ddp_digits.py")


def final_accuracy(out: str) -> float:
    last = [line for line in out.splitlines() if "test accuracy" in line][-1]
    return float(last.split("test accuracy")[1].split("%")[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher,wrap", [("torchrun", "ddp"), ("ringcomm-run", "ddp"), ("torchrun", "fsdp")])
def test_ddp_digits_trains(launcher, wrap):
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", EXAMPLE]
    else:
        cmd = [sys.executable, "-m", "ringcomm.launch.launcher", "-np", "2", sys.executable, EXAMPLE]
    out = run([*cmd, "--epochs", "6", *(["--fsdp"] if wrap == "fsdp" else [])], 110)
    assert "backend ringcomm" + (", FSDP2" if wrap == "fsdp" else "") in out, out[-3000:]
    assert final_accuracy(out) > 85.0, out[-3000:]
