"""The boundary of a run folder held for inputs nobody listed: commands run in this process under `tests.sandbox`,
which sees every write, removal, rename, folder, link and process, on folders whose records Hypothesis rewrites
(`SANDBOX_EXAMPLES=<n>` for a longer search; the suite's is short and seeded)."""

import os
import subprocess
from unittest import mock
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.helpers import QUICK, train_here
from tests.sandbox import Sandbox, sandbox

EXAMPLES = int(os.environ.get("SANDBOX_EXAMPLES", "6"))
CANARY = "SANDBOX_CANARY_VALUE"


def test_the_sandbox_sees_writes_removals_links_and_processes_outside_and_nothing_inside(tmp_path):
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir(), outside.mkdir()
    (inside / "link").symlink_to(outside / "target")
    (outside / "old").write_text("")
    with sandbox(inside) as box:
        (inside / "file").write_text("x")
        (inside / "sub").mkdir()
        (inside / "file").unlink()
        (outside / "written").write_text("x")
        (inside / "link").write_text("through the link")
        (outside / "old").unlink()
        os.rename(inside / "sub", outside / "sub")
        subprocess.run(["true"], check=True)
        import tabnanny  # noqa: F401  a module nothing here imports
    assert [line.split()[0] for line in box.outside] == ["open", "open", "os.remove", "os.rename"]
    assert box.outside[1].startswith(f"open {inside / 'link'}")
    assert len(box.processes) == 1 and box.processes[0].startswith("subprocess.Popen")
    assert "tabnanny" in box.imports


# What a record's value may become: traversal, resolvers, escapes, look-alikes, control characters, huge and
# wrong-typed values.
NASTY = st.one_of(
    st.sampled_from(["../../x", "/../../x", "${oc.env:SANDBOX_CANARY}", "$\\{oc.env:SANDBOX_CANARY\\}", "\\x1b[2J",
                     "${claim_dir:/tmp/x}", "\uff04{oc.env:SANDBOX_CANARY}", "a\nb", "x" * 5000, "[a,b]", "{a: 1}",
                     "null", "-1", "1e308", "true", "'quoted'", "range(0,300000000)"]),
    st.text(max_size=20))


def add_swept(overrides: list[str], index: int, value: str) -> None:
    """One more override line for a key the record holds, with `value`."""
    overrides.append(f"{overrides[index % len(overrides)].partition('=')[0]}={value}")


def rewrite_line(path: Path, index: int, value: str) -> None:
    """A YAML file's line `key: ...` (the `index`-th, counting round) given `value` instead, as YAML writes it."""
    text = path.read_text().splitlines()
    at = index % len(text)
    key, colon, _ = text[at].partition(":")
    text[at] = f"{key}: {yaml.safe_dump(value).strip()}" if colon else text[at]
    path.write_text("\n".join(text) + "\n")


def rewrite_record(path: Path, added: bool, index: int, value: str) -> None:
    """A sweep's `multirun.yaml` with a swept value `added` to a key it holds, or a line of it rewritten."""
    if added:
        data = yaml.safe_load(path.read_text())
        add_swept(data["hydra"]["overrides"]["task"], index, value)
        path.write_text(yaml.safe_dump(data))
    else:
        rewrite_line(path, index, value)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_root):
    """A finished quick run that logs to TensorBoard and CSV, on which each entry point has run once as it is
    (`entry`): what a clean run imports is imported."""
    import shutil

    run_dir = tmp_path_factory.mktemp("sandboxed") / "run"
    result = train_here(*QUICK, "logger=[tensorboard,csv]", f"hydra.run.dir={run_dir}")  # csv: files of fixed names
    assert result.returncode == 0, result.stderr[-2000:]
    for command in COMMANDS:
        warm = Path(shutil.copytree(run_dir, tmp_path_factory.mktemp("warm") / "run"))
        assert entry(command, warm)[0].returncode == 0
    return run_dir


COMMANDS = ("last", "auto", "longer", "eval", "report", "scaling")  # longer: a resume that trains on


def entry(command: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """One entry point on the folder, in this process, and the folder it may write in (and, under the sandbox, its
    temporary folder)."""
    from src.report import main as report_main
    from src.scaling.predict import main as scaling_main
    from tests.helpers import DATA_ROOT, call_main, command_here

    if command == "eval":
        scored = run_dir.parent / "eval"
        return command_here("src.eval", f"data.root={DATA_ROOT}", f"ckpt_path={run_dir}", f"hydra.run.dir={scored}",
                            "trainer.enable_progress_bar=false"), scored
    if command == "report":
        return call_main(report_main, str(run_dir.parent)), run_dir.parent
    if command == "scaling":  # its DDP timing's processes are the slow tier's: here the figures it estimates
        with mock.patch("src.scaling.stepclock.start_ranks", side_effect=RuntimeError("timed in the slow tier")):
            return call_main(scaling_main, str(run_dir)), run_dir
    if command == "longer":
        return train_here(*QUICK, "ckpt_path=last", "max_epochs=2", f"hydra.run.dir={run_dir}"), run_dir
    return train_here(*QUICK, f"ckpt_path={command}", f"hydra.run.dir={run_dir}"), run_dir


def sandboxed(command: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, Sandbox]:
    """`entry` under the sandbox, allowed its own folder and temporary files; it finished or said one line."""
    allowed = run_dir.parent / "eval" if command == "eval" else run_dir.parent if command == "report" else run_dir
    with sandbox(allowed) as box:
        result, _ = entry(command, run_dir)
    assert result.returncode in (0, 2), result.stderr[-2000:]
    if result.returncode == 2:
        errors = [line for line in result.stderr.strip().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr[-2000:]
    return result, box


@seed(74)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(record=st.sampled_from(["overrides", "config"]), index=st.integers(0, 400), value=NASTY,
       command=st.sampled_from(COMMANDS))
def test_a_command_on_a_folder_whose_records_were_rewritten_stays_inside_it(tmp_path_factory, finished_run,
                                                                             monkeypatch, record, index, value, command):
    """Each value of a finished run's overrides.yaml or config.yaml rewritten: a resume (`ckpt_path=last|auto`, and one
    that trains on), `src.eval` and `src.scaling` of the folder and `src.report` of the folder above it finish or are
    refused in one line, write only in their own folder, start no process, and print no variable's value."""
    import shutil

    run_dir = Path(shutil.copytree(finished_run, tmp_path_factory.mktemp("case") / "run"))
    path = run_dir / (".hydra/overrides.yaml" if record == "overrides" else "config.yaml")
    if record == "overrides":
        lines = yaml.safe_load(path.read_text())
        add_swept(lines, index, value)
        path.write_text(yaml.safe_dump(lines))
    else:
        rewrite_line(path, index, value)
    monkeypatch.setenv("SANDBOX_CANARY", CANARY)
    result, box = sandboxed(command, run_dir)
    assert box.outside == [] and box.processes == []
    assert box.imports == []  # each entry ran on the folder as it was first (`warmed`): a record adds no module
    assert CANARY not in result.stdout + result.stderr


def changed_kind(path: Path, kind: str, outside: Path) -> None:
    """`path` (a file or a folder of the run) made into something else: a link to a file outside, a second name of
    that file (a hard link), a FIFO, a folder, or (a folder) a file."""
    import shutil

    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    if kind == "link out":
        path.symlink_to(outside)
    elif kind == "hard link":
        os.link(outside, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_text("not what was here\n")


@seed(75)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(index=st.integers(0, 400), kind=st.sampled_from(["link out", "hard link", "fifo", "folder", "file"]),
       command=st.sampled_from(COMMANDS))
def test_a_command_on_a_folder_whose_files_changed_kind_stays_inside_it(tmp_path_factory, finished_run, monkeypatch,
                                                                         index, kind, command):
    """Any file or folder of a finished run (a record, a checkpoint, the log, the lock, an event file, `.hydra/`,
    `checkpoints/`) made a link out, a hard link to a file outside, a FIFO, a folder or a file: each command finishes
    or is refused in one line, never blocks, writes only in its own folder, and leaves the file outside as it was."""
    import shutil

    case = tmp_path_factory.mktemp("kind")
    run_dir = Path(shutil.copytree(finished_run, case / "run"))
    outside = case / "outside.txt"
    outside.write_text("the user's own file\n")
    entries = sorted(run_dir.rglob("*"))
    changed_kind(entries[index % len(entries)], kind, outside)
    result, box = sandboxed(command, run_dir)
    assert box.outside == [] and box.processes == []
    assert outside.read_text() == "the user's own file\n"


SWEEPS = {"sweep": ["seed=1"], "search": ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=1", "optim.lr=interval(0.01, 0.1)"]}


def resume_sweep(folder: Path) -> subprocess.CompletedProcess:
    """The sweep's resume as its line says it (`-m hydra.sweep.dir=<sweep> ckpt_path=auto`), in this process: what it
    sweeps and how come from its `multirun.yaml`."""
    return train_here("-m", *QUICK, f"hydra.sweep.dir={folder}", "ckpt_path=auto")


@pytest.fixture(scope="module")
def finished_sweeps(tmp_path_factory, data_root) -> dict[str, Path]:
    """A finished sequential sweep of one job and a finished search of one trial, each resumed once as it is."""
    found = {}
    for kind, args in SWEEPS.items():
        folder = tmp_path_factory.mktemp(kind) / "sweep"
        result = train_here("-m", *QUICK, *args, f"hydra.sweep.dir={folder}")
        assert result.returncode == 0, result.stderr[-2000:]
        assert resume_sweep(folder).returncode == 0
        found[kind] = folder
    return found


@seed(76)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(sorted(SWEEPS)), added=st.booleans(), index=st.integers(0, 400), value=NASTY)
def test_a_sweep_or_search_whose_record_was_rewritten_resumes_inside_it(tmp_path_factory, finished_sweeps, monkeypatch,
                                                                         kind, added, index, value):
    """A line of a finished sweep's or search's `multirun.yaml` rewritten, or a swept value added: its resume finishes
    or is refused in one line, writes only in the sweep's folder, starts no process, imports nothing new and prints
    no variable's value."""
    import shutil

    folder = Path(shutil.copytree(finished_sweeps[kind], tmp_path_factory.mktemp("case") / "sweep"))
    rewrite_record(folder / "multirun.yaml", added, index, value)
    monkeypatch.setenv("SANDBOX_CANARY", CANARY)
    with sandbox(folder) as box:
        result = resume_sweep(folder)
    assert result.returncode in (0, 1, 2), result.stderr[-2000:]  # 1: a job failed alone, its line said
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("error: ")]
    assert result.returncode == 0 or errors and result.stderr.strip().endswith(errors[-1]), result.stderr[-2000:]
    assert box.outside == [] and box.processes == [] and box.imports == []
    assert CANARY not in result.stdout + result.stderr


def tree(folder: Path, leaving: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder` but those under `leaving`, by its name, size and change time."""
    return {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in folder.rglob("*")
            if not p.is_relative_to(leaving)}


@pytest.fixture(scope="module")
def finished_parallel_sweep(tmp_path_factory, data_root) -> Path:
    folder = tmp_path_factory.mktemp("parallel") / "sweep"
    result = train_here("-m", *QUICK, "hydra/launcher=parallel", "seed=1", f"hydra.sweep.dir={folder}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert resume_sweep(folder).returncode == 0
    return folder


@pytest.mark.slow  # the parallel launcher's jobs are processes
@seed(77)
@settings(max_examples=max(3, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck))
@given(added=st.booleans(), index=st.integers(0, 400), value=NASTY)
def test_a_parallel_sweep_whose_record_was_rewritten_resumes_inside_it(tmp_path_factory, finished_parallel_sweep,
                                                                        monkeypatch, added, index, value):
    """The same under the parallel launcher, whose jobs are processes the sandbox does not see into: besides what the
    sandbox sees of this process, nothing appears or changes outside the sweep's folder in the case's folder."""
    import shutil

    case = tmp_path_factory.mktemp("case")
    folder = Path(shutil.copytree(finished_parallel_sweep, case / "sweep"))
    rewrite_record(folder / "multirun.yaml", added, index, value)
    monkeypatch.setenv("SANDBOX_CANARY", CANARY)
    before = tree(case, folder)
    with sandbox(folder) as box:
        result = resume_sweep(folder)
    assert result.returncode in (0, 1, 2), result.stderr[-2000:]
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("error: ")]
    assert result.returncode == 0 or errors and result.stderr.strip().endswith(errors[-1]), result.stderr[-2000:]
    assert box.outside == [] and tree(case, folder) == before
    assert all("multiprocessing" in line or "Popen" in line for line in box.processes)  # the launcher's own workers
    assert CANARY not in result.stdout + result.stderr
