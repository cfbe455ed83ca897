"""Folders a command creates, taken back when it fails: no empty folder is left to pass for a run or a dataset; and
files it writes there, never through a link that someone else planted."""

import io
import os
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
        raise UsageError(f"{path} is a symbolic link; a run writes only files of its own folder, never through a link: "
                         "remove the link, or use another folder")
    return path


def write_file(path: Path, data: str | bytes) -> None:
    """`data` written beside `path`, then renamed over it: a reader never sees half a file, and a symbolic link at
    `path` (to a start-up file, say) is refused in one line, never written through."""
    path = no_link(Path(path))
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def figure_bytes(figure: object, dpi: int) -> bytes:
    """A matplotlib figure as PNG bytes, for `write_file`."""
    saved = io.BytesIO()
    figure.savefig(saved, format="png", dpi=dpi)
    return saved.getvalue()
