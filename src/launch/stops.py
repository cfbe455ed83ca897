"""How a run stops: a stop signal raises `RunStopped` in the main thread, a rank that ends the run is `RankFailed`,
and a collective that lost its peer or timed out is told from other errors. Apart from `src.launch.workers`, so that
every entry point handles signals from its first line, before torch is imported."""

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig

STOP_SIGNALS: tuple[int, ...] = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))
# How torch words a collective that lost its peer or ran out of time (gloo, NCCL, the TCP store).
COLLECTIVE_MARKS = ("gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe", "Timed out", "timed out")


class RunStopped(BaseException):
    """A stop signal. Not an `Exception`, so that no `except Exception` swallows it (Lightning still finalizes)."""

    def __init__(self, signum: int, where: str = "") -> None:
        super().__init__(signum, where)
        self.signum = signum
        self.where = where  # e.g. " to rank 1 (pid 42)"


class RankFailed(Exception):
    """A rank ended the run (exit status 1): the one line that says which and how."""

    def __init__(self, line: str, timed_out: bool = False) -> None:
        super().__init__(line)
        self.line = line
        self.timed_out = timed_out


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def nowhere() -> str:
    return ""


# Where training is, for the stop line (` during epoch 3 (step 6)`): asked only when a signal comes, so that no step
# pays for it; `src.launch.workers.StopOnSignal` points it at the trainer.
position: Callable[[], str] = nowhere

# Stop signals that came while `held`, raised when it ends; `_holding` counts the `held` blocks the main thread is in.
_held_signals: list[int] = []
_holding = 0
_leaving = False  # set by `ignore_stop_signals`, until `handle_stop_signals` starts a run again


def _raise_stop(signum: int, frame: Any) -> None:
    if _leaving:  # put back on the way out by a library that saved it (Lightning's teardown of its signal handlers)
        return
    if _holding:
        _held_signals.append(signum)
        return
    raise RunStopped(signum, position())


def hold() -> None:
    """Stop signals wait until as many `release`s."""
    global _holding
    _holding += 1


def release(stop: bool = True) -> None:
    """The last release raises a stop signal that came meanwhile (with `stop`; else it is dropped: an error ends the
    run already)."""
    global _holding
    _holding -= 1
    if not _holding and _held_signals:
        signum = _held_signals[0]
        _held_signals.clear()
        if stop:
            raise RunStopped(signum, position())


@contextmanager
def held() -> Iterator[None]:
    """Stop signals wait until the block ends. For code other threads wait on: raised inside `queue.Queue.put`, a stop
    loses the reader's wake-up, and TensorBoard's writer sleeps out its 120 s flush interval before the run ends."""
    hold()
    try:
        yield
    finally:
        release()


def handle_stop_signals() -> None:
    global _leaving
    _leaving = False
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stop)


def ignore_stop_signals() -> None:
    """On the way out: the agent SIGTERMs every worker once one has ended (and Ctrl-C reaches a worker twice), and
    SLURM's requeue a job that has saved itself; a handler that raised during the exit would print a traceback."""
    global _leaving
    _leaving = True
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def rank_failure(error: BaseException, cfg: DictConfig) -> RankFailed | None:
    """A collective that lost its peer or timed out, in `error` or its causes, as one line; else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, RuntimeError) and any(mark in text for mark in COLLECTIVE_MARKS):
            if any(mark in text for mark in ("Timed out", "timed out", "timing out")):  # NCCL: "before timing out"
                return timed_out(cfg)
            first = next((line.strip() for line in text.splitlines() if line.strip()), type(current).__name__)
            return RankFailed(f"a collective failed ({first[:160]}); run stopped")
        current = current.__cause__ or current.__context__
    return None


def timed_out(cfg: DictConfig, stopped: str = "") -> RankFailed:
    """A collective that waited `strategy.timeout_s` for another rank (`stopped`: that rank, known to be stopped)."""
    waited = f"strategy.timeout_s={cfg.strategy.get('timeout_s')}"
    peer = f"{stopped}, which is stopped (SIGSTOP or a debugger)" if stopped else "another rank"
    return RankFailed(f"a collective waited {waited} s without an answer from {peer}; run stopped", timed_out=True)


def die_with_launcher() -> None:
    """A launcher killed by SIGKILL must not leave its workers waiting in a collective (or a sweep job training on): on
    Linux the kernel ends this process once its parent is gone, even while stopped; elsewhere a thread does."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    launcher = multiprocessing.parent_process()
    if launcher is None:
        return
    if not launcher.is_alive():  # it was gone before the watch began
        os._exit(1)
    threading.Thread(target=lambda: (launcher.join(), os.kill(os.getpid(), signal.SIGKILL)), name="launcher-watch",
                     daemon=True).start()
