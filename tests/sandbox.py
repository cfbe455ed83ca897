"""What a command does to the file system, which processes it starts and which modules it imports anew, seen through
Python's audit hooks
(`sys.addaudithook`): a test names the folders a command may write in, and every write, removal, rename, folder, link
or process outside them is a finding. A hook cannot be taken back, so one is added for the test process and records
only while a `Sandbox` is open."""

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Audit events that change the file system, and the positions of the paths they change.
CHANGES = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.symlink": (1,),
           "os.link": (1,), "shutil.rmtree": (0,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,)}
PROCESSES = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn")
DEVICES = ("/dev/null", "/dev/shm", "/proc/", "/dev/tty")  # what any process may open for writing


@dataclass
class Sandbox:
    """The folders a command may change; what it changed elsewhere, and the processes it started."""

    allowed: list[Path]
    outside: list[str] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)  # modules imported for the first time in this process

    def inside(self, path: object, dir_fd: object = None, follow: bool = False) -> bool:
        """Whether `path` is in an allowed folder: where a link there leads, for what follows it (`open`)."""
        name = path if isinstance(path, int) else os.fsdecode(path)
        if isinstance(name, int) or not os.path.isabs(name) and (dir_fd not in (None, -100) or os.sep not in name):
            return True  # a descriptor, or a name in a folder opened by descriptor (`open` events do not say which)
        path = os.path.abspath(name)
        where = Path(os.path.realpath(path) if follow else os.path.join(os.path.realpath(os.path.dirname(path)),
                                                                        os.path.basename(path)))
        return str(where).startswith(DEVICES) or any(where.is_relative_to(folder) for folder in self.allowed)

    def seen(self, event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
            if writes and path is not None and not self.inside(path, follow=not (flags or 0) & os.O_NOFOLLOW):
                self.outside.append(f"{event} {path} {mode or flags}")
        elif event in CHANGES:
            dir_fd = args[-1] if event != "os.rename" else None
            if event == "os.mkdir" and dir_fd in (None, -1, -100) and os.path.lexists(args[0]):
                return  # a folder that is there: the call fails and changes nothing (`mkdir(parents=True)` tries each)
            for index in CHANGES[event]:
                if not self.inside(args[index], dir_fd):
                    self.outside.append(f"{event} {args[index]}")
        elif event.startswith(PROCESSES):
            self.processes.append(f"{event} {args[:2]}")
        elif event == "import" and args[0] not in sys.modules:
            self.imports.append(args[0])


_open: list[Sandbox] = []


def _hook(event: str, args: tuple) -> None:
    if _open:
        _open[-1].seen(event, args)


sys.addaudithook(_hook)


@contextmanager
def sandbox(*allowed: Path) -> Iterator[Sandbox]:
    """Records what the code in the block changes outside `allowed` (resolved: a link to elsewhere is elsewhere) and
    a temporary folder of its own, which is `tempfile`'s in the block."""
    temporary = tempfile.mkdtemp(prefix="sandbox-")
    box = Sandbox([Path(os.path.realpath(folder)) for folder in (*allowed, temporary)])
    saved, tempfile.tempdir = tempfile.tempdir, temporary
    _open.append(box)
    try:
        yield box
    finally:
        _open.remove(box)
        tempfile.tempdir = saved
        shutil.rmtree(temporary, ignore_errors=True)
