"""What a person reads on the terminal: lines that start at the left edge while a progress bar shows (a tqdm bar
leaves the cursor after its last character), and counts said in words."""

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


def open_progress_bars() -> list[tqdm]:
    """The progress bars on screen, the innermost first; never a disabled one."""
    # tqdm lists its open bars (Lightning's too) only in this private set, which its own `write` reads; without it
    # no bar is listed, and lines are still printed, maybe after a bar.
    bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if not getattr(bar, "disable", True)]
    return sorted(bars, key=lambda bar: -abs(getattr(bar, "pos", 0)))


def close_progress_bars() -> None:
    """A bar that stays keeps its last state and ends its line; later closes (Lightning's, at exit) draw nothing."""
    for bar in open_progress_bars():
        try:
            bar.close()
        except Exception:  # the terminal may be gone (SIGHUP): the line that follows matters more
            pass


def _may_take_the_bars_lock() -> bool:
    """Another thread (the stop watcher) must not wait for the bars' lock, which a stuck main thread may hold."""
    return threading.current_thread() is threading.main_thread()


def print_error(message: str) -> None:
    """`error: <message>` on stderr, on a line of its own: after the bars close, or a newline from another thread."""
    if _may_take_the_bars_lock():
        close_progress_bars()
        fresh = ""
    else:
        fresh = "\n" if open_progress_bars() else ""
    print(f"{fresh}error: {message}", file=sys.stderr, flush=True)


def print_line(message: str) -> None:
    """A line on stdout above the progress bars (tqdm clears them, prints it and draws them again), or after a newline
    from another thread."""
    bars = open_progress_bars()
    if bars and _may_take_the_bars_lock():
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()
        return
    fresh = "\n" if bars else ""
    print(f"{fresh}{message}", file=sys.stdout, flush=True)


class ConsoleHandler(logging.StreamHandler):
    """Hydra's console log handler, printing above the progress bars, so that a line does not continue a bar's."""

    def emit(self, record: logging.LogRecord) -> None:
        if not (open_progress_bars() and _may_take_the_bars_lock()):
            super().emit(record)
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def counted(count: int, noun: str, nouns: str | None = None) -> str:
    """`1 run`, `2 runs`, rather than `run(s)`."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def processes(count: int) -> str:
    return counted(count, "process", "processes")


@contextmanager
def saying(what: str, after_s: float = 1.5) -> Iterator[None]:
    """`what ...` on stderr once the work inside has taken `after_s` seconds: a slow command says what it is doing."""
    timer = threading.Timer(after_s, lambda: print(f"{what} ...", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
