import pytest
"""Every run gets a folder of its own, also when two start in the same second."""

from omegaconf import OmegaConf

from src.launch import naming
from tests.helpers import start_cli, QUICK, scalars, user_env


def test_claiming_a_taken_folder_name_gives_the_next_free_one(tmp_path, monkeypatch):
    monkeypatch.setattr(naming, "_claimed", {})
    base = str(tmp_path / "runs" / "2026-01-01_00-00-00_lenet_auto_1dev_32")
    first = naming.claim_dir(base)
    assert naming.claim_dir(base) == first, "one process asking twice keeps its folder"
    monkeypatch.setattr(naming, "_claimed", {})  # as another process would
    second = naming.claim_dir(base)
    assert (first, second) == (base, f"{base}-2")
    assert (tmp_path / "runs").is_dir() and sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "2026-01-01_00-00-00_lenet_auto_1dev_32", "2026-01-01_00-00-00_lenet_auto_1dev_32-2"]


def test_torchrun_ranks_share_the_folder_named_after_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setattr(naming, "_claimed", {})
    for name, value in {"RANK": "1", "GROUP_RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)  # as torchrun sets them
    base = str(tmp_path / "torchrun-job7_lenet_ddp_2dev_32")
    assert naming.claim_dir(base) == base and not (tmp_path / "torchrun-job7_lenet_ddp_2dev_32").exists()


@pytest.mark.slow
def test_two_runs_started_at_once_write_two_folders(tmp_path, data_root):
    runs = [start_cli("src.train", *QUICK, cwd=tmp_path, env=user_env()) for _ in range(2)]
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    folders = sorted((tmp_path / "outputs" / "runs").iterdir())
    assert len(folders) == 2
    for folder in folders:
        assert OmegaConf.load(folder / "config.yaml").output_dir == str(folder)
        assert len(scalars(folder)["test/acc"]) == 1, "one run's results per folder"
        assert {p.name for p in (folder / "checkpoints").iterdir()} >= {"last.ckpt"}


def test_a_sweep_job_claims_no_run_folder_but_a_sweep_claims_its_own(tmp_path, monkeypatch):
    """In a sweep, Lightning reads hydra.run.dir to start DDP children; that must not create a folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    monkeypatch.setattr(naming, "_claimed", {})
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: type("C", (), {"mode": RunMode.MULTIRUN})()))
    run, sweep = str(tmp_path / "runs" / "r"), str(tmp_path / "multirun" / "s")
    assert naming.claim_dir(run) == run and not (tmp_path / "runs").exists()
    assert naming.claim_dir(sweep, "sweep") == sweep and (tmp_path / "multirun" / "s").is_dir()
    monkeypatch.setattr(naming, "_claimed", {})
    assert naming.claim_dir(sweep, "sweep") == f"{sweep}-2"
