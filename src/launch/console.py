"""What a person reads on the terminal: lines that start at the left edge while a progress bar shows (a tqdm bar
leaves the cursor after its last character), and counts said in words."""

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TextIO

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
        with suppress(Exception):  # the terminal may be gone (SIGHUP): the line that follows matters more
            bar.close()


def in_main_thread() -> bool:
    """Only the main thread may take the bars' lock: another (the stop watcher) would wait on a stuck main thread."""
    return threading.current_thread() is threading.main_thread()


def write_line(text: str, stream: TextIO) -> None:
    """`text` above the progress bars (tqdm clears them, writes it and draws them again), or after a newline from
    another thread."""
    bars = open_progress_bars()
    if bars and in_main_thread():
        tqdm.write(text, file=stream)
        stream.flush()
    else:
        print(f"\n{text}" if bars else text, file=stream, flush=True)


def print_error(message: str) -> None:
    """`error: <message>` on stderr, on a line of its own: the main thread closes the bars first."""
    if in_main_thread():
        close_progress_bars()
    write_line(f"error: {message}", sys.stderr)


def print_line(message: str) -> None:
    write_line(message, sys.stdout)


class ConsoleHandler(logging.StreamHandler):
    """Hydra's console log handler, printing above the progress bars, so that a line does not continue a bar's."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record), self.stream)
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
