"""The forkserver that a local DDP run forks its workers from, started as soon as the config shows that the run
will need it: its import of the training code (torch and Lightning, seconds) then runs beside the launching
process's own import, on another core, instead of after it (docs/results.md, start-up)."""

import functools
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

from omegaconf import DictConfig

from src.launch.ranks import external_rank, is_launching_process

T = TypeVar("T")

# What the server imports once for every worker it forks: the run's code, and torch and Lightning with it, out of
# the garbage collector's walks.
PRELOAD = ["src.launch.preload"]
# Where multiprocessing has no forkserver (Windows), a new interpreter per process.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def will_fork_workers(cfg: DictConfig) -> bool:
    """Several devices of one node under a DDP strategy, with no torchrun or SLURM around the run: where
    `src.launch.workers.needed` will say so once the Trainer is built. A wrong guess costs an idle process."""
    strategy = cfg.strategy if isinstance(cfg.strategy, DictConfig) else {}
    target = str(strategy.get("_target_", ""))
    return (cfg.devices > 1 and cfg.num_nodes == 1 and "DDP" in target.rsplit(".", 1)[-1]
            and external_rank() is None and is_launching_process())


def start_early(cfg: DictConfig) -> None:
    if "forkserver" in multiprocessing.get_all_start_methods() and will_fork_workers(cfg):
        ensure_running(PRELOAD)


def ensure_running(preload: list[str]) -> None:
    """Start the forkserver, which imports `preload`, unless it runs. It starts with SIGINT ignored, as it
    ignores it once running: a terminal's Ctrl-C during its import would print its traceback under the run's
    one line. The workers it forks set their own handlers; the server ends with the process that started it."""
    multiprocessing.set_forkserver_preload(preload)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def context(preload: list[str]) -> BaseContext:
    """Processes forked from the forkserver, which imports `preload` once (where it runs already, the
    children import what it lacks), instead of spawned: each new interpreter imports torch again, seconds
    of a core. For processes of one's own, such as the timings of `src.scaling`: `call` and
    `start_processes` start them so that they see the caller's environment."""
    if START_METHOD == "forkserver":
        ensure_running(preload)
    return multiprocessing.get_context(START_METHOD)


def call(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in one process forked from the forkserver, under this process's environment: its
    result, or its exception raised here."""
    from concurrent.futures import ProcessPoolExecutor  # not at import: a run's command line is checked first

    with ProcessPoolExecutor(max_workers=1, mp_context=context([function.__module__])) as pool:
        return pool.submit(_run_in, dict(os.environ), function, *args).result()


def start_processes(function: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(function, args, nprocs)`, each process forked from the
    forkserver, which imports `function`'s module once for all of them, under this process's environment."""
    from torch import multiprocessing as torch_multiprocessing  # not at import: torch loads after the checks

    torch_multiprocessing.start_processes(functools.partial(_run_in, dict(os.environ), function), args=args, nprocs=nprocs,
                                          start_method=context([function.__module__]).get_start_method())


def _run_in(environ: dict[str, str], function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` under `environ`: a forked process starts with the server's environment as it was when
    the server started, where a spawned one would have its caller's of the moment."""
    os.environ.clear()
    os.environ.update(environ)
    return function(*args)
