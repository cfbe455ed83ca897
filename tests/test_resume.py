"""Checkpoints and resuming: `last.ckpt` is always the last finished epoch, a DDP run killed with
SIGKILL resumes to exactly the weights of an unbroken run, with no TensorBoard step twice (a run of
one process, killed at each point of its life: tests/test_resume_exact.py)."""

import hashlib
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning import Callback
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from src.data.fashion_mnist import augment
from tests.helpers import (QUICK, REPO, Run, free_port, scalar_steps, scalars, steps_going_back, train_here,
                           trained_once, user_env)

# Ten batches an epoch, three epochs; the fault callback kills a process after a given step.
LONGER = [*QUICK, "max_epochs=3", "trainer.limit_train_batches=10", "data.batch_size=128", "optim.momentum=0.9"]


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(run: Path, reference: Path) -> None:
    ours, theirs = load(run / "checkpoints" / "last.ckpt")["state_dict"], load(reference / "checkpoints" / "last.ckpt")["state_dict"]
    assert ours.keys() == theirs.keys()
    different = [name for name in ours if not torch.equal(ours[name], theirs[name])]
    assert not different, f"tensors that differ from the unbroken run: {different}"


# DDP times a sample of its steps (the first ten, every hundredth), counted from its own start, which a resumed run's
# DDP makes anew: those figures sit at the steps each run's DDP timed (docs/communication.md).
DDP_SAMPLED = ("xfer/backward_compute_ms", "xfer/backward_comm_ms", "xfer/overlap_ms", "xfer/overlap_frac")


def assert_same_tensorboard_steps(run: Path, reference: Path) -> None:
    ours, theirs = scalar_steps(run), scalar_steps(reference)
    # The epoch goes with every row written, the DDP-sampled ones too: each run has it at the same steps, not as often.
    assert set(ours.pop("trainer/epoch")) == set(theirs.pop("trainer/epoch"))
    for tag, series in ours.items():
        assert len(series) == len(set(series)), f"{tag} has a step twice: {series}"
    assert {tag: steps for tag, steps in ours.items() if not tag.startswith(DDP_SAMPLED)} == \
        {tag: steps for tag, steps in theirs.items() if not tag.startswith(DDP_SAMPLED)}


def assert_matches_unbroken(run: Path, reference: Path) -> None:
    """A broken and resumed run ended exactly where the unbroken one did, and TensorBoard shows it so: the same
    steps, and no event going back in any file (which TensorBoard's reader takes for a restart and purges by)."""
    assert_same_weights(run, reference)
    assert_same_tensorboard_steps(run, reference)
    assert not steps_going_back(run)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, data_root):
    """Unbroken reference runs of `LONGER`, one per set of arguments, trained once for the suite (test_sweep_resume's
    interrupted job ends where the DDP run with augmentation does): a DDP run by its own ranks, which this process
    starts."""

    def run(*args: str) -> Path:
        name = "unbroken_" + hashlib.sha1(" ".join(args).encode()).hexdigest()[:12]
        return trained_once(tmp_path_factory, name, *LONGER, *args, here=True).dir

    return run


def test_last_checkpoint_is_the_last_finished_epoch_even_without_improvement(tmp_path, data_root):
    run_dir = tmp_path / "run"
    # lr 1e-12: val/acc never improves after the first epoch, which used to freeze last.ckpt at epoch 0.
    result = train_here(*QUICK, "max_epochs=3", "optim.lr=1e-12", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    state = load(run_dir / "checkpoints" / "last.ckpt")
    assert (state["epoch"], state["global_step"]) == (2, 12)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best-epoch1.ckpt", "last.ckpt"]


class AugmentationDraws(Callback):
    """What this rank's generators draw next for the crops and flips of one fixed image, once training has ended (and
    drawn what it drew): `draws.<rank>.pt` in the run folder."""

    def on_train_end(self, trainer, pl_module) -> None:
        images = torch.arange(28 * 28, dtype=torch.float32).view(1, 1, 28, 28).expand(16, 1, 28, 28)
        torch.save(augment(images, pad=2, hflip=True), Path(trainer.default_root_dir) / f"draws.{trainer.global_rank}.pt")


# PowerSGD's DDP: besides what every DDP run resumes, each rank's error feedback and Q, from step 10 on (when it starts
# compressing, `start_powersgd_iter`); before that its all-reduce is plain DDP's.
DDP2 = ["strategy=ddp_powersgd", "devices=2", "trainer.log_every_n_steps=1"]
# Random crops and flips, each rank its own; what each rank draws after training is left in the run folder.
AUGMENTED = [*DDP2, "data.random_crop=2", "data.hflip=true", "+callbacks.draws._target_=tests.test_resume.AugmentationDraws"]


def kills(marks: Path, *at: tuple[int, int]) -> list[str]:
    """A fault per (step, rank), each killing that rank once, in whichever start of the run reaches it first."""
    return [f"+callbacks.fault{i}.{key}={value}" for i, (step, rank) in enumerate(at)
            for key, value in (("_target_", "tests.faults.KillAtStep"), ("step", step), ("rank", rank),
                               ("mark", marks / f"killed{i}"))]


def assert_same_draws(run: Path, reference: Path) -> None:
    """Each rank's augmentation generators, too, are where the unbroken run left them."""
    for draws in reference.glob("draws.*.pt"):
        assert torch.equal(torch.load(run / draws.name), torch.load(draws)), draws.name


@pytest.mark.slow
def test_each_rank_draws_augmentations_of_its_own(unbroken):
    """Every rank is seeded alike; without a stream of its own each would crop and flip its images as the others do."""
    run_dir = unbroken(*AUGMENTED)
    first, second = (torch.load(run_dir / f"draws.{rank}.pt") for rank in (0, 1))
    assert not torch.equal(first, second)


@pytest.mark.slow
def test_torchrun_restarts_resume_from_the_run_folder_to_the_unbroken_weights(tmp_path, unbroken):
    """PowerSGD's DDP with augmentation under `torchrun --max-restarts=2`, a worker SIGKILLed twice: rank 0 after step
    11, past the epoch's checkpoint (newer than the step checkpoint before it); then rank 1 after step 17, past a step
    checkpoint, which holds PowerSGD's error feedback and Q. Each restarted group resumes itself from the newest
    checkpoint (`ckpt_path=auto`), and the run ends where the unbroken one does: the weights, each rank's augmentation
    generators (the draws callback changes nothing that is computed), the steps TensorBoard shows, none going back.
    The sweep's interrupted job (test_sweep_resume.py) ends there too, resumed by this project's own launcher."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m", "src.train", *LONGER, *AUGMENTED, "ckpt_path=auto", "checkpoint.every_n_train_steps=4",
        *kills(tmp_path, (11, 0), (17, 1)), f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.count("failed (exitcode:") >= 2, "a worker was killed in each of the first two groups"
    restored = re.findall(r"Restoring states from the checkpoint path at (\S+)", result.stdout)
    assert restored[:2] == [str(checkpoints / "last.ckpt"), str(checkpoints / "step.ckpt")], restored
    assert "epoch 1/3 step 10:" in (run_dir / "train.log").read_text(), "the killed groups' log is kept"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["best-epoch3.ckpt", "last.ckpt", "step.ckpt"]
    assert_matches_unbroken(run_dir, unbroken(*AUGMENTED))
    assert_same_draws(run_dir, unbroken(*AUGMENTED))


@pytest.mark.slow
def test_resume_under_another_world_size_says_so_and_keeps_one_hparams_record(tmp_path, ddp_run: Run):
    run_dir = ddp_run.copy(tmp_path)  # trained on 2 DDP processes; resumed on one, in this process
    second = train_here(*QUICK, "strategy=auto", "devices=1", "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    notes = [line for line in second.stdout.splitlines() if "resuming a checkpoint of 2 processes on 1" in line]
    assert len(notes) == 1
    assert load(run_dir / "checkpoints" / "last.ckpt")["epoch"] == 1
    records = [
        value.tag for events in run_dir.glob("events.out.tfevents.*") for event in EventFileLoader(str(events)).Load()
        for value in event.summary.value if value.tag == "_hparams_/session_start_info"
    ]
    assert len(records) == 1


def test_a_new_run_does_not_write_into_a_folder_that_holds_a_run(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").iterdir()}
    again = train_here(*QUICK, f"hydra.run.dir={run_dir}")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith(f"error: hydra.run.dir={run_dir} already holds")
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "checkpoints").iterdir()} == before


def test_ckpt_path_auto_starts_fresh_in_an_empty_folder(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "ckpt_path=auto", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert load(run_dir / "checkpoints" / "last.ckpt")["epoch"] == 0


# ---- A resume takes the run's own config (src/resume.py).

SMALL = [*QUICK, "max_epochs=2", "data.batch_size=64", "trainer.limit_train_batches=6"]


def test_ckpt_path_auto_starting_over_hides_the_points_of_an_attempt_that_left_no_checkpoint(tmp_path, quick_run: Run):
    """A sweep job stopped in its first epoch leaves points in its folder but no checkpoint; its resume starts over
    there, and TensorBoard shows the new run alone, with no step going back (which it would purge by, at random)."""
    run_dir = quick_run.copy(tmp_path)
    shutil.rmtree(run_dir / "checkpoints")
    earlier = scalar_steps(run_dir)
    assert earlier["train/loss"]
    result = train_here(*QUICK, "ckpt_path=auto", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) > 1
    assert not steps_going_back(run_dir)
    assert scalar_steps(run_dir) == earlier  # the same run again: each point once


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, data_root) -> Path:
    """A finished run of 2 epochs of 6 batches of 64, settings that are no default."""
    run_dir = tmp_path_factory.mktemp("small") / "run"
    result = train_here(*SMALL, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def records(run_dir: Path) -> dict[str, str]:
    return {name: (run_dir / name).read_text() for name in ("config.yaml", ".hydra/overrides.yaml", ".hydra/config.yaml")}


def test_a_resume_named_by_its_folder_alone_trains_on_with_the_runs_settings(tmp_path, small_run):
    """Only the folder, a longer max_epochs and keys that change nothing computed: the run's batch, batch limit and data root."""
    run_dir = Path(shutil.copytree(small_run, tmp_path / "run"))
    config = run_dir / "config.yaml"  # as a folder from before config.yaml recorded the threads
    config.write_text("".join(line for line in config.read_text().splitlines(True) if not line.startswith("threads:")))
    data_link = tmp_path / "data"
    data_link.symlink_to(QUICK[0].split("=", 1)[1])  # the same files, found at another path
    result = train_here("ckpt_path=last", "max_epochs=3", f"data.root={data_link}", "trainer.enable_progress_bar=true",
                   f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    state = load(run_dir / "checkpoints" / "last.ckpt")
    assert (state["epoch"], state["global_step"]) == (2, 18)  # a third epoch of 6 steps
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert (saved.data.batch_size, saved.trainer.limit_train_batches, saved.max_epochs) == (64, 6, 3)
    assert saved.data.root == str(data_link) and saved.threads == torch.get_num_threads()


def test_a_resume_reads_the_data_where_its_command_says_never_where_the_record_does(tmp_path, small_run):
    """A record never carries where the data is: a resume that types no data.root, of a run that read its data
    elsewhere than conf/'s default, is one line saying what to type, and writes nothing."""
    run_dir = Path(shutil.copytree(small_run, tmp_path / "run"))
    before = records(run_dir)
    result = train_here("ckpt_path=last", "max_epochs=3", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2 and records(run_dir) == before
    assert result.stderr.strip().splitlines() == [
        f"error: data.root=data is not allowed in a resume of {run_dir}: the run used {QUICK[0]}, which a record never "
        "sets (where a run reads its data, writes and logs come from the command); type "
        f"{QUICK[0]} to go on with it, or start a new run (without ckpt_path)"]


@pytest.mark.parametrize(("change", "message"), [
    ("data.batch_size=128", "data.batch_size=128 is not allowed in a resume of {run}: the run used data.batch_size=64, "
                            "and a resume continues the run as it was"),
    ("model=resnet18", "model=resnet18 is not allowed in a resume of {run}: the run used model=lenet"),
    ("seed=7", "seed=7 is not allowed in a resume of {run}: the run used seed=42"),
    ("trainer.limit_train_batches=null", "trainer.limit_train_batches=null is not allowed in a resume of {run}: the "
                                         "run used trainer.limit_train_batches=6"),
    ("strategy=ddp_fp16", "strategy=ddp_fp16 is not allowed in a resume of {run}: the run used strategy=auto, and "
                          "the two treat gradients differently (hook none against fp16)"),
])
def test_a_resume_that_would_change_what_the_run_computes_is_refused_and_touches_nothing(tmp_path, small_run, change, message):
    run_dir = Path(shutil.copytree(small_run, tmp_path / "run"))
    before = records(run_dir)
    result = train_here("ckpt_path=last", change, QUICK[0], f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: " + message.format(run=run_dir)), result.stderr
    assert records(run_dir) == before


def test_a_run_on_a_schedule_cannot_be_made_longer_and_its_precision_is_kept_by_meaning(tmp_path, small_run):
    run_dir = Path(shutil.copytree(small_run, tmp_path / "run"))
    overrides = run_dir / ".hydra" / "overrides.yaml"  # as if the run had been started with a cosine schedule
    overrides.write_text(overrides.read_text() + "- optim.schedule=cosine\n")
    config = run_dir / "config.yaml"  # its record of what it computed says so too, as the run would have written it
    config.write_text(config.read_text().replace("schedule: none", "schedule: cosine"))
    longer = train_here("ckpt_path=last", "max_epochs=3", f"hydra.run.dir={run_dir}")
    assert longer.returncode == 2
    assert ("error: max_epochs=3 is not allowed in a resume of {run}: the run used max_epochs=2, over which its "
            "learning rate follows optim.schedule=cosine").format(run=run_dir) in longer.stderr

    # as if the run had been made where precision=auto meant true fp16
    used_here = OmegaConf.load(small_run / "config.yaml").precision_used
    config.write_text(config.read_text().replace(f"precision_used: {used_here}", "precision_used: 16-mixed"))
    elsewhere = train_here("ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert elsewhere.returncode == 2
    assert (f"error: precision=auto is not allowed in a resume of {run_dir}: on this machine it means {used_here}, "
            "where the run used 16-mixed") in elsewhere.stderr


def test_a_resume_of_a_folder_that_does_not_exist_says_so(tmp_path):
    result = train_here("ckpt_path=last", f"hydra.run.dir={tmp_path / 'nowhere'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: ckpt_path=last: hydra.run.dir={tmp_path / 'nowhere'} does not exist; name the folder of the run to resume")


def test_a_record_that_is_empty_or_disagrees_with_config_yaml_is_refused_and_nothing_is_rewritten(tmp_path, quick_run: Run):
    """The run's config.yaml is the truth a resume is held to: an emptied `.hydra/overrides.yaml` (the defaults: a full
    epoch instead of the run's few batches) or an edited one is refused in one line, and no file of the run changes."""
    for damage, said in [
        ("", "holds no list of overrides"),
        ("[]\n", "is not allowed in a resume of {run}: the run used "),  # debug=quick's keys, which the record lost
        (None, "{run}/config.yaml is missing"),
    ]:
        run_dir = quick_run.copy(tmp_path / str(len(list(tmp_path.iterdir()))))
        if damage is None:
            (run_dir / "config.yaml").unlink()
        else:
            (run_dir / ".hydra" / "overrides.yaml").write_text(damage)
        (run_dir / ".hydra" / "hydra.yaml").write_text("")  # Hydra's own record is never read by a resume
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
        result = train_here(QUICK[0], "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")  # the rest from the record
        assert result.returncode == 2, result.stderr[-3000:]
        [line] = result.stderr.strip().splitlines()
        assert said.format(run=run_dir) in line and "Traceback" not in result.stderr, line
        assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before


def test_a_finished_run_resumed_says_so_and_a_longer_one_trains_on(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    recorded = json.loads((run_dir / "result.json").read_text())["line"]
    events = sorted(run_dir.glob("events.out.tfevents.*"))
    again = train_here(*QUICK, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"finished before, not run again: {recorded}" in again.stdout and "nan" not in again.stdout
    assert sorted(run_dir.glob("events.out.tfevents.*")) == events, "nothing logged again"
    longer = train_here(*QUICK, "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert load(run_dir / "checkpoints" / "last.ckpt")["epoch"] == 1
    result = json.loads((run_dir / "result.json").read_text())
    assert result["line"] != recorded
    # Its median epoch time is over both epochs, the one before the resume included, as TensorBoard shows them.
    epoch_s = scalars(run_dir)["time/epoch_s"]
    assert len(epoch_s) == 2 and result["metrics"]["time/epoch_s"] == pytest.approx(statistics.median(epoch_s))


def test_a_damaged_last_checkpoint_is_one_line_naming_the_checkpoints_beside_it(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    result = train_here(*QUICK, "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: ckpt_path=last is not allowed; {last} is not a checkpoint file (")
    assert line.endswith("; beside it: best-epoch1.ckpt, which ckpt_path=<file> takes")


def test_a_moved_folder_moves_the_recorded_paths_under_what_moved_and_no_others():
    from src.resume import moved

    before = {"db": "/old/sweep/optuna.db", "uri": "sqlite:////old/sweep/mlflow.db", "beside": "/old/sweepy/x",
              "within": "/a/old/sweep/x", "data": "/data/f", "epochs": 3}
    assert moved(before, Path("/old/sweep/job"), Path("/new/place/job")) == {
        "db": "/new/place/optuna.db", "uri": "sqlite:////new/place/mlflow.db", "beside": "/old/sweepy/x",
        "within": "/a/old/sweep/x", "data": "/data/f"}
    # The names shared reach the file system's root: only the run folder itself moved
    assert moved({"run": "/job/x", "etc": "/etc/x"}, Path("/job"), Path("/a/job")) == {"run": "/a/job/x",
                                                                                     "etc": "/etc/x"}
    assert moved(before, Path("/old/sweep/job"), Path("/old/sweep/job")) == {}


def test_overrides_yaml_keeps_the_start_and_each_resume_is_recorded_beside_it(tmp_path, quick_run: Run):
    """Two resumes in a row, each longer: `.hydra/overrides.yaml` stays as the run's start wrote it, `resumes.yaml`
    lists each resume's own command line, and a third resume that types no length goes on from where the last one
    moved it (its max_epochs), not from the start's."""
    run_dir = quick_run.copy(tmp_path)
    started = (run_dir / ".hydra" / "overrides.yaml").read_text()
    for epochs in (2, 3):
        typed = [QUICK[0], f"max_epochs={epochs}", "ckpt_path=last", f"hydra.run.dir={run_dir}"]
        result = train_here(*typed)
        assert result.returncode == 0, result.stderr[-3000:]
        assert load(run_dir / "checkpoints" / "last.ckpt")["epoch"] == epochs - 1
        assert (run_dir / ".hydra" / "overrides.yaml").read_text() == started
        *_, last = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "resumes.yaml"))
        assert last["overrides"] == typed and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", last["at"])
    assert len(OmegaConf.load(run_dir / ".hydra" / "resumes.yaml")) == 2
    again = train_here(QUICK[0], "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished before, not run again" in again.stdout, again.stdout[-3000:]
    assert len(OmegaConf.load(run_dir / ".hydra" / "resumes.yaml")) == 2, "a resume that ran nothing is no resume"


def test_a_resumed_runs_hparams_name_comes_from_what_its_start_typed(tmp_path, quick_run: Run):
    """A run stopped before its HParams record (written at its end) gets it from a resume: its trial's name shows
    the start's typed keys, never the resume's (ckpt_path, max_epochs) nor a key nobody typed (data.download)."""
    run_dir = quick_run.copy(tmp_path)
    for events in run_dir.glob("events.out.tfevents.*"):
        events.unlink()  # as a run stopped before its end left it: no HParams record
    result = train_here(QUICK[0], "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    from tests.helpers import hparams_plugin_data

    [name] = [data.session_start_info.group_name for data in hparams_plugin_data(run_dir)
              if data.HasField("session_start_info")]
    assert name.startswith("debug=quick ") and not re.search(r"data\.download|max_epochs|ckpt_path", name), name


def test_a_damaged_resumes_record_is_refused_in_one_line(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    (run_dir / ".hydra" / "resumes.yaml").write_text("- overrides: max_epochs=2\n")
    result = train_here(QUICK[0], "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {run_dir / '.hydra' / 'resumes.yaml'}: holds no list of "
                                                  "overrides"]
