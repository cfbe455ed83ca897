"""Checkpoints and resuming: `last.ckpt` is always the last finished epoch, a run killed with
SIGKILL resumes to exactly the weights of an unbroken run, with no TensorBoard step twice."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from tests.helpers import LINEAR_LR, QUICK, REPO, Run, free_port, train, user_env

# Ten batches an epoch, three epochs; the fault callback kills a process after a given step.
LONGER = [*QUICK, "max_epochs=3", "trainer.limit_train_batches=10", "data.batch_size=128", "optim.momentum=0.9"]


def kill_at(step: int, rank: int = 0) -> list[str]:
    return ["+callbacks.fault._target_=tests.faults.KillAtStep", f"+callbacks.fault.step={step}", f"+callbacks.fault.rank={rank}"]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(run: Path, reference: Path) -> None:
    ours, theirs = load(run / "checkpoints" / "last.ckpt")["state_dict"], load(reference / "checkpoints" / "last.ckpt")["state_dict"]
    assert ours.keys() == theirs.keys()
    different = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not different, f"tensors that differ from the unbroken run: {different}"


def steps(run_dir: Path) -> dict[str, list[int]]:
    """Every scalar's steps as TensorBoard shows them (points hidden by a purge step left out)."""
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [event.step for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def assert_same_tensorboard_steps(run: Path, reference: Path) -> None:
    ours, theirs = steps(run), steps(reference)
    for tag, series in ours.items():  # Lightning's own epoch counter is logged with train and val alike
        assert tag == "trainer/epoch" or len(series) == len(set(series)), f"{tag} has a step twice: {series}"
    assert ours == theirs


def assert_matches_unbroken(run: Path, reference: Path) -> None:
    """A broken and resumed run ended exactly where the unbroken one did, and TensorBoard shows it so."""
    assert_same_weights(run, reference)
    assert_same_tensorboard_steps(run, reference)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, data_root):
    """Unbroken reference runs, one per process count, shared by the tests below."""
    runs: dict[str, Path] = {}

    def run(*args: str) -> Path:
        key = " ".join(args)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("unbroken") / "run"
            result = train(*LONGER, *args, f"hydra.run.dir={run_dir}", timeout=600)
            assert result.returncode == 0, result.stderr[-3000:]
            runs[key] = run_dir
        return runs[key]

    return run


def test_last_checkpoint_is_the_last_finished_epoch_even_without_improvement(tmp_path, data_root):
    run_dir = tmp_path / "run"
    # lr 1e-12: val/acc never improves after the first epoch, which used to freeze last.ckpt at epoch 0.
    result = train(*QUICK, "max_epochs=3", "optim.lr=1e-12", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    state = load(run_dir / "checkpoints" / "last.ckpt")
    assert (state["epoch"], state["global_step"]) == (2, 12)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best-epoch0.ckpt", "last.ckpt"]


RESUMES = {
    # name: (process arguments, every_n_train_steps, step killed after)
    "one process, mid-epoch checkpoint": ([], 4, 17),
    "ddp on 2 processes, mid-epoch checkpoint": (["strategy=ddp", "devices=2", "trainer.log_every_n_steps=1"], 4, 17),
    "ddp on 2 processes, epoch-end checkpoint": (["strategy=ddp", "devices=2", "trainer.log_every_n_steps=1"], 0, 17),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMES)
def test_a_run_killed_mid_epoch_resumes_to_the_unbroken_weights(tmp_path, unbroken, case):
    args, every_n, killed_after = RESUMES[case]
    run_dir = tmp_path / "run"
    checkpointing = f"checkpoint.every_n_train_steps={every_n}"
    killed = train(*LONGER, *args, checkpointing, *kill_at(killed_after), f"hydra.run.dir={run_dir}", timeout=600)
    assert killed.returncode != 0
    newest = max((load(p)["global_step"], p.name) for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert newest == ((16, "step.ckpt") if every_n else (10, "last.ckpt"))
    log = (run_dir / "train.log").read_text()
    assert "epoch 1/3 step 10:" in log, "a killed run keeps the log of what it did"

    resumed = train(*LONGER, *args, checkpointing, "ckpt_path=last", f"hydra.run.dir={run_dir}", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_matches_unbroken(run_dir, unbroken(*args))


@pytest.mark.slow
def test_torchrun_restart_resumes_from_the_run_folder(tmp_path, unbroken):
    """One worker SIGKILLed mid-epoch under `--max-restarts=1`: the restarted group resumes itself."""
    run_dir = tmp_path / "run"
    args = ["strategy=ddp", "devices=2", "trainer.log_every_n_steps=1"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m", "src.train", *LONGER, *args, "ckpt_path=auto", "checkpoint.every_n_train_steps=4",
        *kill_at(17, rank=1), f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # torchrun names the failed worker it saw first, which is rank 0 when its peer's death stops it within one poll.
    assert "failed (exitcode:" in result.stderr, "a worker was killed"
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints' / 'step.ckpt'}" in result.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best-epoch2.ckpt", "last.ckpt", "step.ckpt"]
    assert_matches_unbroken(run_dir, unbroken(*args))


@pytest.mark.slow
def test_resume_under_another_world_size_says_so_and_keeps_one_hparams_record(tmp_path, ddp_run: Run):
    run_dir = ddp_run.copy(tmp_path)  # trained on 2 DDP processes
    second = train(*QUICK, *LINEAR_LR, "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    notes = [line for line in second.stdout.splitlines() if "resuming a checkpoint of 2 processes on 1" in line]
    assert len(notes) == 1
    assert load(run_dir / "checkpoints" / "last.ckpt")["epoch"] == 1
    records = [
        value.tag for events in run_dir.glob("events.out.tfevents.*") for event in EventFileLoader(str(events)).Load()
        for value in event.summary.value if value.tag == "_hparams_/session_start_info"
    ]
    assert len(records) == 1


def test_a_new_run_does_not_write_into_a_folder_that_holds_a_run(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").iterdir()}
    again = train(*QUICK, f"hydra.run.dir={run_dir}")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith(f"error: hydra.run.dir={run_dir} already holds")
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").iterdir()} == before


def test_ckpt_path_auto_starts_fresh_in_an_empty_folder(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train(*QUICK, "ckpt_path=auto", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert load(run_dir / "checkpoints" / "last.ckpt")["epoch"] == 0
