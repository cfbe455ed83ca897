"""`hydra/launcher=slurm`: the composed launcher asks SLURM for one task per DDP process, on every node."""

import os

from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning import Trainer
from lightning.fabric.plugins.environments import SLURMEnvironment
from submitit.slurm.slurm import SlurmExecutor

from src.config import CONF_DIR

SLURM_LAUNCHER = "hydra_plugins.project_launchers.slurm.SlurmLauncher"


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=["hydra/launcher=slurm", *overrides], return_hydra_config=True)


@pytest.mark.parametrize(("devices", "num_nodes"), [(1, 1), (4, 1), (4, 2), (8, 3)])
def test_slurm_launcher_tasks_and_gpus_follow_devices_and_nodes(devices, num_nodes):
    cfg = compose_train("strategy=ddp", "accelerator=gpu", f"devices={devices}", f"num_nodes={num_nodes}")
    launcher = cfg.hydra.launcher
    assert launcher._target_ == SLURM_LAUNCHER
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (num_nodes, devices, devices)
    assert launcher.partition is None and launcher.timeout_min > 0


def fake_sinfo(monkeypatch, tmp_path, listing: str | None) -> None:
    """`sinfo` on PATH printing `listing` (partition|GRES lines, `*` marks the default); None: no sinfo at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if listing is not None:
        (bin_dir / "sinfo").write_text(f"#!/bin/sh\nprintf '{listing}'\n")
        (bin_dir / "sinfo").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir) if listing is None else f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize(("accelerator", "partition", "listing", "gpus"), [
    ("cpu", None, "gpu*|gpu:4\\n", None),                   # a CPU run asks for no GPU, even where there are some
    ("gpu", None, "debug*|(null)\\n", 2),                   # an explicit GPU run asks whatever sinfo says
    ("auto", None, "debug*|(null)\\n", None),               # a CPU-only cluster: no GPU request
    ("auto", None, "cpu*|(null)\\ngpu|gpu:a100:4(S:0-1)\\n", None),  # the default partition has none
    ("auto", "gpu", "cpu*|(null)\\ngpu|gpu:a100:4(S:0-1)\\n", 2),
    ("auto", None, None, 2),                                # sinfo cannot tell: ask, as a GPU cluster needs
])
def test_slurm_gpu_request_follows_the_accelerator(monkeypatch, tmp_path, accelerator, partition, listing, gpus):
    fake_sinfo(monkeypatch, tmp_path, listing)
    overrides = ["strategy=ddp", "devices=2", f"accelerator={accelerator}"]
    if partition:
        overrides.append(f"hydra.launcher.partition={partition}")
    launcher = compose_train(*overrides).hydra.launcher
    assert launcher.gpus_per_node == gpus


def test_slurm_is_opt_in():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    assert cfg.hydra.launcher._target_ != SLURM_LAUNCHER


class Submitted(Exception):
    """Stops the launcher where it would call sbatch."""


def test_launcher_writes_an_sbatch_script_with_one_task_per_process(monkeypatch, tmp_path):
    """The real plugin and submitit, stopped just before sbatch: the script asks for what Lightning expects."""
    cfg = compose_train("strategy=ddp", "accelerator=gpu", "devices=4", "num_nodes=2", "hydra.job.name=train",
                        f"hydra.sweep.dir={tmp_path}", "hydra.launcher.partition=gpu")
    captured = {}

    def submit(self, delayed_submissions):
        captured["jobs"] = len(delayed_submissions)
        captured["sbatch"] = self._make_submission_file_text("python -m submitit.core._submit", "uid")
        raise Submitted

    import src.launch.slurm_launcher as slurm

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # pretend srun is on PATH
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")  # and sbatch, for the launcher
    monkeypatch.setattr(SlurmExecutor, "_internal_process_submissions", submit)
    launcher = instantiate(cfg.hydra.launcher)
    composes = SimpleNamespace(config_loader=SimpleNamespace(load_sweep_config=lambda config, overrides: config))
    launcher.setup(hydra_context=composes, task_function=None, config=cfg)
    with pytest.raises(Submitted):
        launcher.launch([["seed=1"], ["seed=2"]], initial_job_idx=0)

    sbatch = captured["sbatch"].splitlines()
    assert captured["jobs"] == 2  # one array task per sweep job
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --job-name=train"):
        assert line in sbatch
    assert any(line.startswith("srun ") for line in sbatch)  # srun starts the 8 tasks that become DDP ranks


def slurm_task_env(monkeypatch, nodes: int, tasks_per_node: int, node: int, local: int) -> None:
    """The variables srun sets for one task of the script above."""
    for name, value in {
        "SLURM_NTASKS": nodes * tasks_per_node, "SLURM_PROCID": node * tasks_per_node + local, "SLURM_LOCALID": local,
        "SLURM_NODEID": node, "SLURM_NNODES": nodes, "SLURM_NTASKS_PER_NODE": tasks_per_node,
        "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": 1234,
    }.items():
        monkeypatch.setenv(name, str(value))


def trainer_for(cfg) -> Trainer:
    return Trainer(accelerator="cpu", devices=cfg.devices, num_nodes=cfg.num_nodes,
                   strategy=instantiate(cfg.strategy, _convert_="all"), logger=False, enable_checkpointing=False)


def test_lightning_takes_ranks_from_the_slurm_task(monkeypatch):
    cfg = compose_train("strategy=ddp", "devices=4", "num_nodes=2")
    launcher = cfg.hydra.launcher
    slurm_task_env(monkeypatch, launcher.nodes, launcher.tasks_per_node, node=1, local=1)
    trainer = trainer_for(cfg)
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    assert (trainer.world_size, trainer.global_rank, trainer.node_rank, trainer.local_rank) == (8, 5, 1, 1)
    assert trainer.strategy.cluster_environment.main_address == "gpu07"


def test_a_sweep_requests_the_resources_of_its_shared_devices_value(monkeypatch):
    """The launcher reads devices once per sweep, so `-m devices=2,4` asks SLURM for devices' default:
    Lightning then refuses the jobs. docs/cluster.md says to sweep devices with one call per value."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        sweep = GlobalHydra.instance().hydra.compose_config(
            "train", ["hydra/launcher=slurm", "strategy=ddp", "devices=2,4"], run_mode=RunMode.MULTIRUN)
    requested = sweep.hydra.launcher.tasks_per_node
    job = compose_train("strategy=ddp", "devices=2")
    assert requested == sweep.devices != job.devices
    slurm_task_env(monkeypatch, 1, requested, node=0, local=0)
    environment = trainer_for(job).strategy.cluster_environment
    with pytest.raises(ValueError, match="ntasks-per-node"):
        environment.validate_settings(num_devices=job.devices, num_nodes=job.num_nodes)  # as fit() does first


def test_the_slurm_launcher_where_there_is_no_slurm_is_one_line(tmp_path, monkeypatch, data_root):
    """`hydra/launcher=slurm` on a machine without SLURM ended in submitit's traceback."""
    import src.launch.slurm_launcher as slurm
    from tests.helpers import QUICK, command_here

    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    result = command_here("src.train", "-m", "hydra/launcher=slurm", *QUICK, "seed=1",
                          f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=slurm needs a SLURM cluster, and this machine has no sbatch or srun on its PATH; "
        "submit from a SLURM login node, or choose hydra/launcher=sequential or parallel")
