"""The one layer between the project and the files under a run, sweep or study folder, which anyone may have written:
each folder below the one a command was given is opened without following a link, a file is read or written only
where it is a regular file (written in place only where it has no second name), reads are bounded, and writes land
whole. Also the folders a command creates, taken back when it fails: no empty folder is left to pass for a run or a
dataset. `tests/test_house.py` holds the rest of `src/` to it."""

import errno
import io
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from src.errors import UsageError


def missing(path: Path) -> list[Path]:
    """What creating `path` would create, deepest first."""
    path = Path(path).absolute()
    return [folder for folder in (path, *path.parents) if not folder.exists()]


def remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return


def no_link(path: Path) -> Path:
    """`path`, refused in one line where it is a symbolic link: what a run writes there is a file of its folder."""
    if path.is_symlink():
        raise linked(path)
    return path


def linked(path: Path) -> UsageError:
    return UsageError(f"{shown(path)} is a symbolic link; a run reads and writes only files of its own folder, never "
                      "through a link: remove the link, or use another folder")


# The one link below a folder that is followed: `checkpoints/` on a scratch disk, where the user made the link and
# owns what it points to (docs/security.md).
USER_LINKS = ("checkpoints",)


def open_folder(root: Path, path: Path, create: bool = False) -> int:
    """A descriptor of folder `path`, reached from `root` (the folder a command was given; links above it are the
    user's) one folder at a time without following a link, `create`d where missing. `path` outside `root`: from its
    own parent."""
    root, path = Path(os.path.abspath(root)), Path(os.path.abspath(path))
    if not path.is_relative_to(root):
        root = path.parent
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for at, part in enumerate(path.relative_to(root).parts):
            if create:
                with suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as error:
                here = root.joinpath(*path.relative_to(root).parts[:at + 1])
                if error.errno not in (errno.ELOOP, errno.ENOTDIR) or not here.is_symlink():
                    raise
                if not (part in USER_LINKS and users(here)):
                    raise linked(here) from None
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_below(root: Path, path: Path) -> None:
    """Refused in one line where `path`, or a folder between `root` and it, is a link; nothing where it is missing."""
    if os.path.lexists(path):
        os.close(open_folder(root, path))


def check_in_place(path: Path, root: Path) -> None:
    """Where a library will write `path` by its name (Lightning's CSV logger): nothing there, or a regular file of one
    name, reached from `root` without a link; else one line, before the library opens it (a FIFO would block it, a
    link or a second name carry its writes elsewhere)."""
    if os.path.lexists(path):
        os.close(own_file(open_file(path, os.O_RDONLY, root), path, writing=True))
    else:
        check_below(root, Path(path).parent)


def users(link: Path) -> bool:
    """A link the user made to a folder the user owns."""
    return os.lstat(link).st_uid == os.getuid() == os.stat(link).st_uid


def own_file(fd: int, path: Path, writing: bool) -> int:
    """`fd`, where it is a regular file (a FIFO blocks, a device floods) and, to write, its only name (a hard link
    would carry the writes to another file); else closed, and one line."""
    info = os.fstat(fd)
    why = ("not a regular file" if not stat.S_ISREG(info.st_mode)
           else f"a file with {info.st_nlink} names (hard links)" if writing and info.st_nlink > 1 else None)
    if why:
        os.close(fd)
        raise UsageError(f"{shown(path)} is {why}; a run reads and writes only files of its own folder: remove it")
    return fd


def open_file(path: Path, flags: int, root: Path | None = None, mode: int = 0o644) -> int:
    """`path` opened below `root` (`open_folder`), never through a link, and only where `own_file` holds."""
    path = Path(path)
    folder = open_folder(root or path.parent, path.parent, create=bool(flags & os.O_CREAT))
    try:
        fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=folder)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise linked(path) from None
        raise
    finally:
        os.close(folder)
    return own_file(fd, path, writing=bool(flags & (os.O_WRONLY | os.O_RDWR)))


def read_bytes(path: Path, limit: int, root: Path | None = None) -> bytes:
    """A file's bytes, at most `limit` (more is one line), never through a link below `root`."""
    with os.fdopen(open_file(path, os.O_RDONLY, root), "rb") as file:
        size = os.fstat(file.fileno()).st_size  # a file larger already is not read at all
        data = file.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit // 2**20} MiB", str(path))
    return data


@contextmanager
def copied(folder: Path, pattern: str, limit: int) -> Iterator[Path]:
    """A temporary folder holding the files of `folder` that match `pattern`, each read as `read_bytes` reads (no link,
    no FIFO), at most `limit` bytes in all: for a library that reads files by their path (TensorBoard's readers)."""
    with tempfile.TemporaryDirectory(prefix="copied-") as copy:
        left = limit
        for path in sorted(Path(folder).glob(pattern)):
            data = read_bytes(path, left, root=folder)
            left -= len(data)
            write_file(Path(copy) / path.name, data)
        yield Path(copy)


def write_file(path: Path, data: str | bytes | memoryview, root: Path | None = None, durable: bool = False) -> None:
    """`data` written beside `path`, then renamed over it, in the folder reached from `root` without a link: a reader
    never sees half a file, and a link at `path` or a folder between (to a start-up file, say) is refused in one
    line, never written through. `durable`: on the disk before the rename (a checkpoint outlives a power cut)."""
    path = no_link(Path(path))
    folder = open_folder(root or path.parent, path.parent, create=True)
    partial = f".{path.name}.{os.getpid()}.partial"
    try:
        with suppress(FileNotFoundError):
            os.unlink(partial, dir_fd=folder)
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                               dir_fd=folder), "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(partial, path.name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        with suppress(FileNotFoundError):
            os.unlink(partial, dir_fd=folder)
        os.close(folder)


def remove(path: Path, root: Path | None = None) -> None:
    """`path` itself, a file or a link (never what a link points to), in the folder reached from `root` without a
    link; nothing where it is gone already."""
    path = Path(path)
    try:
        folder = open_folder(root or path.parent, path.parent)
    except FileNotFoundError:
        return
    try:
        with suppress(FileNotFoundError):
            os.unlink(path.name, dir_fd=folder)
    finally:
        os.close(folder)


def remove_tree(folder: Path) -> None:
    """`folder` and what it holds. `shutil.rmtree` holds a descriptor per level; this one holds one at a time, for a
    command that failed at the limit of open files. A link is removed, never followed."""
    with suppress(OSError):
        for name in os.listdir(folder):
            path = folder / name
            if path.is_dir() and not path.is_symlink():
                remove_tree(path)
            else:
                path.unlink()
        folder.rmdir()


def shown(value: object) -> str:
    """A value read from a record, or a path, as one printable line: control characters (a newline, a terminal
    escape) escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(value))


def figure_bytes(figure: object, dpi: int) -> bytes:
    """A matplotlib figure as PNG bytes, for `write_file`."""
    saved = io.BytesIO()
    figure.savefig(saved, format="png", dpi=dpi)
    return saved.getvalue()
