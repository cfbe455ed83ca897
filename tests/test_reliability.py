"""One writer per folder, and what the machine refuses (a full disk, too few file descriptors, a path too long) said
in one line with the exit status of a failure (1) or of bad input (2), leaving nothing that looks like a result."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import QUICK, REPO, Run, start_cli, train_here, user_env

HOLD = ["+callbacks.hold._target_=tests.faults.HoldAfterEpoch", "max_epochs=2"]  # waits after epoch 1 for a file


def wait_for(condition, what: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds  # a bound on a hang only: each wait is for an event
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_second_writer_of_a_sweep_or_of_its_running_job_is_refused_naming_the_first(tmp_path, data_root):
    """A sweep, held in its first job, holds both its folder and the job's. A second resume of the sweep, and a resume
    of the job's folder alone, are turned away naming the sweep's process; neither touches what the first wrote.
    They run in this process; the first stays a process of its own, so that the pid named is not the refused
    command's own, and a real run is seen to hold its folders, finish and let them go."""
    sweep, released, holding = tmp_path / "sweep", tmp_path / "released", tmp_path / "holding"
    held = [*HOLD, "+callbacks.hold.epoch=0", f"+callbacks.hold.until={released}", f"+callbacks.hold.holding={holding}"]
    args = [*QUICK, "-m", "seed=1,2", *held, f"hydra.sweep.dir={sweep}"]
    first = start_cli("src.train", *args)
    try:
        wait_for(holding.exists, "the first sweep's first job trains an epoch and holds, all it wrote written")
        [job] = [path.parent.parent for path in sweep.glob("*/checkpoints/last.ckpt")]
        holder = f"pid {first.pid} on {socket.gethostname()}"
        assert (job / ".lock").read_text() == (sweep / ".lock").read_text() == f"{holder}\n"
        before = {p: p.stat().st_mtime_ns for p in sweep.rglob("*") if p.is_file()}
        second = train_here(*args, "ckpt_path=auto")  # the sweep's lock turns it away before any job
        assert second.returncode == 2
        assert last_line(second).startswith(f"error: {sweep} is in use: {holder}") and "this sweep" in last_line(second)
        # The job's folder resumed alone, typed as its job was (a resume takes no `_target_` from the records): the lock
        # is what refuses it.
        alone = train_here(*QUICK, "seed=1", *held, "ckpt_path=last", f"hydra.run.dir='{job}'")
        assert alone.returncode == 2
        assert last_line(alone) == (f"error: {job} is in use: {holder} is writing this run; wait for it to end, or stop "
                                    "it first (one writer per folder)")
        assert {p: p.stat().st_mtime_ns for p in sweep.rglob("*") if p.is_file() and p in before} == before
    finally:
        released.touch()
        out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert not (sweep / ".lock").exists() and not list(sweep.glob("*/.lock")), "released at the end"


def can_mount() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not can_mount(), reason="needs a mount namespace of its own (root and unshare)")
@pytest.mark.parametrize("size", ["12k", "800k"], ids=["at the start", "during the run"])
def test_a_full_disk_is_named_and_leaves_nothing_that_looks_like_a_result(tmp_path, data_root, size):
    """A run folder on a filesystem of `size`: too small for the run's records, or for its second checkpoint (one
    LeNet checkpoint is about 540 kB)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = (f"mount -t tmpfs -o size={size} tmpfs {disk} && exec {sys.executable} -m src.train "
               + " ".join([*QUICK, f"hydra.run.dir={disk}/run"]) + f"; ls -a {disk}/run {disk}/run/checkpoints")
    result = subprocess.run(["unshare", "--mount", "sh", "-c", command], cwd=REPO, env=user_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert last_line(result).startswith("error: ") and "the disk is full" in last_line(result), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "result.json" not in result.stdout and ".partial" not in result.stdout


@pytest.mark.slow
def test_too_few_file_descriptors_under_ddp_are_one_line(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = subprocess.run(["bash", "-c", f"ulimit -n 32; exec {sys.executable} -m src.train "
                             + " ".join([*QUICK, "strategy=ddp", "devices=2", f"hydra.run.dir={run_dir}"])],
                            cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert last_line(result).endswith("Too many open files: a limit of the system's (see `ulimit -n`, `ulimit -v`)")
    assert "Traceback" not in result.stderr and not (run_dir / "config.yaml").exists()


@pytest.mark.parametrize("args", [["hydra.run.dir="], [f"hydra.run.dir=/tmp/{'x' * 300}/run"],
                                  [f"data.root=/tmp/{'d' * 5000}"]], ids=["empty", "a long folder", "a long data root"])
def test_a_path_that_cannot_be_a_folder_is_one_line(tmp_path, args):
    result = train_here(*QUICK[1:], f"hydra.run.dir={tmp_path}/run", *args, f"hydra.sweep.dir={tmp_path}/sweep")
    assert result.returncode == 2, result.stderr[-3000:]
    assert last_line(result).startswith("error: ") and "Traceback" not in result.stderr
    assert not (REPO / ".hydra").exists() and not list(REPO.glob("events.out.*"))


def test_what_a_killed_write_left_half_written_goes_at_the_next_start(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    partial = run_dir / "checkpoints" / f".last.ckpt.{os.getpid()}.partial"
    partial.write_bytes(b"cut short")
    result = train_here(*QUICK, "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not partial.exists() and not list(Path(run_dir).rglob("*.partial"))


@pytest.mark.parametrize("soft, hard, raised", [(20, 20, None), (32, 4096, 64), (4096, 4096, 4096)])
def test_ddp_ranks_start_only_with_the_open_files_they_need(monkeypatch, soft, hard, raised):
    """Short of them the agent's store fails to start (`ulimit -n 20`) or its workers retry until the rendezvous times
    out (24): one line before any rank starts; a soft limit below the hard one is raised."""
    import resource

    from src.errors import RunFailed
    from src.launch import workers

    limits = {"now": (soft, hard)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    if raised is None:
        with pytest.raises(RunFailed, match=r"^2 DDP processes need 64 open files and `ulimit -n` allows 20: Too many"):
            workers.open_files_for(2)
    else:
        workers.open_files_for(2)
        assert limits["now"] == (raised, hard)
