"""PyTorch Lightning on the "ringcomm" backend, with the real package: DDPStrategy(process_group_backend="ringcomm").

Every job (tests/workers/lightning_job.py) trains the same net from one seed and checks
``self.log(..., sync_dist=True)``, ``all_gather``, a checkpoint saved, restored in
``trainer.test`` and resumed in ``fit``; here its parameters are compared with a gloo job's,
under ringcomm-run, torchrun and Lightning's own start of the ranks (``devices=N``, no launcher).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _frameworks import (
    KILL_BOUND_S,
    LIGHTNING_JOB,
    killed_job,
    max_difference,
    need_module,
    params,
    plain,
    ringcomm_run,
    run_job,
    torchrun,
)

need_module("lightning")

pytestmark = [pytest.mark.multiprocess, pytest.mark.realtools]


def job_args(out: Path, devices: int, *extra: str) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    return ["--devices", str(devices), "--out", str(out), *extra]


def check_features(recs: list[dict], size: int, backend: str) -> None:
    for r in recs:
        assert r["backend"] == backend, r
        assert r["gathered"] == list(range(size)), r  # all_gather
        assert r["rank_mean"] == pytest.approx((size - 1) / 2), r  # self.log(..., sync_dist=True)
        assert r["restored"] == r["digest"], r  # the checkpoint restores the trained parameters in trainer.test
        assert r["resumed_epoch"] == 3, r  # and fit resumes after its 2 epochs


@pytest.fixture(scope="module")
def gloo_np2(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    tmp = tmp_path_factory.mktemp("lightning-gloo")
    recs = run_job(torchrun(2, LIGHTNING_JOB, *job_args(tmp, 2, "--backend", "gloo")), 2, tmp, reference=True)
    check_features(recs, 2, "gloo")
    return recs, params(tmp)


@pytest.mark.timeout(240)
def test_ringcomm_run_np2_trains_bitwise_like_gloo(gloo_np2: tuple[list[dict], dict], tmp_path: Path) -> None:
    recs = run_job(ringcomm_run(2, LIGHTNING_JOB, *job_args(tmp_path, 2)), 2, tmp_path)
    check_features(recs, 2, "ringcomm")
    gloo_recs, gloo_params = gloo_np2
    assert recs[0]["digest"] == gloo_recs[0]["digest"], (recs[0], gloo_recs[0])
    assert max_difference(params(tmp_path), gloo_params) == 0.0
    assert recs[0]["test_loss"] == gloo_recs[0]["test_loss"]


@pytest.mark.timeout(240)
def test_lightnings_own_launch_np2_with_the_registered_strategy_name(gloo_np2: tuple[list[dict], dict],
                                                                     tmp_path: Path) -> None:
    """devices=2 and no launcher: Lightning runs the script again for rank 1; strategy="ddp_ringcomm"."""
    recs = run_job(plain(LIGHTNING_JOB, *job_args(tmp_path, 2, "--strategy", "ddp_ringcomm")), 2, tmp_path)
    check_features(recs, 2, "ringcomm")
    assert recs[0]["digest"] == gloo_np2[0][0]["digest"]


@pytest.mark.timeout(240)
def test_torchrun_np3_matches_gloo(tmp_path: Path) -> None:
    mine, gloo = tmp_path / "ringcomm", tmp_path / "gloo"
    recs = run_job(torchrun(3, LIGHTNING_JOB, *job_args(mine, 3)), 3, tmp_path)
    check_features(recs, 3, "ringcomm")
    gloo_recs = run_job(plain(LIGHTNING_JOB, *job_args(gloo, 3, "--backend", "gloo")), 3, tmp_path, reference=True)
    # three ranks' gradients are summed in another order than gloo's ring: equal to rounding, not bit for bit
    assert max_difference(params(mine), params(gloo)) <= 1e-6
    assert recs[0]["test_loss"] == pytest.approx(gloo_recs[0]["test_loss"], rel=1e-5)


@pytest.mark.timeout(150)
def test_a_rank_killed_mid_epoch_ends_the_job_naming_it(tmp_path: Path) -> None:
    """Lightning's own start of the ranks (no launcher to stop the others): the survivors raise, naming rank 1."""
    code, text, after = killed_job(plain(LIGHTNING_JOB, *job_args(tmp_path, 3, "--die-rank", "1")), tmp_path)
    assert code != 0, text[-6000:]
    for survivor in (0, 2):
        assert f"PeerLostError: rank {survivor}: lost rank 1" in text, text[-6000:]
    assert after < KILL_BOUND_S, f"the job ended {after:.1f} s after rank 1 died:\n{text[-6000:]}"
    print(f"the job ended {after:.2f} s after rank 1 killed itself")


def test_the_strategy_name_is_registered_as_ddp_on_ringcomm() -> None:
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    import ringcomm_torch.lightning as rl

    assert rl.register() == [m for m in ("lightning.pytorch.strategies", "pytorch_lightning.strategies",
                                         "lightning.fabric.strategies") if _importable(m)]
    for name, start_method in rl.STRATEGIES.items():
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, DDPStrategy)
        assert strategy.process_group_backend == "ringcomm" and strategy._start_method == start_method


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False
