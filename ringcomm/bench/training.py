"""Training-step benchmark: img/s of one process, DDP (gloo) and ringcomm_torch's DistributedOptimizer.

The small CNN of :mod:`._train_worker` (32x32x3 synthetic images, batch 32 per
rank, one thread per rank).  Each round runs one job per setup in turn
(single, DDP, ringcomm[, Horovod], and two bounds) so drift hits them alike;
the summary takes the median img/s over rounds and the scaling efficiency
``img/s at np / (np * img/s of one process)``.

The bounds: ``independent`` is np single processes started together with no
communication at all (their img/s summed): what the machine allows.
``lockstep`` keeps the ranks in step with one 1-element allreduce per step
but exchanges no gradients: what synchronization alone costs, since a slower
step on either rank holds both up.  ringcomm/lockstep near 1 means moving the
gradients costs little beyond keeping in step.

``device="cuda"`` (``--device cuda``) trains resnet18 on 3x64x64 images on the GPU (all ranks
share it) and compares ringcomm_torch with DDP on gloo and DDP on the ``"ringcomm"`` backend,
the independent processes as the bound; the summary gives each setup's spread over rounds
(slowest and fastest round / median).  ``model="exchange"`` (``--model exchange``) runs the same
comparison on the CPU with resnet18's gradients and next to no compute: what a step costs when
the exchange is all it waits for, as on a GPU.  FSDP2 on either backend runs on any device where
``--setups`` names it (``fsdp``, ``fsdp_ringcomm``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from . import _launch, _procs, _timing, _util

MODULE = "ringcomm.bench._train_worker"
#: Rows of the report, in order: (setup key, system that runs it).
SETUPS = (("ddp", "gloo"), ("ringcomm", "ringcomm"), ("horovod", "horovod"), ("lockstep", "ringcomm"),
          ("independent", "independent"))
#: The setups of a GPU run.
CUDA_SETUPS = (("ddp", "gloo"), ("ddp_ringcomm", "gloo"), ("ringcomm", "ringcomm"), ("independent", "independent"))
#: Setups that run only when ``--setups`` names them, on any device.
OPT_IN = (("fsdp", "gloo"), ("fsdp_ringcomm", "gloo"))
LABELS = {"single": "one process", "ddp": "DDP (gloo)", "ddp_ringcomm": "DDP (\"ringcomm\" backend)",
          "fsdp": "FSDP2 (gloo)", "fsdp_ringcomm": "FSDP2 (\"ringcomm\" backend)",
          "ringcomm": "ringcomm_torch DistributedOptimizer",
          "horovod": "Horovod DistributedOptimizer",
          "lockstep": "bound: in lockstep, no gradients exchanged (ringcomm)",
          "independent": "bound: independent processes, no communication"}
#: What each ``--model`` trains.
MODELS = {"small": "SmallCNN: conv3x3(3->32)+pool, conv3x3(32->64)+pool, fc(4096->128), fc(128->10); SGD momentum",
          "resnet18": "resnet18 on 3x64x64 images; SGD momentum",
          "exchange": "exchange only: resnet18's 62 parameters (47 MB of gradients), next to no compute; the exchange is the "
                      "step, as on a GPU; SGD momentum"}
#: Ratios of img/s within a round that the report shows: (numerator, denominator).
RATIOS = (("ringcomm", "ddp"), ("lockstep", "ddp"), ("independent", "ddp"), ("ringcomm", "lockstep"),
          ("ddp_ringcomm", "ddp"), ("fsdp_ringcomm", "fsdp"))


@dataclasses.dataclass
class TrainingConfig:
    """World sizes, steps and rounds."""

    nps: Sequence[int] = (2,)
    batch: int = 32
    steps: int = 30
    warmup: int = 5
    repeats: int = 3
    job_timeout: float = 300.0
    device: str = "cpu"
    model: str = ""  # "small", "resnet18" or "exchange"; empty: small on the CPU, resnet18 on the GPU
    setups: Sequence[str] = ()  # only these setups (keys of LABELS); empty: every one the device runs

    @property
    def model_name(self) -> str:
        return self.model or ("resnet18" if self.device == "cuda" else "small")


def ringcomm_torch_status() -> str | None:
    """``None`` if ``ringcomm_torch.DistributedOptimizer`` imports, else why the row is skipped."""
    code = "import ringcomm_torch; ringcomm_torch.DistributedOptimizer"
    try:
        probe = subprocess.run([*_launch.python(), "-c", code], capture_output=True, text=True, timeout=120,
                               env=_util.worker_env(True))
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot check for ringcomm_torch: {exc}"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"ringcomm_torch.DistributedOptimizer unavailable ({last})"
    return None


def _job(setup: str, system: str, np_: int, cfg: TrainingConfig, out: str) -> _procs.JobResult:
    def args(mode: str, out_path: str) -> list[str]:
        return ["--mode", mode, "--batch", str(cfg.batch), "--steps", str(cfg.steps), "--warmup", str(cfg.warmup),
                "--out", out_path, "--deadline", str(_timing.worker_deadline(cfg.job_timeout)),
                "--device", cfg.device, "--model", cfg.model_name]

    def worker(mode: str, out_path: str) -> list[str]:
        return [*_launch.python(), "-m", MODULE, *args(mode, out_path)]

    if setup == "single":
        return _procs.run_job([worker("single", out)], _util.worker_env(False), cfg.job_timeout)
    if setup == "independent":  # np single processes at once, each with its own result file
        commands = [worker("single", f"{out}.{r}") for r in range(np_)]
        return _procs.run_job(commands, _util.worker_env(False), cfg.job_timeout)
    return _launch.run_system(system, np_, MODULE, args(setup, out), cfg.job_timeout)


def _independent_result(out: str, np_: int) -> dict[str, Any]:
    """The processes' results as one job's: images summed, the slowest process's seconds."""
    parts = []
    for r in range(np_):
        with open(f"{out}.{r}", encoding="utf-8") as f:
            parts.append(json.load(f))
    images = sum(p["images"] for p in parts)
    return {"mode": "independent", "np": np_, "images": images, "seconds": max(p["seconds"] for p in parts),
            "rank_seconds": [p["seconds"] for p in parts], "img_per_s": sum(p["img_per_s"] for p in parts)}


def _record(setup: str, np_: int, repeat: int, job: _procs.JobResult, out: str) -> dict[str, Any]:
    record: dict[str, Any] = {"setup": setup, "np": np_, "repeat": repeat, "ok": job.ok,
                              "wall_s": round(job.wall_s, 3), "error": None}
    if job.ok:
        try:
            if setup == "independent":
                record.update(_independent_result(out, np_))
            else:
                with open(out, encoding="utf-8") as f:
                    record.update(json.load(f))
        except (OSError, ValueError, KeyError) as exc:
            record.update(ok=False, error=f"no result from rank 0: {exc}")
    else:
        record["error"] = job.describe()
    return record


def run(cfg: TrainingConfig) -> dict[str, Any]:
    """Measure every setup; returns the JSON-ready section (config, raw runs, summary, notes)."""
    notes: list[str] = []
    setups = [(s, sys_) for s, sys_ in (CUDA_SETUPS if cfg.device == "cuda" or cfg.model_name == "exchange"
                                        else SETUPS) if not cfg.setups or s in cfg.setups]
    setups += [x for x in OPT_IN if x[0] in cfg.setups]
    why_rc = ringcomm_torch_status()
    if why_rc is not None:
        setups = [x for x in setups if x[0] != "ringcomm"]
        notes.append(f"ringcomm_torch row skipped: {why_rc}")
    why_hvd = _launch.horovod_status()
    if why_hvd is not None:
        setups = [x for x in setups if x[0] != "horovod"]
        notes.append(f"Horovod row skipped: {why_hvd}")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ringcomm-bench-") as tmp:
        for repeat in range(cfg.repeats):
            # odd rounds run the distributed setups in reverse order, so neither always goes first
            order = setups if repeat % 2 == 0 else setups[::-1]
            jobs = [("single", "single", 1)] + [(s, sys_, np_) for np_ in cfg.nps for s, sys_ in order]
            if cfg.device == "cuda" or cfg.model_name == "exchange":  # the independent processes are the bound
                jobs = jobs[1:]
            for setup, system, np_ in jobs:
                _util.log(f"training {LABELS[setup]} np={np_} (round {repeat + 1}/{cfg.repeats}) ...")
                out = os.path.join(tmp, f"{setup}-np{np_}-r{repeat}.json")
                record = _record(setup, np_, repeat, _job(setup, system, np_, cfg, out), out)
                if record["ok"]:
                    _util.log(f"  {record['img_per_s']:.0f} img/s")
                else:
                    _util.log(f"  FAILED: {record['error']}")
                runs.append(record)
    return {
        "model": MODELS[cfg.model_name],
        "device": cfg.device,
        "batch_per_rank": cfg.batch,
        "steps": cfg.steps,
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "nps": list(cfg.nps),
        "notes": notes,
        "runs": runs,
        "summary": summarize(runs),
        "ratios": round_ratios(runs),
        "bound_ratios": [x for num, den in RATIOS[1:] for x in round_ratios(runs, num, den)],
    }


def round_ratios(runs: Sequence[dict[str, Any]], num: str = "ringcomm", den: str = "ddp") -> list[dict[str, Any]]:
    """``num``/``den`` img/s within each round (the jobs ran back to back), and their median, per np.

    >>> round_ratios([{"setup": "ddp", "np": 2, "repeat": 0, "ok": True, "img_per_s": 100.0},
    ...               {"setup": "ringcomm", "np": 2, "repeat": 0, "ok": True, "img_per_s": 110.0}])
    [{'np': 2, 'per_round': [1.1], 'median': 1.1, 'of': 'ringcomm/ddp'}]
    """
    out = []
    for np_ in sorted({r["np"] for r in runs if r["setup"] == num}):
        per_round = []
        for repeat in sorted({r["repeat"] for r in runs}):
            pair = {r["setup"]: r for r in runs if r["np"] == np_ and r["repeat"] == repeat and r["ok"]}
            if den in pair and num in pair:
                per_round.append(round(pair[num]["img_per_s"] / pair[den]["img_per_s"], 4))
        if per_round:
            out.append({"np": np_, "per_round": per_round, "median": _util.median(per_round), "of": f"{num}/{den}"})
    return out


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median img/s per (setup, np) and scaling efficiency against one process."""
    keys: list[tuple[str, int]] = []
    for r in runs:
        if (r["setup"], r["np"]) not in keys:
            keys.append((r["setup"], r["np"]))
    rates = {k: [r["img_per_s"] for r in runs if (r["setup"], r["np"]) == k and r["ok"]] for k in keys}
    single = _util.median(rates.get(("single", 1), [])) if rates.get(("single", 1)) else None
    rows = []
    for setup, np_ in keys:
        vals = rates[(setup, np_)]
        med = _util.median(vals) if vals else None
        rows.append({
            "setup": setup, "label": LABELS[setup], "np": np_,
            "img_per_s": med, "runs_img_per_s": vals,
            "spread": [round(min(vals) / med, 3), round(max(vals) / med, 3)] if med else None,
            "efficiency": med / (np_ * single) if med and single else None,
        })
    return rows
