"""The one layer for files under a run, sweep or study folder (`src.folders`): every folder between the given one and
a file is opened without following a link, a file is read or written only where it is a regular file, written only
where it is its only name, and read only up to a bound. Properties over generated folders, then the callers that
pass through it."""

import logging
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from src import records
from src.errors import UsageError
from src.folders import open_file, read_bytes, write_file
from src.launch import lock, naming
from src.launch.optuna_sweeper import DB, OptunaSweeper
from tests.sandbox import sandbox

SECRET = "aws_secret_access_key = not-to-be-printed"
# What a name below the folder may be instead of a folder or file of its own.
PLANTED = ["link_out", "link_in", "hard_link", "fifo", "folder", "file", None]


def plant(kind: str | None, at: Path, outside: Path) -> None:
    """`at` made as `kind`: a link out of the folder or to a file inside it, a hard link to a file outside, a FIFO."""
    at.parent.mkdir(parents=True, exist_ok=True)
    target = outside / ("dir" if at.suffix == "" else "secret.txt")
    if kind == "link_out":
        at.symlink_to(target)
    elif kind == "link_in":
        (at.parent / "real").mkdir(exist_ok=True) if at.suffix == "" else (at.parent / "real").write_text("x")
        at.symlink_to(at.parent / "real")
    elif kind == "hard_link" and at.suffix:
        os.link(outside / "secret.txt", at)
    elif kind == "fifo":
        os.mkfifo(at)
    elif kind == "folder":
        at.mkdir()
    elif kind == "file" and at.suffix:
        at.write_text("own")


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.sampled_from(["a", ".hydra", "checkpoints", "report"]), min_size=0, max_size=3),
       name=st.sampled_from(["config.yaml", "result.json", ".lock", "x.out"]),
       kinds=st.lists(st.sampled_from(PLANTED), min_size=4, max_size=4), write=st.booleans())
def test_a_file_below_the_folder_is_its_own_or_one_line(tmp_path_factory, parts, name, kinds, write):
    """Whatever stands at each name between the folder and a file, a write or read through the layer touches
    nothing outside the folder, never reads outside it, never blocks, or is refused in one line."""
    base = tmp_path_factory.mktemp("layer")
    root, outside = base / "run", base / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.txt").write_text(SECRET)
    root.mkdir()
    path = root.joinpath(*parts, name)
    for kind, at in zip(kinds, [root.joinpath(*parts[:i + 1]) for i in range(len(parts))] + [path]):
        if os.path.islink(at.parent) or at.parent.exists() and not at.parent.is_dir():
            break  # nothing is made through a link, nor below a file
        if not os.path.lexists(at):
            plant(kind, at, outside)
    # `checkpoints/` linked by the user to a folder of the user's is followed (the test's links are the user's)
    scratch = [outside / "dir"] * any(part == "checkpoints" and root.joinpath(*parts[:at + 1]).is_symlink()
                                      for at, part in enumerate(parts))
    with sandbox(root, *scratch) as box:
        try:
            if write:
                write_file(path, "written", root=root)
            else:
                data = read_bytes(path, 1000, root=root)
                assert SECRET.encode() not in data or os.stat(path).st_nlink > 1  # a second name is not a link out
        except UsageError as refused:
            assert "\n" not in str(refused) and SECRET not in str(refused)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            pass  # nothing there to read, or a file where a folder is asked for: an OSError the caller words
    assert box.outside == []
    assert (outside / "secret.txt").read_text() == SECRET and (scratch or list((outside / "dir").iterdir()) == [])


def test_a_user_link_to_checkpoints_on_scratch_is_followed(tmp_path):
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir(), run.mkdir()
    (run / "checkpoints").symlink_to(scratch)
    write_file(run / "checkpoints" / "note.txt", "kept", root=run)
    assert (scratch / "note.txt").read_text() == "kept"
    (run / "other").symlink_to(scratch)
    with pytest.raises(UsageError, match="other is a symbolic link"):
        write_file(run / "other" / "note.txt", "x", root=run)


def test_a_record_linked_to_a_credentials_file_is_refused_without_quoting_it(tmp_path):
    """An overrides.yaml linked to a credentials file printed its key in the refusal line."""
    (tmp_path / "secret").write_text(f"- {SECRET}\n")
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").symlink_to(tmp_path / "secret")
    with pytest.raises(UsageError) as refused:
        records.load(run / ".hydra" / "overrides.yaml", root=run)
    assert str(refused.value).startswith(f"{run / '.hydra' / 'overrides.yaml'} is a symbolic link;")
    assert "not-to-be-printed" not in str(refused.value)


def test_a_refused_record_quotes_a_bounded_value(tmp_path):
    with pytest.raises(UsageError) as refused:
        records.settings([f"seed=${{{'x' * 5000}}}"], tmp_path / "overrides.yaml")
    assert len(str(refused.value)) < 600 and "x" * 81 not in str(refused.value)


def test_a_lock_or_log_with_a_second_name_is_refused_and_left_as_it_was(tmp_path):
    """`.lock` and `train.log` hard-linked to a file elsewhere were truncated and appended to."""
    elsewhere, run = tmp_path / "elsewhere.txt", tmp_path / "run"
    elsewhere.write_text(SECRET)
    run.mkdir()
    os.link(elsewhere, run / lock.LOCK)
    with pytest.raises(UsageError, match=r"\.lock is a file with 2 names \(hard links\)"):
        lock.acquire(run, "run")
    assert elsewhere.read_text() == SECRET
    os.unlink(run / lock.LOCK)
    os.link(elsewhere, run / "train.log")
    handler = logging.FileHandler(run / "train.log")
    logging.root.addHandler(handler)
    try:
        with pytest.raises(UsageError, match=r"train\.log is a file with 2 names"):
            naming.check_own_logs(run)
        assert handler not in logging.root.handlers
    finally:
        logging.root.removeHandler(handler)
        handler.close()
    assert elsewhere.read_text() == SECRET


def test_a_linked_study_is_refused_before_it_is_opened(tmp_path):
    """`optuna.db` linked to another study: a new trial went into that study."""
    from tests.test_optuna_sweeper import SETTINGS
    other = tmp_path / "other.db"
    other.write_bytes(b"")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / DB).symlink_to(other)
    sweeper = OptunaSweeper(**SETTINGS)
    sweeper.config = OmegaConf.create({"ckpt_path": "auto"})
    with pytest.raises(UsageError, match=rf"{DB} is a symbolic link"):
        sweeper.open_study(sweep)
    assert other.read_bytes() == b""


@pytest.mark.parametrize("below", ["report", ".parallel", "lenet_auto_1dev_32-true_seed=1"])
def test_a_sweeps_own_folder_that_is_a_link_is_refused(tmp_path, below):
    """A job folder, `<sweep>/report` or `<sweep>/.parallel` that is a link was written through."""
    from src.folders import check_below, open_folder

    elsewhere, sweep = tmp_path / "elsewhere", tmp_path / "sweep"
    elsewhere.mkdir(), sweep.mkdir()
    (sweep / below).symlink_to(elsewhere)
    with pytest.raises(UsageError, match=f"{below} is a symbolic link"):
        check_below(sweep, sweep / below)
    with pytest.raises(UsageError, match=f"{below} is a symbolic link"):
        open_file(sweep / below / "x.out", os.O_WRONLY | os.O_CREAT, root=sweep)
    with pytest.raises(UsageError):
        open_folder(sweep, sweep / below, create=True)
    assert list(elsewhere.iterdir()) == []
