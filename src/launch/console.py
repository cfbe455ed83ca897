"""What a person reads on the terminal: lines that start at the left edge while a progress bar shows,
and counts said in words.

A tqdm bar leaves the cursor after its last character, so a line printed while one shows would
continue the bar's line.
"""

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


def open_progress_bars() -> list[tqdm]:
    """The progress bars on screen, the innermost (highest position) first. A disabled bar is never listed."""
    # tqdm lists its open bars only in this private set (its own `write` reads it); Lightning's bars are
    # its own too. Without the set no bar is listed: lines are still printed, maybe after a bar.
    bars = [bar for bar in list(getattr(tqdm, "_instances", ())) if not getattr(bar, "disable", True)]
    return sorted(bars, key=lambda bar: -abs(getattr(bar, "pos", 0)))


def close_progress_bars() -> None:
    """Close the bars on screen. A bar that stays (the epoch's) keeps its last state and ends its line;
    one that goes (validation's) is cleared. Later closes by Lightning or at exit do nothing, so no bar
    is drawn again below what is printed next."""
    for bar in open_progress_bars():
        try:
            bar.close()
        except Exception:  # the terminal may be gone (SIGHUP): the line that follows matters more
            pass


def _may_take_the_bars_lock() -> bool:
    """Only the main thread, which draws the bars: another thread (the stop watcher) must not wait for
    their lock, which a stuck main thread may hold."""
    return threading.current_thread() is threading.main_thread()


def print_error(message: str) -> None:
    """`error: <message>` on stderr, on a line of its own even while a progress bar shows: the main
    thread closes the bars first, another thread starts the line with a newline instead."""
    if _may_take_the_bars_lock():
        close_progress_bars()
        fresh = ""
    else:
        fresh = "\n" if open_progress_bars() else ""
    print(f"{fresh}error: {message}", file=sys.stderr, flush=True)


def print_line(message: str) -> None:
    """A line on stdout that starts at the left edge: above the progress bars while any shows (tqdm
    clears them, prints it and draws them again), and from another thread after a newline."""
    bars = open_progress_bars()
    if bars and _may_take_the_bars_lock():
        tqdm.write(message, file=sys.stdout)
        sys.stdout.flush()
        return
    fresh = "\n" if bars else ""
    print(f"{fresh}{message}", file=sys.stdout, flush=True)


class ConsoleHandler(logging.StreamHandler):
    """Hydra's console log handler, printing above the progress bars while any shows: tqdm clears them,
    prints the line and draws them again, so that an epoch's summary does not continue the bar's line."""

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
    """`1 run`, `2 runs`: a count with its noun in the right number, rather than `run(s)`."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def processes(count: int) -> str:
    """`1 process`, `2 processes`."""
    return counted(count, "process", "processes")


@contextmanager
def saying(what: str, after_s: float = 1.5) -> Iterator[None]:
    """`what ...` on stderr once the work inside has taken `after_s` seconds, so that a command that is slow to
    answer says what it is doing; nothing for work done sooner."""
    timer = threading.Timer(after_s, lambda: print(f"{what} ...", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
