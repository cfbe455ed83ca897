"""Stopping a run cleanly: on SIGTERM, SIGINT or SIGHUP, when a rank dies, when a collective times out.

Lightning 2.6 answers SIGTERM with a broadcast inside the signal handler, which hangs a DDP run
whose other ranks are not in that collective, and its process observer SIGKILLs the launcher as
soon as a child dies, before anything says which. Instead, here:

- `install` gives every process a handler for the three signals that records the signal, forwards
  it to the launcher's children and raises `RunStopped`; Lightning's own exception path then
  finalizes the loggers. No checkpoint is written: `last.ckpt` keeps the last finished epoch.
- A watcher thread sees signals and dead children even while the main thread waits in a
  collective, and ends the process itself if the orderly stop does not finish in time.
- `stop_cleanly` turns what happened into one `error:` line, said by the process that speaks for
  the run, stops the children and exits: 128 + the signal for a signal, 1 for a dead or stuck rank.
"""

import ctypes
import functools
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist
from lightning import Trainer
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn

from src.launch.console import print_error
from src.launch.ddp_jobs import is_rank_zero

STOP_SIGNALS: tuple[int, ...] = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
# Set by the launcher for the DDP children it starts: their parent, which they must not outlive.
LAUNCHER_PID = "DPTRAIN_LAUNCHER_PID"
CHILD_GRACE_S = 5.0  # children get this long to stop on the forwarded signal, then SIGKILL
STOP_DEADLINE_S = 15.0  # after a signal, the orderly stop gets this long before the watcher ends the process
DEATH_DEADLINE_S = 10.0  # after a child died, the main thread gets this long to notice before the watcher ends the run
CHILD_EXIT_WAIT_S = 3.0  # a collective failed: how long to look for the child whose exit caused it
POLL_S = 0.25
STUCK_GRACE_S = 1.0  # a child stopped this long past strategy.timeout_s ends the run, should the collective wait on
# How torch reports a collective that lost its peer or ran out of time (gloo, NCCL, the TCP store).
COLLECTIVE_ERROR_MARKS = ("gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe", "Timed out", "timed out")
TIMEOUT_MARKS = ("Timed out", "timed out")

log = logging.getLogger(__name__)


class RunStopped(BaseException):
    """Raised in the main thread to stop the run. Not an `Exception`, so that no library's
    `except Exception` swallows it; the cause is kept by this module, not in the exception."""


@dataclass(frozen=True)
class Stop:
    """Why the run stops and the exit status that says so."""

    cause: str  # e.g. "run stopped by SIGTERM", "rank 1 (pid 42) died: killed by SIGKILL; run stopped"
    status: int
    signum: int | None = None  # the signal that this process or one of its children received


class _State:
    """What this process knows about its stop; written by the main thread and the watcher."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: the signal handler runs on the main thread
        self.installed = False
        self.trainer: Trainer | None = None
        self.stop: Stop | None = None  # the first cause wins
        self.deadline: float | None = None  # monotonic time at which the watcher ends the process
        self.raised = False  # RunStopped was raised once; never again, so cleanup is not cut short
        self.reporting = False  # the exit path runs: the handler only records
        self.reported = False
        self.deferring = 0  # inside a checkpoint write: raise after it
        self.stopped_since: dict[int, float] = {}  # pid of a stopped child -> when the watcher first saw it stopped


_state = _State()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _set_stop(stop: Stop, deadline_s: float) -> bool:
    """Record the first cause of the stop; True when `stop` was the first."""
    with _state.lock:
        if _state.stop is not None:
            return False
        _state.stop = stop
        _state.deadline = time.monotonic() + deadline_s
        return True


def _note_signal(signum: int) -> None:
    if _set_stop(Stop(f"run stopped by {signal_name(signum)}", 128 + signum, signum), STOP_DEADLINE_S):
        _signal_children(signum)


def _on_signal(signum: int, frame: Any) -> None:
    """Record the signal, forward it, and stop the main thread where it is, unless it is already stopping."""
    _note_signal(signum)
    if _state.raised or _state.reporting or _state.deferring:
        return
    _state.raised = True
    raise RunStopped


@contextmanager
def deferred_stop() -> Iterator[None]:
    """A stop that arrives inside this block takes effect after it: a checkpoint is written whole or not at all."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    if not _state.deferring and _state.stop is not None and not (_state.raised or _state.reporting):
        _state.raised = True
        raise RunStopped


# ---------------------------------------------------------------- the launcher's children


class WatchedLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher without its observer thread, which SIGKILLs the launcher when a child dies,
    before it can say which child died and how; this module's watcher does that job."""

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID] = str(os.getpid())  # copied into the children's environment
            try:
                self._call_children_scripts()
            finally:
                os.environ.pop(LAUNCHER_PID, None)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def _children() -> list[tuple[int, subprocess.Popen]]:
    """(global rank, process) of each DDP child this process started for the current run."""
    trainer = _state.trainer
    launcher = trainer.strategy.launcher if trainer is not None else None
    if not isinstance(launcher, _SubprocessScriptLauncher):
        return []
    first = launcher.cluster_environment.node_rank() * launcher.num_processes
    return [(first + i + 1, proc) for i, proc in enumerate(launcher.procs)]


def _signal_children(signum: int) -> None:
    for _, proc in _children():
        if proc.poll() is None:
            proc.send_signal(signum)
            proc.send_signal(signal.SIGCONT)  # a stopped child gets the signal only once it runs again


def _stop_children(signum: int) -> None:
    """Forward `signum` to the children still running, give them CHILD_GRACE_S to exit, then SIGKILL them."""
    _signal_children(signum)
    end = time.monotonic() + CHILD_GRACE_S
    for _, proc in _children():
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _child_exit_stop(rank: int, pid: int, returncode: int) -> Stop:
    """A child that exited on its own: stopped by a signal (handled or not), or died."""
    signum = returncode - 128 if returncode > 128 else -returncode if returncode < 0 else None
    if signum in STOP_SIGNALS:
        return Stop(f"run stopped by {signal_name(signum)} to rank {rank} (pid {pid})", 128 + signum, signum)
    how = f"killed by {signal_name(-returncode)}" if returncode < 0 else f"exit status {returncode}"
    return Stop(f"rank {rank} (pid {pid}) died: {how}; run stopped", 1)


def _check_children() -> bool:
    """Record the first child that ended with a non-zero status; True when one did."""
    for rank, proc in _children():
        returncode = proc.poll()
        if returncode not in (None, 0):
            stop = _child_exit_stop(rank, proc.pid, returncode)
            if _set_stop(stop, DEATH_DEADLINE_S):
                _signal_children(signal.SIGTERM)
            return True
    return False


def _stuck_stop(rank: int, pid: int, waited: str) -> Stop:
    return Stop(f"rank {rank} (pid {pid}) is stopped and did not answer within {waited} s; run stopped", 1)


def _check_stuck_children() -> bool:
    """End the run when a child has been stopped (SIGSTOP, a debugger) for longer than the collective
    timeout: a collective on the hook's group can outwait its timeout while a peer is stopped."""
    timeout = _timeout_s()
    if timeout is None:
        return False
    now = time.monotonic()
    for rank, proc in _children():
        if not _is_stopped(proc.pid):
            _state.stopped_since.pop(proc.pid, None)
            continue
        if now - _state.stopped_since.setdefault(proc.pid, now) > timeout + STUCK_GRACE_S:
            _set_stop(_stuck_stop(rank, proc.pid, f"strategy.timeout_s={timeout:g}"), 0.0)
            return True
    return False


def _is_stopped(pid: int) -> bool:
    """True for a process stopped by SIGSTOP/SIGTSTP or a debugger (Linux /proc; False elsewhere)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _launcher_pid() -> int | None:
    value = os.environ.get(LAUNCHER_PID)
    return int(value) if value and os.environ.get("LOCAL_RANK", "0") != "0" else None


def _die_with_launcher() -> None:
    """A DDP child gets SIGKILL when its launcher dies instead of lingering in a collective (Linux)."""
    launcher = _launcher_pid()
    if launcher is None or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher:  # it died before prctl took effect
        os._exit(1)


# ---------------------------------------------------------------- the watcher thread


def _watch(read_fd: int) -> None:
    """Signals (through the wakeup fd, even while the main thread waits in C++), dead children, deadlines."""
    while True:
        ready, _, _ = select.select([read_fd], [], [], POLL_S)
        if ready:
            try:
                received = os.read(read_fd, 512)
            except BlockingIOError:
                received = b""
            for signum in received:
                if signum in STOP_SIGNALS:
                    _note_signal(signum)
        if _state.stop is None:
            _check_children() or _check_stuck_children()
        if _state.deadline is not None and time.monotonic() > _state.deadline and _state.stop is not None:
            _end_now(_state.stop)


def _end_now(stop: Stop) -> NoReturn:
    """The orderly stop did not finish in time (the main thread is stuck): report and exit from here."""
    _report(stop)
    for _, proc in _children():
        if proc.poll() is None:
            proc.kill()
    _exit(stop.status)


def _set_handlers() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)


def install() -> None:
    """Handle SIGTERM, SIGINT and SIGHUP in this process from now on; call early, in the main thread."""
    if _state.installed or threading.current_thread() is not threading.main_thread():
        return
    _state.installed = True
    _die_with_launcher()
    _set_handlers()
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), name="stop-watcher", daemon=True).start()


class StopSignalConnector(_SignalConnector):
    """Lightning's signal connector with this module's handlers for SIGTERM, SIGINT and SIGHUP in place
    of its SIGTERM handler, whose broadcast hangs DDP; SLURM's requeue signal is still Lightning's."""

    def register_signal_handlers(self) -> None:
        install()
        super().register_signal_handlers()
        if threading.current_thread() is threading.main_thread():
            _set_handlers()


def attach(trainer: Trainer) -> None:
    """Use this module's signal handling, child watching and checkpoint deferral for `trainer`'s run."""
    _state.trainer = trainer
    trainer._signal_connector = StopSignalConnector(trainer)
    launcher = trainer.strategy.launcher
    if type(launcher) is _SubprocessScriptLauncher:
        trainer.strategy._launcher = WatchedLauncher(launcher.cluster_environment, launcher.num_processes, launcher.num_nodes)
    save_checkpoint = trainer.save_checkpoint

    @functools.wraps(save_checkpoint)
    def save_whole(*args: Any, **kwargs: Any) -> None:
        with deferred_stop():
            save_checkpoint(*args, **kwargs)

    trainer.save_checkpoint = save_whole  # type: ignore[method-assign]


# ---------------------------------------------------------------- reporting and exiting


def _collective_failure(error: BaseException) -> str | None:
    """The first line of a collective's error (lost peer, timeout) in `error` or its causes, else None.

    torch raises these as RuntimeError (DistBackendError, or a RuntimeError from a DDP hook's future)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, dist.DistError) or (isinstance(current, RuntimeError) and any(m in text for m in COLLECTIVE_ERROR_MARKS)):
            return next((line.strip() for line in text.splitlines() if line.strip()), type(current).__name__)
        current = current.__cause__ or current.__context__
    return None


def _timeout_s() -> float | None:
    trainer = _state.trainer
    timeout = getattr(trainer.strategy, "timeout_s", None) if trainer is not None else None
    return float(timeout) if timeout is not None else None


def _failed_collective_stop(failure: str) -> Stop:
    """A collective failed and no child is known to have exited: a stuck peer, or an unknown cause."""
    if not any(mark in failure for mark in TIMEOUT_MARKS):
        return Stop(f"a collective failed ({failure[:160]}); run stopped", 1)
    timeout = _timeout_s()
    waited = f"strategy.timeout_s={timeout:g}" if timeout is not None else "the collective timeout"
    stuck = [(rank, proc.pid) for rank, proc in _children() if _is_stopped(proc.pid)]
    launcher = _launcher_pid()
    if launcher is not None and _is_stopped(launcher):
        stuck.append((0, launcher))
    if stuck:
        return _stuck_stop(*stuck[0], waited)
    return Stop(f"a collective waited {waited} s without an answer from another rank; run stopped", 1)


def _cause(error: BaseException) -> Stop | None:
    """Why the run stops, or None for an error that is not a stop (a bug, bad input)."""
    if isinstance(error, KeyboardInterrupt):  # SIGINT before `install`
        _note_signal(signal.SIGINT)
    if isinstance(error, RunStopped) and _state.stop is None:
        _set_stop(Stop("run stopped", 1), STOP_DEADLINE_S)
    if _state.stop is not None:
        return _state.stop
    failure = _collective_failure(error)
    if failure is None:
        return None
    end = time.monotonic() + (0.0 if any(mark in failure for mark in TIMEOUT_MARKS) else CHILD_EXIT_WAIT_S)
    while not _check_children() and time.monotonic() < end and _children():
        time.sleep(0.1)
    if _state.stop is not None:
        return _state.stop
    _set_stop(_failed_collective_stop(failure), STOP_DEADLINE_S)
    return _state.stop


def _speaks(stop: Stop) -> bool:
    """Rank 0 speaks for the run. Another rank speaks only of a failed collective, and only when no
    launcher can: there is none (torchrun, SLURM), or it is stopped."""
    if is_rank_zero():
        return True
    if stop.signum is not None:
        return False
    launcher = _launcher_pid()
    return launcher is None or os.getppid() != launcher or _is_stopped(launcher)


def _when() -> str:
    """Where the run was, and what is kept on disk."""
    trainer = _state.trainer
    if trainer is None or trainer.state.fn is None:
        return "before training started"
    if trainer.state.fn == TrainerFn.TESTING:
        when = "while testing"
    else:
        when = f"during epoch {trainer.current_epoch} (step {trainer.global_step})"
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
    last = Path(dirpath or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"
    kept = f"{last} holds the last finished epoch" if last.is_file() else "no epoch finished, so there is no checkpoint"
    return f"{when}; {kept}"


def _report(stop: Stop) -> None:
    """Once per process: flush the loggers (the scalars so far; no HParams summary) and say the one line."""
    with _state.lock:
        if _state.reported:
            return
        _state.reported = True
    trainer = _state.trainer
    if trainer is not None and trainer.is_global_zero:
        for logger in trainer.loggers:
            try:
                logger.finalize("failed")
            except Exception as error:  # the line below matters more than a flush
                log.debug(f"flushing {type(logger).__name__} failed: {error}")
    if _speaks(stop):
        try:
            print_error(f"{stop.cause} {_when()}")
        except (OSError, ValueError):  # SIGHUP: the terminal may be gone
            pass


def _exit(status: int) -> NoReturn:
    """Exit at once: interpreter shutdown can block on a process group whose peer is gone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()  # train.log
    os._exit(status)


def end_child() -> None:
    """A DDP child whose job has ended well exits at once, skipping interpreter shutdown.

    Shutdown tears down gloo's process groups and threads in no set order; a child that aborts
    there (`terminate called without an active exception`, SIGABRT, seen once under load) turns a
    finished run into a failed one. A child has nothing left to write at this point: rank 0 holds
    the checkpoints, TensorBoard and the result.
    """
    if _launcher_pid() is not None:
        _exit(0)


def _finish(stop: Stop) -> NoReturn:
    _state.reporting = True
    with _state.lock:  # time to stop the children, within the signal's deadline where it allows
        _state.deadline = max(_state.deadline or 0.0, time.monotonic() + CHILD_GRACE_S + 3.0)
    _report(stop)
    _stop_children(stop.signum or signal.SIGTERM)
    _exit(stop.status)


@contextmanager
def stop_cleanly() -> Iterator[None]:
    """Around a run (and around Hydra): a stop ends the process with one line and its exit status.

    Any other error first stops the children quietly, then goes on as before (a traceback for a bug,
    `error: ...` for bad input). A stop is a signal, a child that died, or a collective that failed.
    """
    try:
        yield
    except SystemExit:
        raise
    except BaseException as error:
        stop = _cause(error)
        if stop is not None:
            _finish(stop)
        if os.environ.get(LAUNCHER_PID):  # a DDP child on its way out: the launcher's SIGTERM must not break its exit
            _state.reporting = True
        if _children():
            _stop_children(signal.SIGTERM)
        _state.trainer = None
        raise
    if _state.stop is not None:  # a rank died after its last collective: the run did not end well
        _finish(_state.stop)
    _state.trainer = None  # the job is over; its children are no longer watched
