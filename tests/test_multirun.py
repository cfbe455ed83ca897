"""Hydra multirun sweeps with DDP through the real command line."""

import pytest

from lightning.fabric.connector import _convert_precision_to_unified_args

from src.fast_path import auto_precision
from tests.helpers import QUICK, REPO, hparams, scalars, train

PRECISION = str(_convert_precision_to_unified_args(auto_precision("cpu")))  # what precision=auto uses here


def snapshot(folder):
    return sorted(p.relative_to(folder) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.slow
def test_sweep_over_strategy_and_devices_runs_each_job_in_its_own_folder(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    outputs_before = snapshot(REPO / "outputs")
    result = train("-m", "strategy=ddp,ddp_fp16", "devices=1,2", "model=lenet", *QUICK,
                   f"hydra.sweep.dir={sweep}", timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]

    jobs = {f"lenet_{s}_{d}dev_{PRECISION}": (s, d) for s in ("ddp", "ddp_fp16") for d in (1, 2)}
    folders = {p.name for p in sweep.iterdir() if p.is_dir() and p.name != "report"}
    assert folders == set(jobs)
    for name, (strategy, devices) in jobs.items():
        job = sweep / name
        params = hparams(job)
        assert (params["strategy"], params["world_size"]) == (strategy, devices)
        assert {"train/loss", "val/acc", "test/acc", "time/epoch_s"} <= set(scalars(job))
        # One TensorBoard run per job: event files only in the job folder, from one process.
        assert len({p.parent for p in sweep.rglob("events.out.tfevents.*") if name in str(p.parent)}) == 1
        assert len({p.name.split(".")[4] for p in job.glob("events.out.tfevents.*")}) == 1
        rank_logs = sorted(p.name for p in job.glob("train_rank_*.log"))
        assert rank_logs == [f"train_rank_{r}.log" for r in range(1, devices)]
        assert (job / ".hydra" / "config.yaml").is_file() and (job / "checkpoints" / "last.ckpt").is_file()
    # Workers ran their own job only: no stray sweep or run folders anywhere else.
    assert snapshot(REPO / "outputs") == outputs_before
    assert not (REPO / "lightning_logs").exists()
    assert result.stdout.count("test/acc=") == len(jobs)
    # The sweep writes its report when it ends: one row per job.
    assert (sweep / "report.md").is_file() and len((sweep / "report.csv").read_text().splitlines()) == len(jobs) + 1


@pytest.mark.slow
def test_a_bad_job_fails_alone_and_the_sweep_exits_non_zero(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    result = train("-m", "strategy=auto,ddp", "devices=2", *QUICK, f"hydra.sweep.dir={sweep}", timeout=600)
    assert result.returncode == 2
    assert "error: strategy=auto runs on one device" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 sweep job failed")
    assert {p.name for p in sweep.iterdir() if p.is_dir() and p.name != "report"} == {f"lenet_ddp_2dev_{PRECISION}"}
