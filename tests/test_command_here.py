"""`command_here`: a command run in the test process starts as a new process of it would, shows its warnings as that
process shows them, and leaves the test process as it found it."""

import logging
import random
import warnings

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from src import config
from src.launch import cli, naming
from tests.helpers import QUICK, WARNING_LINE, command_here, process_state, put_back


def changed(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """Where two `process_state`s differ: each part, or each entry of a part that is a table (a module, a logger)."""
    found = []
    for part, was in before.items():
        now = after[part]
        if isinstance(was, dict) and isinstance(now, dict):
            found += [f"{part}[{key!r}]" for key in was.keys() | now.keys() if was.get(key) != now.get(key)]
        elif now != was:
            found.append(part)
    return sorted(found)


def test_a_commands_warnings_are_on_its_stderr_under_its_own_filters(monkeypatch):
    """As `python -m` shows them: each command anew, those its modules filter (src.tasks: the logging interval) left
    out, and a DeprecationWarning outside `__main__` too, which pytest would show."""
    checked = config.check_args

    def check_args(args: list[str]) -> None:
        warnings.warn("a warning of the command's", UserWarning)
        warnings.warn("The number of training batches (1) is smaller than the logging interval Trainer(log_every_n_steps"
                      "=50).", UserWarning)
        warnings.warn("a deprecation", DeprecationWarning)
        checked(args)

    monkeypatch.setattr(config, "check_args", check_args)
    line = check_args.__code__.co_firstlineno + 1
    for _ in range(2):
        result = command_here("src.train", "--cfg", "job")
        assert result.returncode == 0, result.stderr
        assert WARNING_LINE.findall(result.stderr) == [f"{__file__}:{line}: UserWarning: a warning of the command's"]


def test_what_a_command_may_change_is_put_back():
    """Each part `command_here` puts back is one `process_state` compares."""
    tensorboard = logging.getLogger("tensorboard")  # src.runs quiets it while it reads event files
    changes = {
        "naming's claimed folders": lambda: naming._created.update({"/nowhere": []}),
        "the entry's step before its checks": lambda: setattr(cli, "_prepare", lambda cfg: None),
        "Python's random numbers": random.random, "numpy's": np.random.rand, "torch's": lambda: torch.rand(1),
        "Lightning's rank": lambda: setattr(rank_zero_only, "rank", rank_zero_only.rank + 1),
        "a logger's level": lambda: tensorboard.setLevel(tensorboard.level + 10),
        "the warning filters": lambda: warnings.filterwarnings("ignore", "nothing"),
    }
    before = process_state()
    for what, change in changes.items():
        change()
        assert changed(before, process_state()), what
        put_back(before)
        assert changed(before, process_state()) == [], what


def test_commands_in_a_row_leave_the_process_as_they_found_it(tmp_path, data_root):
    """A run refused once it is seeded, has claimed its folder (then removed it) and loaded its data; then an eval
    refused by its checks, which set the entry's step before them: the process after them is as it was, and the
    eval's output is what it is when the eval runs first."""
    run = ("src.train", *QUICK, "trainer.val_check_interval=500")
    evaluation = ("src.eval", "test_weights=bogus")
    first = command_here(*evaluation, cwd=tmp_path)
    assert first.returncode == 2 and "test_weights=bogus is not allowed" in first.stderr, first.stderr
    assert command_here(*run, cwd=tmp_path).returncode == 2  # once: what their first imports add stays
    before = process_state()
    refused = command_here(*run, cwd=tmp_path)
    assert refused.returncode == 2 and "trainer.val_check_interval" in refused.stderr, refused.stderr
    second = command_here(*evaluation, cwd=tmp_path)
    assert changed(before, process_state()) == []
    assert (second.returncode, second.stdout, second.stderr) == (first.returncode, first.stdout, first.stderr)
    assert not (tmp_path / "outputs").exists()
