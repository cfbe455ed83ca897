"""A resume ends as the unbroken run would, wherever the stop came: its result line, checkpoints (the best one too)
and TensorBoard scalars and steps are the unbroken run's. Each run below is SIGKILLed at one point of its life by a
fault callback (tests/faults.py: the stop waits on the run reaching that point, never on the clock), then resumed.
Only the run that is killed needs a process of its own; the unbroken run, the run a stop signal ends and the resumes
run in this one."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import QUICK, run_cli, scalars, steps_going_back, train_here, user_env
from tests.test_resume import assert_same_tensorboard_steps

# Three epochs of ten steps; a step checkpoint every 5 steps, so one falls on each epoch's last step.
RUN = [*QUICK, "max_epochs=3", "trainer.limit_train_batches=10", "trainer.limit_val_batches=4", "data.batch_size=64",
       "optim.momentum=0.9", "checkpoint.every_n_train_steps=5"]
STOPS = {
    "during training steps": ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=13"],
    "between a step checkpoint and the epoch's validation": ["on_validation_start", 1],
    "during validation": ["on_validation_batch_end", 1],
    "while the epoch's checkpoints are written": ["on_train_epoch_end", 1],
    "during the test": ["on_test_batch_end", 2],  # the test is logged at the last training epoch
}
TIMED = ("time/", "usage/")  # measured, not computed: they differ between any two runs


def fault(stop: str, mark: Path) -> list[str]:
    if isinstance(STOPS[stop][1], int):
        hook, epoch = STOPS[stop]
        return ["+callbacks.fault._target_=tests.faults.KillIn", f"+callbacks.fault.hook={hook}",
                f"+callbacks.fault.epoch={epoch}", f"+callbacks.fault.mark={mark}"]
    return STOPS[stop]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, data_root) -> Path:
    run_dir = tmp_path_factory.mktemp("unbroken") / "run"
    result = train_here(*RUN, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def record(run_dir: Path) -> tuple[dict, dict, dict]:
    """What a run ends with: its result's metrics (not the timed ones), its checkpoints' names and weights, and its
    TensorBoard scalars (not the timed ones)."""
    result = json.loads((run_dir / "result.json").read_text())
    metrics = {k: v for k, v in result["metrics"].items() if not k.startswith(TIMED)}
    weights = {p.name: torch.load(p, map_location="cpu", weights_only=True)["state_dict"]
               for p in sorted((run_dir / "checkpoints").glob("*.ckpt"))}
    series = {tag: values for tag, values in scalars(run_dir).items() if not tag.startswith(TIMED)}
    return metrics, weights, series


@pytest.mark.slow
@pytest.mark.parametrize("stop", STOPS)
def test_a_run_stopped_anywhere_resumes_to_the_unbroken_runs_end(tmp_path, unbroken, stop):
    """The same figures, weights and scalars, and TensorBoard's steps too: the same ones, none twice, and none going
    back in any event file (TensorBoard's reader takes that for a restart and purges by it)."""
    run_dir = tmp_path / "run"
    # On this process's thread count, as the unbroken run and the resume: another count sums in another order.
    killed = run_cli("src.train", *RUN, *fault(stop, tmp_path / "killed"), f"hydra.run.dir={run_dir}", timeout=600,
                     env={**user_env(), "OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert killed.returncode == -9, killed.stderr[-3000:]
    if stop == "during training steps":  # after step 13: the newest checkpoint holds step 10
        assert max(torch.load(p, map_location="cpu", weights_only=True)["global_step"]
                   for p in (run_dir / "checkpoints").glob("*.ckpt")) == 10
        assert "epoch 1/3 step 10:" in (run_dir / "train.log").read_text(), "a killed run keeps the log of what it did"
    # The fault is the test's own callback: a resume takes no `_target_` from a run's records, so it is typed again.
    resumed = train_here(*RUN, *fault(stop, tmp_path / "killed"), "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours, theirs = record(run_dir), record(unbroken)
    assert ours[0] == theirs[0], "the result line's figures"
    assert ours[1].keys() == theirs[1].keys(), "the checkpoints, the best one by name"
    for name, weights in ours[1].items():
        assert all(torch.equal(weights[k], theirs[1][name][k]) for k in weights), name
    assert ours[2] == theirs[2], "the TensorBoard scalars"
    assert_same_tensorboard_steps(run_dir, unbroken)
    # A test resumed after a finished fit logs at the fit's last step, 29, after its checkpoint's purge step, 30: the
    # one step back allowed, as TensorBoard's reader then purges those tags' points beyond 29, of which there are none.
    allowed = {(29, 30)} if stop == "during the test" else set()
    assert {(step, latest) for _, step, latest in steps_going_back(run_dir)} <= allowed


@pytest.mark.slow
def test_a_stop_signal_right_after_the_epochs_checkpoints_keeps_its_points_and_resumes_exactly(tmp_path, unbroken):
    """The signal waits for the epoch's `train/*` points: the resume starts at the next epoch, and would never log them."""
    run_dir, fault = tmp_path / "run", ["+callbacks.term._target_=tests.faults.SignalAfterCheckpoints",
                                        "+callbacks.term.epoch=1", f"+callbacks.term.mark={tmp_path / 'stopped'}"]
    stopped = train_here(*RUN, *fault, f"hydra.run.dir={run_dir}")  # the signal to this process, handled as a run's
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1
    resumed = train_here(*RUN, *fault, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert record(run_dir)[2] == record(unbroken)[2], "the TensorBoard scalars"
