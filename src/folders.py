"""Folders a command creates, taken back when it fails: no empty folder is left to pass for a run or a dataset."""

from pathlib import Path


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
