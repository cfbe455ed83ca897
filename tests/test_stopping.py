"""Stopping a run: signals, a rank that dies, a rank that hangs.
The real command line, each run in a process of its own; the other stop signals, which take SIGTERM's way out, from
within a run in this process. A launcher killed outright, whose workers go with it: tests/test_multirun.py's DDP jobs
side by side, one of which is killed.

Every run is started in its own session, so that a test can signal all of its processes at once
(as a terminal's Ctrl-C or `kill -- -PGID` does) and find any process it left behind. Nothing here
bounds how long a stop takes: a loaded machine may be slow; each wait is for an event, with minutes to spare.
"""

import gc
import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from lightning import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from omegaconf import OmegaConf

from src import config
from src.checkpoints import AtomicCheckpointIO
from src.errors import UsageError
from src.launch import stops
from src.launch.stops import STOP_SIGNALS, RunStopped, handle_stop_signals, ignore_stop_signals
from src.launch.workers import StopOnSignal
from src.loggers import RunLogger
from src.strategies.ddp import CommHookDDPStrategy
from tests.helpers import (INTERPRETER, QUICK, REPO, composed, cpu_precision, hparams, scalars, start_cli, train_here,
                           user_env, worker_pids)

# Long enough to be signalled: 50 short epochs, each checkpointed in `checkpoints/last.ckpt`.
LONG = [*QUICK, "max_epochs=50", "data.batch_size=64", "trainer.limit_train_batches=10"]
DDP = ["strategy=ddp", "devices=2"]
WAIT_S = 300.0  # a loaded 2-core machine may need minutes to start the processes, train an epoch, or stop
STUCK_TIMEOUT_S = 10  # strategy.timeout_s of the stuck-rank test


def checkpointed_epoch(path: Path) -> int:
    """The epoch a checkpoint holds; -1 while there is none (it is written whole, by a rename)."""
    return torch.load(path, map_location="cpu", weights_only=False)["epoch"] if path.is_file() else -1


def proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, ppid, pgid, ...; [] for a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def live_processes(pgid: int) -> list[int]:
    """Processes of a process group that are not yet gone (zombies count as gone)."""
    pids = [int(stat.parent.name) for stat in Path("/proc").glob("[0-9]*/stat")]
    return [pid for pid in pids if (fields := proc_stat(pid)) and int(fields[2]) == pgid and fields[0] != "Z"]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {WAIT_S:.0f} s")
        time.sleep(0.2)


class Run:
    """`python -m src.train ...` in its own session: started, signalled, and cleaned up in any case."""

    def __init__(self, run_dir: Path, *args: str, one_stream: bool = False) -> None:
        """`one_stream`: stderr into stdout, as a terminal shows both (progress bars go to stdout)."""
        self.dir, self.merged = run_dir, one_stream
        self.proc = start_cli("src.train", *args, cwd=REPO, env=user_env(), new_session=True, merged=one_stream)
        self.stdout = self.stderr = ""

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        if live_processes(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.communicate()

    def wait_training(self, workers: int = 0, checkpoint: Path | None = None) -> list[int]:
        """Wait until a second epoch is checkpointed; the pids of the launcher's workers.

        Lightning saves an epoch's checkpoint just before it logs that epoch's train scalars; by the
        second epoch's checkpoint, the first epoch's `train/loss` is surely logged.
        """
        checkpoint = checkpoint or self.dir / "checkpoints" / "last.ckpt"

        def training() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"the run ended before it was signalled (status {self.proc.returncode}):\n{self.proc.stderr.read()[-3000:]}")
            return checkpointed_epoch(checkpoint) >= 1 and len(worker_pids(self.proc.pid)) == workers

        wait_for(training, "a checkpoint of the second epoch")
        return worker_pids(self.proc.pid)

    def wait_exit(self) -> int:
        """Wait for the launcher and then every other process of the run; the launcher's exit status."""
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            left = live_processes(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.stdout, self.stderr = self.proc.communicate()
            pytest.fail(f"still running {WAIT_S:.0f} s after the signal: pids {left}\n{self.stderr[-3000:]}")
        wait_for(lambda: not live_processes(self.proc.pid), "every process of the run gone")
        return self.proc.returncode


def assert_stopped(run: Run, status: int, line: str, run_dir: Path | None = None) -> str:
    """The run left no process behind and said its stop as `assert_said_stop` has it."""
    assert live_processes(run.proc.pid) == []
    return assert_said_stop(run.proc.returncode, run.stdout if run.merged else run.stderr, status, line, run_dir or run.dir)


def assert_said_stop(returncode: int, output: str, status: int, line: str, run_dir: Path) -> str:
    """The run exited with `status`, said one `error:` line matching `line` and no traceback, kept its logs and
    scalars, and neither tested nor wrote its HParams summary."""
    assert returncode == status, output[-3000:]
    errors = [text for text in output.splitlines() if text.startswith("error:")]
    assert len(errors) == 1 and re.search(line, errors[0]), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert (run_dir / "train.log").is_file()
    series = scalars(run_dir)
    assert "train/loss" in series and "test/acc" not in series, sorted(series)
    assert hparams(run_dir) == {}
    print(errors[0])  # the lines docs/reliability.md shows
    return errors[0]


def assert_names_its_resume(error_line: str, run_dir: Path) -> str:
    """The line names `last.ckpt`, which holds a finished epoch, and the command that resumes from it."""
    last = run_dir / "checkpoints" / "last.ckpt"
    command = f"{INTERPRETER} -m src.train ckpt_path=last hydra.run.dir={run_dir} {QUICK[0]}"  # where the data is: typed
    assert error_line.endswith(f"{last} holds the last finished epoch; resume with: {command}"), error_line
    assert checkpointed_epoch(last) >= 1
    return command


def assert_resumes(error_line: str, run_dir: Path, *again: str) -> None:
    """`assert_names_its_resume`, and the command trains one more epoch from the checkpoint (with `max_epochs` made one
    more than the checkpoint's, where the line's command would train on to the end), `again` typed again: a resume
    takes no `_target_` from the run's records."""
    command, last = assert_names_its_resume(error_line, run_dir), run_dir / "checkpoints" / "last.ckpt"
    epoch = checkpointed_epoch(last)
    more = train_here(*shlex.split(command)[3:], *again, f"max_epochs={epoch + 2}")
    assert more.returncode == 0, more.stderr[-3000:]
    assert checkpointed_epoch(last) == epoch + 1


@pytest.mark.slow  # trains two epochs
@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_every_stop_signal_stops_a_run_with_its_own_status_and_it_resumes(tmp_path, data_root, name):
    """The run's own callback sends the signal, to this process, once the second epoch is checkpointed: the handler
    and the way out are a one-process run's, the status (128 + the signal's number) and the line name the signal, and
    the line's command trains on from the checkpoint. A real process's stop is the DDP launcher's and the sweep's,
    below."""
    run_dir, signum = tmp_path / "run", getattr(signal, name)
    fault = ["+callbacks.term._target_=tests.faults.SignalAfterCheckpoints", "+callbacks.term.epoch=1",
             f"+callbacks.term.mark={tmp_path / 'sent'}", f"+callbacks.term.name={name}"]
    result = train_here(*LONG, *fault, f"hydra.run.dir={run_dir}")
    # Held until the second epoch's points are logged, the stop ends the run as the third begins.
    line = assert_said_stop(result.returncode, result.stderr, 128 + signum, rf"^error: run stopped by {name} during "
                            rf"epoch 3 \(step 20\); {run_dir / 'checkpoints' / 'last.ckpt'} holds the last finished epoch; ",
                            run_dir)
    assert checkpointed_epoch(run_dir / "checkpoints" / "last.ckpt") == 1
    assert_resumes(line, run_dir, *fault)  # the fault's mark is left: it sends no signal again


@pytest.mark.slow
@pytest.mark.parametrize(("name", "target"), [("SIGTERM", "launcher"), ("SIGTERM", "rank 1")],
                         ids=["SIGTERM-launcher", "SIGTERM-rank1"])
def test_signal_stops_every_ddp_process(tmp_path, data_root, name, target):
    """To the launcher (`kill`), or to one worker; to every process as a terminal's Ctrl-C sends it, below."""
    signum = getattr(signal, name)
    with Run(tmp_path / "run", *LONG, *DDP, f"hydra.run.dir={tmp_path / 'run'}") as run:
        _, rank1 = run.wait_training(workers=2)
        if target == "every process":
            os.killpg(run.proc.pid, signum)
        else:
            os.kill(run.proc.pid if target == "launcher" else rank1, signum)
        run.wait_exit()
    to_rank1 = rf" to rank 1 \(pid {rank1}\)" if target == "rank 1" else ""
    line = assert_stopped(run, 128 + signum, rf"^error: run stopped by {name}{to_rank1} during epoch \d+ \(step \d+\); ")
    assert "leaked semaphore" not in run.stderr, run.stderr[-3000:]
    if target == "launcher":  # how its ranks resume from that checkpoint is test_resume.py's
        assert_names_its_resume(line, run.dir)


@pytest.mark.slow
def test_ctrl_c_under_ddp_with_progress_bars_ends_in_one_line_of_its_own(tmp_path, data_root):
    """SIGINT to every process, as a terminal's Ctrl-C sends it, and as the terminal shows it, the bars and the line in
    one stream: the line starts at the left edge (not at the end of the bar's line), says where training was and how
    to resume, and nothing follows it."""
    with Run(tmp_path / "run", *LONG, *DDP, "trainer.enable_progress_bar=true", f"hydra.run.dir={tmp_path / 'run'}",
             one_stream=True) as run:
        run.wait_training(workers=2)
        os.killpg(run.proc.pid, signal.SIGINT)
        run.wait_exit()
    assert_stopped(run, 130, r"^error: run stopped by SIGINT during epoch \d+ \(step \d+\); ")
    assert "leaked semaphore" not in run.stdout, run.stdout[-3000:]
    lines = run.stdout.rstrip().split("\n")  # a bar redraws its line with \r: only \n starts another
    said = [line for line in lines if "error:" in line]
    assert len(said) == 1 and said[0] == lines[-1], run.stdout[-3000:]
    assert re.match(r"error: run stopped by SIGINT during epoch \d+ \(step \d+\); ", said[0]), said[0]
    assert said[0].endswith(f"; resume with: {INTERPRETER} -m src.train ckpt_path=last hydra.run.dir={tmp_path / 'run'} "
                            f"{QUICK[0]}")
    assert "Epoch 2/50" in run.stdout and "Epoch 0" not in run.stdout  # the bar counts epochs as train.log does


@pytest.mark.slow
def test_killed_rank_stops_the_run_with_one_line(tmp_path, data_root):
    with Run(tmp_path / "run", *LONG, *DDP, f"hydra.run.dir={tmp_path / 'run'}") as run:
        _, rank1 = run.wait_training(workers=2)
        os.kill(rank1, signal.SIGKILL)
        run.wait_exit()
    assert_stopped(run, 1, rf"^error: rank 1 \(pid {rank1}\) died: killed by SIGKILL; run stopped; ")


@pytest.mark.slow
def test_stuck_rank_stops_the_run_after_the_collective_timeout(tmp_path, data_root):
    args = [*LONG, *DDP, f"strategy.timeout_s={STUCK_TIMEOUT_S}", f"hydra.run.dir={tmp_path / 'run'}"]
    with Run(tmp_path / "run", *args) as run:
        _, rank1 = run.wait_training(workers=2)
        os.kill(rank1, signal.SIGSTOP)
        run.wait_exit()
    # Rank 0's words, naming the rank it waited for: it continues rank 1 only after it has said them.
    assert_stopped(run, 1, rf"^error: rank 0 \(pid \d+\): a collective waited strategy.timeout_s={STUCK_TIMEOUT_S} s "
                           rf"without an answer from rank 1 \(pid {rank1}\), which is stopped \(SIGSTOP or a debugger\)")


@pytest.mark.slow
def test_signal_stops_the_whole_sweep(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    job = f"lenet_auto_1dev_{cpu_precision()}_seed="  # + the job's seed
    with Run(sweep, "-m", *LONG, "seed=1,2", f"hydra.sweep.dir={sweep}") as run:
        run.wait_training(checkpoint=sweep / f"{job}1" / "checkpoints" / "last.ckpt")
        os.kill(run.proc.pid, signal.SIGTERM)
        run.wait_exit()
    assert_stopped(run, 143, r"^error: run stopped by SIGTERM during epoch \d+ \(step \d+\); ", run_dir=sweep / f"{job}1")
    assert not (sweep / f"{job}2").exists()


@pytest.mark.parametrize("timeout_s", ["0", "-5", "soon", "true", "inf", "nan"])
def test_collective_timeout_must_be_a_finite_positive_number(timeout_s):
    with pytest.raises(UsageError, match=rf"^strategy.timeout_s={timeout_s} is not allowed; strategy.timeout_s must be a number above 0$"):
        config.check(composed("strategy=ddp", f"strategy.timeout_s={timeout_s}"))


def test_collective_timeout_default_is_five_minutes():
    assert OmegaConf.load(REPO / "conf" / "strategy" / "ddp.yaml").timeout_s == 300
    assert CommHookDDPStrategy().timeout_s == 300


@pytest.fixture
def stop_handlers():
    """The run's stop handlers in this test process, and its own back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    handle_stop_signals()
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_stop_handler_put_back_on_the_way_out_stays_quiet(stop_handlers):
    """A SLURM job that saved itself for its requeue ignores stop signals, then Lightning's teardown put back the handler
    it had found as the fit began, and the SIGTERM of SLURM's requeue came during the exit: a traceback in the job's
    output. Once on the way out, the handler stays quiet wherever it is put back; the next run stops again."""
    found = signal.getsignal(signal.SIGTERM)  # what Lightning's signal connector saves as a fit starts
    ignore_stop_signals()
    signal.signal(signal.SIGTERM, found)  # and puts back as it tears down
    signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns, and raises nothing
    handle_stop_signals()
    with pytest.raises(RunStopped):
        signal.raise_signal(signal.SIGTERM)


def test_a_stop_during_a_tensorboard_write_waits_for_the_write_and_the_run_flushes_at_once(tmp_path, stop_handlers):
    """A stop raised inside the writer's queue, after the point was queued and before the writer thread was woken,
    left the writer asleep until its flush interval was up: the run's flush on the way out waited 120 s (a sweep
    job once took two minutes to stop). The signal comes at exactly that point here."""
    logger = RunLogger(save_dir=str(tmp_path), name="", version="")
    logger.log_metrics({"train/loss": 1.0}, step=0)  # the writer thread has written once; its next flush is 120 s away
    queue = logger.experiment._get_file_writer().event_writer._async_writer._byte_queue  # tensorboard's, private
    wake = queue.not_empty.notify

    def stop_before_waking(n: int = 1) -> None:
        signal.raise_signal(signal.SIGTERM)  # its handler runs before this returns
        wake(n)

    queue.not_empty.notify = stop_before_waking
    with pytest.raises(RunStopped) as stopped:
        logger.log_metrics({"train/loss": 0.5}, step=1)
    queue.not_empty.notify = wake
    assert stopped.value.signum == signal.SIGTERM
    inside = [entry.frame.code.path for entry in stopped.traceback]
    assert not any(Path(path).name in ("queue.py", "threading.py") for path in inside), inside
    logger.finalize("failed")  # flushes, as Lightning's way out of a stopped fit does
    assert scalars(tmp_path)["train/loss"] == [1.0, 0.5]


def test_a_stop_during_a_checkpoint_save_lets_the_save_finish(tmp_path, monkeypatch, stop_handlers):
    """The epoch that just ended is kept: the stop is raised once its checkpoint is in place."""
    path = tmp_path / "checkpoints" / "last.ckpt"
    save = torch.save

    def signalled_midway(checkpoint, file):
        file.write(b"")  # the file is open, the save under way
        signal.raise_signal(signal.SIGTERM)
        save(checkpoint, file)

    monkeypatch.setattr(torch, "save", signalled_midway)
    with pytest.raises(RunStopped):
        AtomicCheckpointIO().save_checkpoint({"epoch": 2}, path)
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]
    assert checkpointed_epoch(path) == 2


def test_a_stop_at_an_epochs_end_names_the_step_its_checkpoint_holds(stop_handlers):
    """The stop line says where training was when the signal came: after an epoch's last step, while its checkpoint
    is saved, that is the checkpoint's step, not the step its last batch started at (a line one step behind the
    checkpoint it says holds the last finished epoch). It holds the trainer weakly: a finished run's model is freed."""
    class StopAtTheEndOfEpoch2(Callback):
        def on_train_epoch_end(self, trainer: Trainer, pl_module: BoringModel) -> None:
            if trainer.current_epoch == 1:  # counted from 0
                signal.raise_signal(signal.SIGTERM)

    trainer = Trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[StopAtTheEndOfEpoch2()])
    trainer.callbacks.append(StopOnSignal())
    with pytest.raises(RunStopped) as stopped:
        trainer.fit(BoringModel())
    assert (stopped.value.where, trainer.global_step) == (" during epoch 2 (step 4)", 4)
    del trainer, stopped
    gc.collect()
    assert stops.position() == ""  # the trainer, and its model, are not held by it


def test_the_run_folders_log_ends_with_how_the_run_ended(tmp_path, data_root):
    """`error: run stopped by ...` went to the terminal only: a `nohup` or SLURM run's folder could not tell a stopped
    run from a running one. Its train.log ends with the same line; a finished run's with its result line."""
    run_dir = tmp_path / "run"
    fault = ["+callbacks.term._target_=tests.faults.SignalAfterCheckpoints", "+callbacks.term.epoch=0",
             f"+callbacks.term.mark={tmp_path / 'sent'}"]
    stopped = train_here(*QUICK, "max_epochs=2", *fault, f"hydra.run.dir={run_dir}")
    assert stopped.returncode == 143
    said = stopped.stderr.strip().splitlines()[-1]
    assert said.startswith("error: run stopped by SIGTERM") and "resume with: " in said
    assert (run_dir / "train.log").read_text().strip().splitlines()[-1].endswith(said)
    finished = train_here(*QUICK, "max_epochs=2", *fault, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert (run_dir / "train.log").read_text().strip().splitlines()[-1].endswith(
        json.loads((run_dir / "result.json").read_text())["line"])
