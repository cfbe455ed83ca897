"""Stopping a run: signals, a rank that dies, a rank that hangs. The real command line, in subprocesses.

Every run is started in its own session, so that a test can signal all of its processes at once
(as a terminal's Ctrl-C or `kill -- -PGID` does) and find any process it left behind.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.launch import stopping
from src.strategies.ddp import CommHookDDPStrategy
from tests.helpers import QUICK, REPO, hparams, scalars, train, user_env

# Long enough to be signalled: 50 short epochs, each checkpointed in `checkpoints/last.ckpt`.
LONG = [*QUICK, "max_epochs=50", "data.batch_size=64", "trainer.limit_train_batches=10"]
DDP = ["strategy=ddp", "devices=2"]
EXIT_S = 30.0  # every process of the run is gone this long after the signal
START_S = 300.0  # a loaded 2-core machine may need minutes to start the processes and finish an epoch
STUCK_TIMEOUT_S = 20  # strategy.timeout_s of the stuck-rank test; also bounds the processes' start-up rendezvous


def checkpointed_epoch(path: Path) -> int:
    """The epoch a checkpoint holds; -1 while there is none (it is written whole, by a rename)."""
    return torch.load(path, map_location="cpu", weights_only=False)["epoch"] if path.is_file() else -1


def live_processes(pgid: int) -> list[int]:
    """Processes of a process group that are not yet gone (zombies count as gone)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def child_pids(pid: int) -> list[int]:
    pids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids += [int(child) for child in children.read_text().split()]
        except OSError:
            pass
    return pids


class Run:
    """`python -m src.train ...` in its own session: started, signalled, and cleaned up in any case."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.dir = run_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "src.train", *args], cwd=REPO, env=user_env(),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        self.stderr = ""
        self.sent_at = time.monotonic()
        self.elapsed = float("nan")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        if live_processes(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.communicate()

    def wait_training(self, processes: int = 1, checkpoint: Path | None = None) -> list[int]:
        """Wait until a second epoch is checkpointed; the launcher's pid, then its DDP children's.

        Lightning saves an epoch's checkpoint just before it logs that epoch's train scalars; by the
        second epoch's checkpoint, the first epoch's `train/loss` is surely logged.
        """
        checkpoint = checkpoint or self.dir / "checkpoints" / "last.ckpt"
        deadline = time.monotonic() + START_S
        while not checkpointed_epoch(checkpoint) >= 1 or len(child_pids(self.proc.pid)) < processes - 1:
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before it was signalled (status {self.proc.returncode}):\n{self.proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no checkpoint after {START_S:.0f} s")
            time.sleep(0.2)
        return [self.proc.pid, *child_pids(self.proc.pid)]

    def send(self, pid: int, signum: int) -> None:
        self.sent_at = time.monotonic()
        os.kill(pid, signum)

    def send_all(self, signum: int) -> None:
        self.sent_at = time.monotonic()
        os.killpg(self.proc.pid, signum)

    def wait_exit(self, limit_s: float = EXIT_S) -> int:
        """Wait for the launcher and then every other process of the run; the launcher's exit status."""
        try:
            _, self.stderr = self.proc.communicate(timeout=limit_s + 30)
        except subprocess.TimeoutExpired:
            left = live_processes(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            _, self.stderr = self.proc.communicate()
            pytest.fail(f"still running {limit_s + 30:.0f} s after the signal: pids {left}\n{self.stderr[-3000:]}")
        while live_processes(self.proc.pid) and time.monotonic() - self.sent_at < limit_s:
            time.sleep(0.1)
        self.elapsed = time.monotonic() - self.sent_at
        return self.proc.returncode


def assert_stopped(run: Run, status: int, line: str, limit_s: float = EXIT_S, run_dir: Path | None = None) -> str:
    """The run exited with `status`, within `limit_s`, said one `error:` line matching `line`,
    left no process behind, kept its logs and scalars, and neither tested nor wrote its HParams summary."""
    run_dir = run_dir or run.dir
    assert run.proc.returncode == status, run.stderr[-3000:]
    errors = [text for text in run.stderr.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and re.search(line, errors[0]), run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.elapsed < limit_s
    assert live_processes(run.proc.pid) == []
    assert (run_dir / "train.log").is_file()
    series = scalars(run_dir)
    assert "train/loss" in series and "test/acc" not in series, sorted(series)
    assert hparams(run_dir) == {}
    print(f"exit status {status} {run.elapsed:.1f} s after the signal: {errors[0]}")  # the figures in docs/reliability.md
    return errors[0]


def assert_last_checkpoint_kept(error_line: str, run_dir: Path) -> None:
    """`last.ckpt` still loads and holds no epoch later than the one being trained when the signal came."""
    epoch = int(re.search(r"during epoch (\d+)", error_line).group(1))
    last = run_dir / "checkpoints" / "last.ckpt"
    assert str(last) in error_line
    assert torch.load(last, weights_only=False)["epoch"] <= epoch


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_stops_one_process(tmp_path, data_root, name):
    signum = getattr(signal, name)
    with Run(tmp_path / "run", *LONG, f"hydra.run.dir={tmp_path / 'run'}") as run:
        run.wait_training()
        run.send(run.proc.pid, signum)
        run.wait_exit()
    line = assert_stopped(run, 128 + signum, rf"^error: run stopped by {name} during epoch \d+ \(step \d+\); ")
    assert_last_checkpoint_kept(line, run.dir)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank 1", "all processes"])
def test_sigterm_stops_every_ddp_process(tmp_path, data_root, target):
    with Run(tmp_path / "run", *LONG, *DDP, f"hydra.run.dir={tmp_path / 'run'}") as run:
        launcher, rank1 = run.wait_training(processes=2)
        if target == "all processes":
            run.send_all(signal.SIGTERM)
        else:
            run.send(launcher if target == "launcher" else rank1, signal.SIGTERM)
        run.wait_exit()
    to_rank1 = rf" to rank 1 \(pid {rank1}\)" if target == "rank 1" else ""
    line = assert_stopped(run, 143, rf"^error: run stopped by SIGTERM{to_rank1} during epoch \d+ \(step \d+\); ")
    assert_last_checkpoint_kept(line, run.dir)


@pytest.mark.slow
def test_killed_rank_stops_the_run_with_one_line(tmp_path, data_root):
    with Run(tmp_path / "run", *LONG, *DDP, f"hydra.run.dir={tmp_path / 'run'}") as run:
        _, rank1 = run.wait_training(processes=2)
        run.send(rank1, signal.SIGKILL)
        run.wait_exit()
    assert_stopped(run, 1, rf"^error: rank 1 \(pid {rank1}\) died: killed by SIGKILL; run stopped during epoch \d+")


@pytest.mark.slow
def test_a_childs_interpreter_shutdown_cannot_fail_a_finished_run(tmp_path, data_root):
    """A DDP child whose job ended well exits before shutdown, where an abort would fail the run."""
    run_dir = tmp_path / "run"
    result = train(*QUICK, "strategy=ddp", "devices=2", "+callbacks.fault._target_=tests.faults.AbortAtExit",
                   f"hydra.run.dir={run_dir}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "died" not in result.stderr and "test/acc=" in result.stdout


@pytest.mark.slow
def test_stuck_rank_stops_the_run_after_the_collective_timeout(tmp_path, data_root):
    args = [*LONG, *DDP, f"strategy.timeout_s={STUCK_TIMEOUT_S}", f"hydra.run.dir={tmp_path / 'run'}"]
    with Run(tmp_path / "run", *args) as run:
        _, rank1 = run.wait_training(processes=2)
        run.send(rank1, signal.SIGSTOP)
        run.wait_exit(limit_s=STUCK_TIMEOUT_S + 15)
    assert_stopped(
        run, 1, rf"^error: rank 1 \(pid {rank1}\) is stopped and did not answer within strategy.timeout_s={STUCK_TIMEOUT_S} s",
        limit_s=STUCK_TIMEOUT_S + 15,
    )
    assert run.elapsed > STUCK_TIMEOUT_S - 1


def test_signal_stops_the_whole_sweep(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    with Run(sweep, "-m", *LONG, "seed=1,2", f"hydra.sweep.dir={sweep}") as run:
        run.wait_training(checkpoint=sweep / "seed=1" / "checkpoints" / "last.ckpt")
        run.send(run.proc.pid, signal.SIGTERM)
        run.wait_exit()
    line = assert_stopped(run, 143, r"^error: run stopped by SIGTERM during epoch \d+", run_dir=sweep / "seed=1")
    assert_last_checkpoint_kept(line, sweep / "seed=1")
    assert not (sweep / "seed=2").exists()


@pytest.mark.parametrize("timeout_s", [0, -5, "soon", True, float("inf"), float("nan")])
def test_collective_timeout_must_be_a_finite_positive_number(timeout_s):
    strategy = CommHookDDPStrategy(timeout_s=timeout_s)
    with pytest.raises(UsageError, match=rf"^strategy.timeout_s={timeout_s} is not allowed; it must be a finite number of seconds above 0$"):
        strategy.check_options()


def test_collective_timeout_default_is_five_minutes():
    assert OmegaConf.load(REPO / "conf" / "strategy" / "ddp.yaml").timeout_s == 300
    assert CommHookDDPStrategy().timeout_s == 300


def test_a_child_stopped_past_the_timeout_ends_the_run_even_while_the_collective_waits_on(monkeypatch):
    """The watcher bounds the stop by strategy.timeout_s, not by how long a collective really waits."""
    monkeypatch.setattr(stopping, "_state", stopping._State())
    monkeypatch.setattr(stopping, "_children", lambda: [(1, SimpleNamespace(pid=4242))])
    monkeypatch.setattr(stopping, "_timeout_s", lambda: 0.1)
    stopped = {4242: True}
    monkeypatch.setattr(stopping, "_is_stopped", lambda pid: stopped[pid])
    assert not stopping._check_stuck_children()  # seen stopped for the first time
    time.sleep(0.1 + stopping.STUCK_GRACE_S / 2)
    stopped[4242] = False  # it ran again: the clock starts over
    assert not stopping._check_stuck_children()
    stopped[4242] = True
    assert not stopping._check_stuck_children()
    time.sleep(0.1 + stopping.STUCK_GRACE_S + 0.05)
    assert stopping._check_stuck_children()
    stop = stopping._state.stop
    assert stop.status == 1 and stop.cause == "rank 1 (pid 4242) is stopped and did not answer within strategy.timeout_s=0.1 s; run stopped"
    assert stopping._state.deadline <= time.monotonic()  # the watcher ends the process at its next look
