"""Local DDP workers, started in-process by torch's elastic agent (the engine behind `torchrun`).

The process running a Hydra job checks its config, then `start` runs one worker per device, each
calling the same function with the resolved config. Workers are forked from a forkserver that has
imported the training code once (Python 3.14's default on Linux), not started as new interpreters
that each import torch and Lightning again: a launch costs one import, not one per device, and a
sweep's later jobs none. Workers see torchrun's environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID), so Lightning picks its
TorchElasticEnvironment and starts no processes of its own. The agent forwards signals, notices a
dead worker and stops the others; what is here covers only what it leaves open, each piece saying why.
"""

import ctypes
import functools
import logging
import logging.config
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from tqdm import tqdm

from src.errors import TrainingDiverged, UsageError
from src.launch import forkserver, stops
from src.launch.forkserver import START_METHOD
from src.launch.console import close_progress_bars
from src.launch.stops import STOP_SIGNALS, RankFailed, RunStopped, handle_stop_signals, ignore_stop_signals, rank_failure, signal_name

T = TypeVar("T")
# How long a worker that lost its peer waits for the agent, which knows how the peer ended, to end
# it instead: the agent reports the first worker it finds ended, and this one is 25 ms behind.
PEER_GONE_GRACE_S = 10.0
# The environment this module was imported in: for a forked worker, the forkserver's at its start.
_IMPORTED_WITH = dict(os.environ)


def _method_name(depth: int = 2) -> str:
    """torch's `dynamic_rendezvous.get_method_name`, which names the method of each rendezvous event from
    `inspect.stack()`: that reads the source file of every frame on the stack, and looks through all 3,000-odd
    imported modules for those it cannot find (cpython#92041), twice an event: about 1 s of a core before a
    local DDP run's workers start, and more as it ends (docs/results.md, start-up)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack shorter than `depth`
        return "no_method_name"


dynamic_rendezvous.get_method_name = _method_name  # torch calls it only to name those events


class StopOnSignal(Callback):
    """Puts this module's handlers back after Lightning registers its own at each stage: Lightning's
    SIGTERM handler broadcasts from inside the handler, which hangs ranks that are in another collective."""

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _handle_anew()

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _handle_anew()
        stops.position = functools.partial(_position, weakref.ref(trainer))  # weak: a run's model outlives no run

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _handle_anew()


def _position(trainer: "weakref.ref[Trainer]") -> str:
    return "" if (alive := trainer()) is None else f" during epoch {alive.current_epoch + 1} (step {alive.global_step})"


def _handle_anew() -> None:
    """The stop handlers back, and no position until training starts."""
    stops.position = stops.nowhere
    handle_stop_signals()


def stop_on_signals(trainer: Trainer) -> None:
    trainer.callbacks = [*trainer.callbacks, StopOnSignal()]


def needed(trainer: Trainer) -> bool:
    """True where Lightning would start DDP processes itself: one node, several devices, no torchrun or SLURM."""
    strategy = trainer.strategy
    return (isinstance(strategy, DDPStrategy) and trainer.world_size > 1 and strategy.cluster_environment is not None
            and not strategy.cluster_environment.creates_processes_externally)


# ---------------------------------------------------------------- the process running the Hydra job


def start(function: Callable[..., T], cfg: DictConfig, *args: Any) -> T:
    """Run `function(cfg, *args)` in one worker per device; rank 0's result.

    Raises `RunStopped` when this process got a stop signal, `RankFailed` when a worker ended the
    run, and the worker's own `UsageError` or `TrainingDiverged`.
    """
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")]
    for logger in quiet:  # the agent's own lines would say again, in many lines, what the one `error:` line says
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())  # else Python's last-resort handler prints them
    with tempfile.TemporaryDirectory(prefix="torchelastic_") as error_files:
        position = Path(error_files) / "position"  # where rank 0 was when a signal stopped it
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=cfg.devices, run_id=uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: the agent's store takes a free port
            max_restarts=0, start_method=START_METHOD, logs_specs=DefaultLogsSpecs(log_dir=error_files),
        )
        if START_METHOD == "forkserver":
            forkserver.ensure_running(preloaded(function))  # a no-op where the run started it early
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # workers have no Hydra to resolve with
        OmegaConf.set_struct(resolved, OmegaConf.is_struct(cfg))
        try:
            results = elastic_launch(config, _worker)(function, resolved, args, _logging_config(),
                                                      Inherited(dict(os.environ)), str(position))
        except SignalException as stop:  # the agent has stopped the workers with the same signal
            raise RunStopped(int(stop.sigval), _read(position)) from None
        except ChildFailedError as error:
            raise _rank_failure(error, _read(position)) from None
        finally:
            for signum, handler in handlers.items():  # the agent leaves its own handlers in place
                signal.signal(signum, handler)
            for logger in quiet:
                logger.propagate = True
    result = results[0]
    if isinstance(result, (UsageError, TrainingDiverged)):
        raise result
    return result


def preloaded(function: Callable[..., Any]) -> list[str]:
    """What the forkserver imports once: the training code (`forkserver.PRELOAD`), this module, and every module of
    `function`'s package that this process has imported, except a `python -m` entry module, which each worker runs
    itself as `__mp_main__` (imported beforehand, runpy would warn)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    entry = spec.name if spec is not None else None
    package = (entry if function.__module__ == "__main__" else function.__module__) or ""
    top = package.split(".")[0]
    ours = [name for name in sys.modules if top and (name == top or name.startswith(f"{top}.")) and name != entry]
    return [*forkserver.PRELOAD, __name__, *sorted(ours)]


class Inherited:
    """What a worker started by spawn inherits from this process at that moment: the environment and
    file descriptors 1 and 2. A forkserver's worker inherits them from the forkserver instead, as they
    were when it started (an earlier job of a sweep, an earlier run in a test session), so they are
    handed over explicitly; the descriptors as multiprocessing hands over a socket."""

    def __init__(self, environ: dict[str, str], stdio: tuple[Any, ...] = ()) -> None:
        self.environ = environ
        self.stdio = stdio

    def __reduce__(self) -> tuple[Any, ...]:  # pickled while a worker is being started: it gets copies of 1 and 2
        return Inherited, (self.environ, (reduction.DupFd(1), reduction.DupFd(2)))

    def take(self) -> None:
        """In the worker: the launcher's environment under the agent's own variables, and its output."""
        agent = {name: value for name, value in os.environ.items() if _IMPORTED_WITH.get(name) != value}
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(agent)  # RANK, MASTER_PORT, ...: set by the agent before this function runs
        for target, handed in zip((1, 2), self.stdio):
            fd = handed.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _logging_config() -> dict[str, Any] | None:
    """The job's logging settings, for workers, which have no Hydra of their own."""
    if not HydraConfig.initialized():
        return None
    return OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True)  # type: ignore[return-value]


def _leave_position(position: Path, where: str, rank: int) -> None:
    """Rank 0's position, else the first stopped rank's: a rank waiting in a collective for a peer that a signal
    ended never runs its handler, and the agent kills it."""
    if rank == 0:
        partial = position.with_name(f"{position.name}.0")
        partial.write_text(where)
        partial.replace(position)
        return
    try:
        with position.open("x") as file:
            file.write(where)
    except FileExistsError:
        pass


def _read(position: Path) -> str:
    """Where training was when a signal stopped a rank (` during epoch 3 (step 6)`), if one said so."""
    try:
        return position.read_text()
    except OSError:
        return ""


def _rank_failure(error: ChildFailedError, where: str = "") -> BaseException:
    """The worker whose end stopped the run, in one line: a death by a signal first, then a stop, then the rest."""
    def order(item: tuple[int, Any]) -> tuple[int, int]:
        code = item[1].exitcode
        return (0 if code < 0 else 1 if code - 128 in STOP_SIGNALS else 2, item[1].timestamp)

    rank, failure = min(error.failures.items(), key=order)
    who = f"rank {rank} (pid {failure.pid})"
    if failure.exitcode < 0:
        return RankFailed(f"{who} died: killed by {signal_name(-failure.exitcode)}; run stopped")
    if failure.exitcode - 128 in STOP_SIGNALS:
        return RunStopped(failure.exitcode - 128, f" to {who}{where}")
    message = failure.message
    message = str(message.get("message", "") if isinstance(message, dict) else message)
    if message.startswith(f"{RankFailed.__name__}: "):  # the worker's own line
        return RankFailed(f"{who}: {message.removeprefix(f'{RankFailed.__name__}: ')}")
    return RankFailed(f"{who} failed ({message.splitlines()[0] if message else f'exit status {failure.exitcode}'}); run stopped")


# ---------------------------------------------------------------- a worker


def _worker(function: Callable[..., Any], cfg: DictConfig, args: tuple[Any, ...],
            logging_config: dict[str, Any] | None, inherited: Inherited, position: str) -> Any:
    """One rank: what `function` returns, or a user's error for the launcher to report. A rank stopped by a
    signal ends its progress bar's line and leaves where training was in the file `position`."""
    die_with_launcher()
    inherited.take()
    # tqdm's default lock holds a named semaphore, which this process's immediate exit (`_exit`) would leave to
    # the resource tracker's "leaked semaphore" warning at the end of the run: the bars get a thread lock instead.
    tqdm.set_lock(threading.RLock())
    rank = int(os.environ["RANK"])
    rank_zero_only.rank = rank  # Lightning read it at import, before the agent set RANK
    _log_to_file(logging_config, rank)
    _share_cores(int(os.environ["LOCAL_WORLD_SIZE"]))
    handle_stop_signals()
    try:
        result = function(cfg, *args)
        if dist.is_initialized():  # torn down here, in order, not by interpreter shutdown
            dist.destroy_process_group()
        return result
    except RunStopped as stop:
        ignore_stop_signals()
        close_progress_bars()  # the launcher's `error:` line starts on a line of its own
        if stop.where:
            _leave_position(Path(position), stop.where, rank)
        _exit(128 + stop.signum)
    except (UsageError, TrainingDiverged) as error:
        return error
    except Exception as error:
        ignore_stop_signals()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent ends the other workers with it: at once
        failure = rank_failure(error, cfg)
        if failure is None:
            traceback.print_exc()
            raise
        if failure.timed_out:
            # The agent stops the other workers with SIGTERM, which a worker stopped by SIGSTOP only
            # receives once continued (without this, it is SIGKILLed 30 s later): say why first, then
            # continue them, then exit at once, so that this failure is the first the agent sees.
            get_error_handler().record_exception(failure)
            os.killpg(os.getpgrp(), signal.SIGCONT)
            _exit(1)
        # Another rank went away: the agent sees how (killed, stopped, failed) and ends this worker
        # with SIGTERM once it does; only if it does not is this worker's line the run's.
        time.sleep(PEER_GONE_GRACE_S)
        raise failure from None


def die_with_launcher() -> None:
    """The agent watches its workers from the launcher, so a launcher killed by SIGKILL would leave
    them waiting in a collective (and a parallel sweep's job, training on). A thread ends this process
    once the launcher is gone; and on Linux the kernel ends it once its parent is (the launcher under
    spawn, the forkserver otherwise), also while it is stopped."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    launcher = multiprocessing.parent_process()
    if launcher is None:
        return
    if not launcher.is_alive():  # it was gone before the watch began
        os._exit(1)
    threading.Thread(target=_end_after, args=(launcher,), name="launcher-watch", daemon=True).start()


def _end_after(launcher: multiprocessing.process.BaseProcess) -> None:
    launcher.join()
    os.kill(os.getpid(), signal.SIGKILL)


def _share_cores(workers: int) -> None:
    """The cores this process may run on split between its workers, as torchrun (OMP_NUM_THREADS=1) and
    Lightning's own launcher do and elastic_launch does not: each worker would otherwise start a thread per
    core. The cores are those of its affinity, which a parallel sweep's job narrows to its own share."""
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(usable_cores()) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes a worker starts (data loaders)
        torch.set_num_threads(threads)


def usable_cores() -> list[int]:
    """The cores this process may run on: its affinity where the system tells it (Linux; `taskset`, a SLURM
    allocation or a parallel sweep's job narrow it), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _log_to_file(logging_config: dict[str, Any] | None, rank: int) -> None:
    """The job's logging in a worker: rank 0 writes the job's log (`train.log`), rank N `train_rank_N.log`."""
    if logging_config is None:
        return
    for handler in logging_config.get("handlers", {}).values():
        if "filename" in handler and rank:
            name = Path(handler["filename"])
            handler["filename"] = str(name.with_name(f"{name.stem}_rank_{rank}{name.suffix}"))
            handler["delay"] = True  # created at its first line: a rank that says nothing leaves no empty file
    logging.config.dictConfig(logging_config)


def _exit(status: int) -> NoReturn:
    """Exit at once: interpreter shutdown can block on a process group whose peer is gone."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(status)
