"""Folders a command creates on its way to a result, and taking them back when it fails: a failed command
leaves no empty folder behind that could pass for a run or a dataset."""

from pathlib import Path


def missing(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what creating `path` would create."""
    path = Path(path).absolute()
    return [folder for folder in (path, *path.parents) if not folder.exists()]


def remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (deepest first) while each is empty; stop at the first that holds something."""
    for folder in folders:
        try:
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            return
