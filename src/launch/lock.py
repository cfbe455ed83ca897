"""One writer per run folder and per sweep folder: a lock the kernel releases when the process ends however it ends
(docs/reliability.md says what this does on NFS and Lustre)."""

import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from src.errors import UsageError
from src.folders import open_file, remove

log = logging.getLogger(__name__)
LOCK = ".lock"
# What a filesystem without locks answers (some NFS mounts, Lustre without `-o flock`): there the folder goes unlocked.
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def acquire(folder: Path, what: str) -> int | None:
    """The lock file's descriptor; a folder another process holds is one line naming it."""
    folder.mkdir(parents=True, exist_ok=True)
    while True:
        fd = open_lock(folder / LOCK)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise UsageError(f"{folder} is in use: {holder} is writing this {what}; wait for it to end, or stop "
                                 "it first (one writer per folder)") from None
            if error.errno in NO_LOCKS:
                log.warning(f"{folder}: this filesystem takes no locks ({error.strerror}); nothing keeps a second writer out")
                return None
            raise
        if _same_file(fd, folder / LOCK):  # else its holder removed it as we opened it: lock the new one
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def open_lock(path: Path) -> int:
    """The lock file, never through a link (its holder line would overwrite the link's target), a FIFO (it blocks) or
    a second name of another file (a hard link)."""
    return open_file(path, os.O_RDWR | os.O_CREAT, root=path.parent)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


_holding: set[str] = set()  # folders this process holds: a sweep's command and its launcher both ask


@contextmanager
def held(folder: Path, what: str = "run") -> Iterator[None]:
    """`folder` locked while the block runs (already, where this process holds it); then its lock file goes (a
    writer that ended otherwise leaves it, unlocked)."""
    key = os.path.abspath(folder)
    if key in _holding:
        yield
        return
    fd = acquire(folder, what)
    _holding.add(key)
    try:
        yield
    finally:
        _holding.discard(key)
        if fd is not None:
            if _same_file(fd, folder / LOCK):
                remove(folder / LOCK)
            os.close(fd)
