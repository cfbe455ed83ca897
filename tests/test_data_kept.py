"""A failing command deletes only what it made itself, while it holds the folder's lock, and never a checkpoint: a
command that the lock turns away touches nothing, and a run on a full disk keeps its finished epochs to resume."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from src.launch import cli
from tests.helpers import QUICK, REPO, Run, composed, train_here, user_env


def tree(folder: Path) -> dict[str, int]:
    """Every file below `folder` with its size: what a command must leave as it was."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def run_job_here(*overrides: str, run_dir: Path, capsys) -> tuple[int, str]:
    """`src.train`'s job in this process, on the composed config: its exit status and last error line."""
    from src.tasks import train as task

    cfg = composed(*overrides, run_dir=run_dir)
    with pytest.raises(SystemExit) as exit_:
        cli.run_job(cfg, lambda cfg: task(cfg)[0])
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def held_elsewhere(tmp_path):
    """A run folder whose lock another process holds, as a running command holds it; released at the end."""
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from src.launch import lock\n"
                               "with lock.held(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()",
         str(folder)], cwd=REPO, env=user_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"  # an event, not a sleep: the lock is taken
    yield folder, holder.pid
    holder.communicate("")
    assert holder.returncode == 0


@pytest.mark.slow  # the holder is a process of its own: that is what a lock keeps out
@pytest.mark.parametrize("contents", ["nothing yet", "a run's records"])
def test_a_command_the_lock_turns_away_touches_nothing(held_elsewhere, contents, capsys, data_root):
    folder, pid = held_elsewhere
    if contents == "a run's records":
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text("[]\n")
        (folder / "train.log").write_text("epoch 1/2 step 10: ...\n")
    before = tree(folder)
    status, line = run_job_here(*QUICK, run_dir=folder, capsys=capsys)
    assert status == 2 and line.startswith(f"error: {folder} is in use: pid {pid} on ")
    assert tree(folder) == before, "the holder's folder, its lock included, as it was"


def test_a_command_refused_by_a_finished_run_keeps_it_whole(tmp_path, quick_run: Run, capsys):
    """The holder ended before the second command took the lock: the folder is the finished run's, not the command's."""
    folder = quick_run.copy(tmp_path)
    before = tree(folder)
    status, line = run_job_here(*QUICK, run_dir=folder, capsys=capsys)
    assert status == 2 and line.startswith(f"error: hydra.run.dir={folder} already holds a run's checkpoints")
    assert tree(folder) == before


def test_bad_input_still_leaves_no_folder_it_made(tmp_path, capsys, data_root):
    folder = tmp_path / "new" / "run"
    folder.mkdir(parents=True)  # as Hydra makes a run's folder before its job starts
    status, line = run_job_here(*QUICK, "data.batch_size=0", run_dir=folder, capsys=capsys)
    assert status == 2 and line.startswith("error: data.batch_size=0")
    assert not folder.exists()


def can_mount() -> bool:
    return subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                          capture_output=True).returncode == 0


@pytest.mark.slow  # a filesystem of its own, in a mount namespace: only a process has one
@pytest.mark.skipif(not can_mount(), reason="needs a mount namespace of its own (root and unshare)")
def test_a_full_disk_keeps_the_finished_epochs_and_the_run_resumes(tmp_path, data_root):
    """A disk of 2.6 MB holds epoch 1's two checkpoints (about 1.06 MB each) but not epoch 2's: the run ends in one
    line, its folder and finished checkpoints stay; on a larger disk the printed resume completes the run."""
    disk, run = tmp_path / "disk", tmp_path / "disk" / "run"
    disk.mkdir()
    first = " ".join([sys.executable, "-m", "src.train", *QUICK, "max_epochs=2", f"hydra.run.dir={run}"])
    again = " ".join([sys.executable, "-m", "src.train", *QUICK, "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run}"])
    script = (f"mount -t tmpfs -o size=2600k tmpfs {disk} && {first} 2>{tmp_path}/first.err; echo $? >{tmp_path}/first;"
              f" ls {run}/checkpoints >{tmp_path}/kept; mount -o remount,size=16m {disk} && {again}")
    result = subprocess.run(["unshare", "--mount", "sh", "-c", script], cwd=REPO, env=user_env(), capture_output=True,
                            text=True, timeout=600)
    failed = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first").read_text().strip() == "1", failed[-3000:]
    assert "the disk is full" in failed.strip().splitlines()[-1] and "Traceback" not in failed
    assert {"last.ckpt", "best-epoch1.ckpt"} <= set((tmp_path / "kept").read_text().split())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc=" in result.stdout


def test_a_failing_command_keeps_the_empty_folder_the_user_made(tmp_path, data_root):
    """`hydra.run.dir=<their own empty folder>` with data that is not there removed that folder."""
    own = tmp_path / "own"
    own.mkdir()
    result = train_here(*QUICK, f"data.root={tmp_path / 'nodata'}", "data.download=false", f"hydra.run.dir={own}")
    assert result.returncode == 2 and "Fashion-MNIST not found" in result.stderr
    assert own.is_dir()


def test_ctrl_c_before_the_first_checkpoint_leaves_no_folder(tmp_path, data_root):
    """A run stopped in its first seconds left an empty run folder behind, one that looked like a run."""
    run_dir = tmp_path / "runs" / "run"
    result = train_here(*QUICK, "+callbacks.stop._target_=tests.faults.SignalAtStep", "+callbacks.stop.step=1",
                        f"hydra.run.dir={run_dir}")
    assert result.returncode == 130
    assert result.stderr.strip().splitlines()[-1].startswith("error: run stopped by SIGINT during epoch 1")
    assert result.stderr.strip().endswith("no epoch finished, so there is no checkpoint (nor its folder)")
    assert not run_dir.exists()


@pytest.mark.parametrize("kind", ["fifo", "hard link", "link"])
def test_a_log_file_that_is_not_the_runs_own_is_refused_before_it_is_opened(tmp_path, kind):
    """A FIFO at `train.log` blocked the command before it said anything; a hard link or a link carried the log's
    lines into another file."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere.txt"
    run_dir.mkdir()
    elsewhere.write_text("kept")
    log_file = run_dir / "train.log"
    {"fifo": lambda: os.mkfifo(log_file), "hard link": lambda: os.link(elsewhere, log_file),
     "link": lambda: log_file.symlink_to(elsewhere)}[kind]()
    result = train_here(*QUICK, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {log_file} is ")
    assert elsewhere.read_text() == "kept"
