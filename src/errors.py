"""The errors a run ends with in one `error: ...` line: the user's input, or what stopped a valid run."""

import errno
import sys
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate


class UsageError(Exception):
    """Bad option or missing input: shown as a single `error: ...` line, exit status 2."""


class ResumeRefused(UsageError):
    """A resume whose settings differ from the run's, refused before it ran anything: what it would resume is left as it
    was (a search's trial stays open for a resume that goes through)."""


class RunFailed(Exception):
    """The input was valid but the run could not go on (a full disk, no memory): one `error: ...` line, exit status 1."""


class TrainingDiverged(RunFailed):
    """The loss left the finite numbers."""


def interpreter() -> str:
    """How this Python was started, as a command to type in a fresh shell from the checkout (`.venv/bin/python`)."""
    path = Path(sys.executable)
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def missing_package(what: str, package: str) -> UsageError:
    return UsageError(f"{what} needs the {package} package, which is not installed; install it with: "
                      f"{interpreter()} -m pip install -e '.[{package}]'")


def build(group: str, node: Any, **kwargs: Any) -> Any:
    """`instantiate(node)`, with Hydra's refusal (a target that cannot be located) as the line of the group's, and a
    refusal the built class made itself (a link in the run's folder) as its own line."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, UsageError):
            raise error.__cause__ from None
        raise UsageError(f"{group}: {' '.join(str(error).split())}") from None


def said(error: BaseException) -> UsageError | RunFailed | None:
    """The machine's refusal (a full disk, too many open files, no memory, a path) as the line a user reads: a failure
    of the run, or of the input; None for any other error."""
    if isinstance(error, (UsageError, RunFailed)):
        return error
    if isinstance(error, MemoryError):
        return RunFailed("out of memory: the system refused this process more (see `ulimit -v`, or a smaller data.batch_size)")
    if not isinstance(error, OSError) or error.errno is None:
        return None
    where = f"{error.filename}: " if error.filename else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return RunFailed(f"{where}the disk is full; free space, then resume the run (its checkpoints are whole)")
    if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        return RunFailed(f"{where}{error.strerror}: a limit of the system's (see `ulimit -n`, `ulimit -v`)")
    return UsageError(f"{where}{error.strerror}") if error.filename else None
