"""A run's processes: for local DDP one per device, started by torch's elastic agent (as `torchrun`, so Lightning
starts none of its own), else the task in this process. The agent forwards signals and stops the others when a worker
dies: what is here covers what it leaves open."""

import functools
import gc
import importlib
import logging
import logging.config
import os
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, get_error_handler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from tqdm import tqdm

from src.data.fashion_mnist import per_process_batch
from src.errors import RunFailed, UsageError, build, said
from src.fast_path import resolve_accelerator
from src.launch import console, stops
from src.launch.console import close_progress_bars, counted
from src.launch.ranks import external_rank, usable_cores
from src.launch.stops import (STOP_SIGNALS, RankFailed, RunStopped, die_with_launcher, handle_stop_signals,
                              ignore_stop_signals, rank_failure, signal_name, timed_out)
from src.records import Result
from src.strategies.ddp import CommHookDDPStrategy

# How long a worker that lost its peer waits for the agent, which knows how the peer ended, to end it instead: the
# agent reports the first worker it finds ended, and this one is 25 ms behind.
PEER_GONE_GRACE_S = 10.0


def is_ddp(cfg: DictConfig) -> bool:
    target = str(OmegaConf.select(cfg, "strategy._target_") or "")
    return target != "builtins.str" and issubclass(get_class(target), DDPStrategy)


def local_threads(workers: int) -> int:
    """A local DDP worker's share of this process's cores, as torchrun and Lightning split them."""
    return max(1, len(usable_cores()) // workers)


def threads_per_process(strategy: str, devices: int) -> int:
    """Torch's threads in each process of a run (its `threads` in config.yaml): the DDP workers this process starts
    share its cores, unless OMP_NUM_THREADS says how many; a run in this process, or a rank torchrun or SLURM started,
    keeps its own."""
    starts = external_rank() is None and strategy != "builtins.str" and issubclass(get_class(strategy), DDPStrategy)
    return local_threads(devices) if starts and "OMP_NUM_THREADS" not in os.environ else torch.get_num_threads()


def processes_per_node(cfg: DictConfig) -> int:
    """DDP runs one process per device; Lightning's `auto` (a strategy passed by name) and dp run one."""
    return int(cfg.devices) if is_ddp(cfg) else 1


def launch(task: Callable[[DictConfig], Result], cfg: DictConfig) -> Result:
    """`task(cfg)` in a worker per device under DDP, one device too, so that this process leaves the GPUs to its ranks;
    else in this process. First the devices asked for must exist here, the global batch split over the processes, and
    the DDP strategy built here."""
    per_node, cuda, accelerator = processes_per_node(cfg), torch.cuda.is_available(), str(cfg.accelerator)
    if accelerator in ("gpu", "cuda") and not cuda:
        raise UsageError(f"accelerator={accelerator} but this machine has no CUDA device; use accelerator=cpu")
    if cuda and accelerator != "cpu" and cfg.devices > torch.cuda.device_count():
        raise UsageError(f"devices={cfg.devices} but this machine has {counted(torch.cuda.device_count(), 'CUDA device')}")
    if str(cfg.precision).startswith("transformer-engine") and not cuda:
        raise UsageError(f"precision={cfg.precision} is not allowed here; it needs a CUDA GPU and the transformer_engine package")
    if isinstance(batch := cfg.data.get("batch_size"), int):
        per_process_batch(batch, per_node * int(cfg.num_nodes))
    if not is_ddp(cfg) or external_rank() is not None:
        with own_process_group():
            return task(cfg)
    strategy = build("strategy", cfg.strategy, _convert_="all")  # what would fail in every rank fails before they start
    if isinstance(strategy, CommHookDDPStrategy):
        strategy.check(cuda=resolve_accelerator(accelerator) == "gpu")
    return start(task, cfg, per_node)


@contextmanager
def own_process_group() -> Iterator[None]:
    """Lightning leaves its process group and environment behind (LOCAL_RANK would tell a sweep's next job that
    someone else started its processes), and the GPU memory the run's tensors held in PyTorch's cache: a sequential
    sweep's next job, a DDP job's ranks among them, would find it taken."""
    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")}
    try:
        yield
    finally:
        if torch.cuda.is_initialized():
            gc.collect()  # the run's objects in reference cycles (a Trainer and its callbacks) hold tensors
            torch.cuda.empty_cache()
        if external_rank() is None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class StopOnSignal(Callback):
    """Puts the stop handlers back after Lightning registers its own at each stage: Lightning's SIGTERM handler
    broadcasts from inside the handler, which hangs ranks that are in another collective."""

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stops.position = stops.nowhere
        handle_stop_signals()

    on_test_start = on_sanity_check_start

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.on_sanity_check_start(trainer, pl_module)
        stops.position = functools.partial(_position, weakref.ref(trainer))  # weak: a run's model outlives no run
        self.holding = False

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A stop waits from here, before the checkpoints (Lightning runs them last), until the epoch's `train/*`
        points are logged after every callback: a resume starts at the next epoch and would never log them. First
        of the callbacks, this one lets it go before another's next hook, which may wait (for a file, a peer)."""
        stops.hold()
        self.holding = True

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if getattr(self, "holding", False):
            self.holding = False
            stops.release()

    on_train_end = on_train_epoch_start

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if getattr(self, "holding", False):
            self.holding = False
            stops.release(stop=False)


def _position(trainer: "weakref.ref[Trainer]") -> str:
    return "" if (alive := trainer()) is None else f" during epoch {alive.current_epoch + 1} (step {alive.global_step})"


def open_files_for(nprocs: int) -> None:
    """Enough open files for the agent and its workers, raised up to the hard limit where the soft one is lower: short
    of them, the agent's store fails to start or its workers retry their connection until the rendezvous times out."""
    need = 48 + 8 * nprocs  # measured: 40 start two CPU workers
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return
    raise RunFailed(f"{nprocs} DDP processes need {need} open files and `ulimit -n` allows {hard}: Too many "
                    "open files: a limit of the system's (see `ulimit -n`, `ulimit -v`)")


def start(task: Callable[[DictConfig], Result], cfg: DictConfig, nprocs: int) -> Result:
    """`task(cfg)` in `nprocs` workers; rank 0's result, else `RunStopped`, `RankFailed`, or the worker's own error."""
    open_files_for(nprocs)
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher")]
    for logger in quiet:  # the agent's own lines would say again, in many lines, what the one `error:` line says
        logger.propagate = False
        if not logger.handlers:
            logger.addHandler(logging.NullHandler())  # else Python's last-resort handler prints them
    with tempfile.TemporaryDirectory(prefix="torchelastic_") as error_files:
        position = Path(error_files) / "position"  # where training was when a signal stopped a rank
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nprocs, run_id=uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: the agent's store takes a free port
            max_restarts=0, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=error_files),
        )
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # workers have no Hydra to resolve with
        task = importable(task)
        # NCCL's watchdog ends a rank whose collective failed or waited strategy.timeout_s by SIGABRT, from its own
        # thread (`_rank_failure` tells the death). Mode 3, torch's default outside its elastic agent, ends it at once;
        # the agent hands its workers this process's mode, else 1, which first aborts the communicators: that can hang.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        logging_config = OmegaConf.to_container(HydraConfig.get().job_logging, resolve=True) if HydraConfig.initialized() else None
        if logging_config is not None and console.in_files is not None:  # a sweep's job: the workers' lines in its logs
            for handler in logging_config.get("handlers", {}).values():
                if "filename" not in handler:
                    handler["level"] = "WARNING"
        try:
            results = elastic_launch(config, _worker)(task, resolved, logging_config, str(position))
        except (SignalException, ChildFailedError) as error:
            where = position.read_text() if position.is_file() else ""
            if isinstance(error, SignalException):  # the agent has stopped the workers with the same signal
                raise RunStopped(int(error.sigval), where) from None
            raise _rank_failure(error, where, resolved) from None
        finally:
            for signum, handler in handlers.items():  # the agent leaves its own handlers in place
                signal.signal(signum, handler)
            for logger in quiet:
                logger.propagate = True
    result = results[0]
    if isinstance(result, (UsageError, RunFailed)):
        raise result
    return result


def importable(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` by its import name: under `python -m` it lives in `__main__`, which a spawned process calls
    `__mp_main__` (a parallel sweep job's copy by value has no name pickle finds)."""
    spec = getattr(sys.modules.get(function.__module__), "__spec__", None)
    if function.__module__ in ("__main__", "__mp_main__") and spec is not None:
        return getattr(importlib.import_module(spec.name), function.__name__)
    return function


def _leave_position(position: Path, where: str, rank: int) -> None:
    """Rank 0's position, else the first stopped rank's: a rank waiting in a collective for a peer that a signal
    ended never runs its handler."""
    if rank == 0:
        partial = position.with_name(f"{position.name}.0")
        partial.write_text(where)
        partial.replace(position)
        return
    with suppress(FileExistsError), position.open("x") as file:
        file.write(where)


def _rank_failure(error: ChildFailedError, where: str, cfg: DictConfig) -> BaseException:
    """The worker whose end stopped the run, in one line: a death by a signal first, then a stop, then the rest. Over
    NCCL, SIGABRT is its watchdog ending a collective that timed out (a dead or stopped peer ended earlier)."""
    def order(item: tuple[int, Any]) -> tuple[int, int]:
        code = item[1].exitcode
        return (0 if code < 0 else 1 if code - 128 in STOP_SIGNALS else 2, item[1].timestamp)

    rank, failure = min(error.failures.items(), key=order)
    who = f"rank {rank} (pid {failure.pid})"
    backend = OmegaConf.select(cfg, "strategy.process_group_backend")
    over_nccl = backend == "nccl" or (backend is None and resolve_accelerator(str(cfg.accelerator)) == "gpu")
    if failure.exitcode == -signal.SIGABRT and over_nccl:
        return RankFailed(f"{who}: {timed_out(cfg).line}")
    if failure.exitcode < 0:
        return RankFailed(f"{who} died: killed by {signal_name(-failure.exitcode)}; run stopped")
    if failure.exitcode - 128 in STOP_SIGNALS:
        return RunStopped(failure.exitcode - 128, f" to {who}{where}")
    message = failure.message
    message = str(message.get("message", "") if isinstance(message, dict) else message)
    if message.startswith(f"{RankFailed.__name__}: "):  # the worker's own line
        return RankFailed(f"{who}: {message.removeprefix(f'{RankFailed.__name__}: ')}")
    return RankFailed(f"{who} failed ({message.splitlines()[0] if message else f'exit status {failure.exitcode}'}); run stopped")


def _worker(task: Callable[[DictConfig], Result], cfg: DictConfig, logging_config: dict[str, Any] | None,
            position: str) -> Any:
    """One rank: what `task` returns, or a user's error for the launcher to say; a stopped one leaves where training
    was in the file `position`."""
    die_with_launcher()
    # tqdm's default lock holds a named semaphore, which this process's immediate exit (`_exit`) would leave to the
    # resource tracker's "leaked semaphore" warning at the end of the run: the bars get a thread lock instead.
    tqdm.set_lock(threading.RLock())
    rank = int(os.environ["RANK"])
    rank_zero_only.rank = rank  # Lightning read it at import, before the agent set RANK
    Path(position).with_name(f"pid{os.getpid()}").write_text(str(rank))  # for the peers' `stopped_peers`
    _log_to_file(logging_config, rank)
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun and Lightning split the cores, and elastic_launch does not
        threads = local_threads(int(os.environ["LOCAL_WORLD_SIZE"]))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes a worker starts
        torch.set_num_threads(threads)
    handle_stop_signals()
    try:
        result = task(cfg)
        if dist.is_initialized():  # torn down here, in order, not by interpreter shutdown
            dist.destroy_process_group()
        return result
    except RunStopped as stop:
        ignore_stop_signals()
        close_progress_bars()  # the launcher's `error:` line starts on a line of its own
        if stop.where:
            _leave_position(Path(position), stop.where, rank)
        _exit(128 + stop.signum)
    except Exception as error:
        if (line := said(error)) is not None:  # the user's input, or the machine's refusal: for the launcher to say
            return line
        ignore_stop_signals()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent ends the other workers with it: at once
        failure = rank_failure(error, cfg)
        if failure is None:
            traceback.print_exc()
            raise
        if failure.timed_out:
            stopped = stopped_peers(Path(position).parent)
            if not stopped:  # perhaps the stopped rank itself, continued: the rank that waited for it says it first
                time.sleep(PEER_GONE_GRACE_S)
            failure = timed_out(cfg, stopped)
            # The agent stops the other workers with SIGTERM, which a worker stopped by SIGSTOP only receives once
            # continued (else it is SIGKILLed 30 s later): say why first, then continue them, then exit at once.
            get_error_handler().record_exception(failure)
            os.killpg(os.getpgrp(), signal.SIGCONT)
            _exit(1)
        # Another rank went away: the agent sees how (killed, stopped, failed) and ends this worker with SIGTERM once
        # it does; only if it does not is this worker's line the run's.
        time.sleep(PEER_GONE_GRACE_S)
        raise failure from None


def stopped_peers(ranks: Path) -> str:
    """The other stopped (SIGSTOP) workers, as `rank N (pid P)`, by the pids noted in `ranks` (none without /proc)."""
    found = []
    for noted in ranks.glob("pid*"):
        pid = int(noted.name.removeprefix("pid"))
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]  # after the command's name
        except (OSError, IndexError):
            continue
        if state == "T" and pid != os.getpid():
            found.append(f"rank {noted.read_text()} (pid {pid})")
    return ", ".join(sorted(found))


def _log_to_file(logging_config: dict[str, Any] | None, rank: int) -> None:
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
