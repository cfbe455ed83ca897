"""A sweep resumes: the same command with `hydra.sweep.dir=<its folder> ckpt_path=auto` continues a sweep that was
killed outright, its DDP workers included. Finished jobs are reported, not run again; the interrupted job resumes
from its newest checkpoint and ends with the weights of an unbroken run; jobs that never started run from the start."""

import re
import signal
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.config import CONF_DIR
from tests.helpers import QUICK, cpu_precision, epoch_lines, train_here
from tests.test_resume import AUGMENTED, LONGER, assert_matches_unbroken, assert_same_draws, unbroken  # noqa: F401
from tests.test_stopping import Run

# Three PowerSGD DDP jobs of 2 processes with augmentation, each 3 epochs of 10 steps, a mid-epoch checkpoint every 4 steps. The
# second has the default seed: it is test_resume's unbroken DDP run, broken.
JOB = [*LONGER, *AUGMENTED, "checkpoint.every_n_train_steps=4"]
SEEDS = (1, OmegaConf.load(CONF_DIR / "train.yaml").seed, 3)
SWEEP = ["-m", *JOB, f"seed={','.join(map(str, SEEDS))}"]
JOBS = [f"lenet_ddp_powersgd_2dev_{{precision}}_seed={seed}" for seed in SEEDS]


def job_dirs(sweep: Path) -> list[Path]:
    precision = next(sweep.glob("lenet_ddp_powersgd_2dev_*_seed=1")).name.split("_")[4]
    return [sweep / job.format(precision=precision) for job in JOBS]


def settings(job: Path) -> dict:
    """A job's config as Hydra composed it (interpolations unresolved), less its seed, which tells one job of the
    sweep from another, and `ckpt_path`, which the resume's command line sets."""
    config = OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "config.yaml"))
    return {key: value for key, value in config.items() if key not in ("seed", "ckpt_path")}


def results(folder: Path) -> dict[str, int]:
    """A run's checkpoints, scalars and resolved config, by when each was written (Hydra rewrites `.hydra/` at every
    start of a job, and the job's log takes the resume's one line)."""
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and ".hydra" not in p.parts and p.name not in ("train.log", ".lock")}


@pytest.mark.slow
def test_a_sweep_killed_mid_job_resumes_and_its_interrupted_job_ends_with_the_unbroken_weights(tmp_path, unbroken):
    sweep = tmp_path / "sweep"
    # After step 17 of the second job (a step checkpoint at 16), the whole sweep is SIGKILLed from within.
    kill = ["+callbacks.fault._target_=tests.faults.KillSweepAtStep", "+callbacks.fault.step=17", f"+callbacks.fault.job='seed={SEEDS[1]}'"]
    with Run(sweep, *SWEEP, *kill, f"hydra.sweep.dir={sweep}") as run:
        assert run.wait_exit() == -signal.SIGKILL
    first, second, third = job_dirs(sweep)
    assert not third.exists()
    before, log = results(first), (first / "train.log").read_text()

    resumed = train_here(*SWEEP, *kill, f"hydra.sweep.dir={sweep}", "ckpt_path=auto")  # the jobs' ranks are processes
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert results(first) == before, "the finished job was opened again"
    added = (first / "train.log").read_text().removeprefix(log).splitlines()
    assert len(added) == 1 and "finished before, not run again: test/acc=" in added[0]
    assert resumed.stdout.count("job 1/3 skipped: ") == 1  # the terminal's one line of it; the job's own in its log
    # The interrupted job alone took up where it was (a finished fit restores the best weights to test them); the job
    # that never started ran from the start, with the settings of the job that finished before and its own seed.
    restoring = r"Restoring states from the checkpoint path at (\S+)"  # Lightning's line, in the job's log
    restored = {job: [path for path in re.findall(restoring, (job / "train.log").read_text())
                      if not Path(path).name.startswith("best-")] for job in (second, third)}
    assert restored == {second: [str(second / "checkpoints" / "step.ckpt")], third: []}
    assert_matches_unbroken(second, unbroken(*AUGMENTED))  # the job's settings in a run of its own
    assert_same_draws(second, unbroken(*AUGMENTED))
    assert [epoch for epoch, _ in epoch_lines((third / "train.log").read_text())] == [1, 2, 3]
    assert OmegaConf.load(third / "config.yaml").seed == SEEDS[2] and settings(third) == settings(first)
    assert all(job.name in (sweep / "report.md").read_text() for job in (first, second, third))


def test_a_sweep_resume_with_another_sweep_is_refused_in_one_line(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    (sweep).mkdir()
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides:\n    hydra:\n    - hydra.mode=MULTIRUN\n    task:\n    - seed=1,2\n    - data.batch_size=64\n")
    for change, said in [
        ("seed=1,2,3", "seed=1,2,3 is not allowed in a resume of the sweep {sweep}: it swept seed=1,2; a resume runs "
                       "the same jobs"),
        ("model=lenet,resnet18", "model=lenet,resnet18 is not allowed in a resume of the sweep {sweep}: it did not "
                                 "sweep model"),
        ("data.batch_size=128", "data.batch_size=128 is not allowed in a resume of the sweep {sweep}: its jobs used "
                                "data.batch_size=64"),
    ]:
        result = train_here("-m", change, f"hydra.sweep.dir={sweep}", "ckpt_path=auto")
        assert result.returncode == 2
        assert result.stderr.strip().splitlines()[-1].startswith("error: " + said.format(sweep=sweep)), result.stderr
        assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


def test_a_shuffled_sweep_resumes_each_job_in_its_own_folder_whatever_order_it_draws(tmp_path, data_root):
    """`shuffle()` numbers a sweep's jobs anew at each command: a job's folder is named and found by its values, so a
    resume, as recorded or with the values typed in another order, finds each job's folder; other values are refused."""
    sweep = tmp_path / "sweep"
    first = train_here("-m", *QUICK, "seed=shuffle(1,2,3)", f"hydra.sweep.dir={sweep}")
    assert first.returncode == 0, first.stderr[-3000:]
    jobs = [f"lenet_auto_1dev_{cpu_precision()}_seed={seed}" for seed in (1, 2, 3)]
    assert sorted(p.parent.name for p in sweep.glob("*/result.json")) == jobs
    for typed in ([], ["seed=3,1,2"]):
        again = train_here("-m", QUICK[0], *typed, f"hydra.sweep.dir={sweep}", "ckpt_path=auto")
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"sweep of 3 jobs: 0 done, 0 resumed, 3 skipped, 0 failed; report: {sweep / 'report.md'}" in again.stdout
        assert sorted(p.parent.name for p in sweep.glob("*/result.json")) == jobs
    other = train_here("-m", QUICK[0], "seed=1,2", f"hydra.sweep.dir={sweep}", "ckpt_path=auto")
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1].startswith(
        f"error: seed=1,2 is not allowed in a resume of the sweep {sweep}: it swept seed=3,1,2"), other.stderr  # as last typed


def test_a_sweep_whose_record_holds_a_function_the_reader_does_not_read_resumes_with_it_typed_again(tmp_path):
    """`sort()` is not read from a record: the resume is one line that says to type it again, and with it typed again
    the command's line is used and the record's is not read."""
    from src import resume
    from src.errors import UsageError

    (tmp_path / "multirun.yaml").write_text("hydra:\n  overrides:\n    hydra: []\n    task:\n    - seed=sort(3,1,2)\n")
    with pytest.raises(UsageError) as refused:
        resume.with_record(["-m", f"hydra.sweep.dir={tmp_path}", "ckpt_path=auto"])
    assert str(refused.value).startswith(f"{tmp_path / 'multirun.yaml'}: seed=sort(3,1,2) is not allowed in a run's "
                                         "records; its value must be")
    assert str(refused.value).endswith("type seed=... as the sweep had it again to resume it")
    typed = ["-m", "seed=sort(3,1,2)", f"hydra.sweep.dir={tmp_path}", "ckpt_path=auto"]
    assert resume.with_record(typed) == typed
