"""What a person reads on the terminal: lines that start at the left edge while a progress bar shows (a tqdm bar
leaves the cursor after its last character), and counts said in words."""

import logging
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TextIO, TypeVar

from tqdm import tqdm

from src.folders import shown

Bar = TypeVar("Bar", bound=tqdm)

# The bars the project opened (src/callbacks/progress.py registers each): weak, so that a bar Lightning drops is gone.
shown_bars: weakref.WeakSet[tqdm] = weakref.WeakSet()


def register(bar: Bar) -> Bar:
    """`bar`, listed from now on among the bars on screen while it is open; tqdm keeps no public list of them."""
    shown_bars.add(bar)
    return bar


def open_progress_bars() -> list[tqdm]:
    """The registered progress bars on screen, the innermost first; never a closed or disabled one."""
    bars = [bar for bar in list(shown_bars) if not bar.disable]
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
    """`error: <message>` on stderr, on a line of its own, its control characters escaped (it may quote a record or a
    folder's name): the main thread closes the bars first."""
    if in_main_thread():
        close_progress_bars()
    write_line(f"error: {shown(message)}", sys.stderr)


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


class KeptWarnings(logging.Handler):
    """In place of the console while a sweep's job runs in this process: its warnings and errors, one line each, for
    the line that ends the job."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname.lower()}: {' '.join(record.getMessage().split())}")


# Set while a sweep's job runs in this process: its lines go to its log files alone (`lines_to_files`).
in_files: KeptWarnings | None = None


@contextmanager
def lines_to_files() -> Iterator[KeptWarnings]:
    """The log lines logged inside go to the root logger's files alone (a job's `train.log`), its warnings kept: a
    sweep's terminal says each job in two lines, however much the job logs. The console's handlers are back after."""
    global in_files
    root = logging.getLogger()
    consoles = [handler for handler in root.handlers if not isinstance(handler, logging.FileHandler)]
    kept, before = KeptWarnings(), in_files
    for handler in consoles:
        root.removeHandler(handler)
    root.addHandler(kept)
    in_files = kept
    try:
        yield kept
    finally:
        in_files = before
        root.removeHandler(kept)
        for handler in consoles:
            root.addHandler(handler)


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
