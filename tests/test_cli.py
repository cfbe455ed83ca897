"""The real command line as a user runs it: in this process where its own process is not the point."""

import json
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.launch import cli
from tests.helpers import (QUICK, REPO, Run, assert_finished_run, command_here, composed, cpu_precision, hparams,
                           hparams_order, scalars, train_here, user_env, write_tiny_fashion_mnist)


def test_single_device_run_logs_every_interface_scalar(quick_run: Run):
    run_dir = quick_run.dir
    assert_finished_run(quick_run.result, run_dir)
    params = hparams(run_dir)
    assert params["model"] == "lenet" and params["strategy"] == "auto" and params["world_size"] == 1
    assert params["precision_used"] == cpu_precision()  # precision=auto
    assert hparams_order(run_dir)[:4] == ["model", "strategy", "devices", "precision"], "the columns shown by default"
    assert "epoch" not in scalars(run_dir) and "trainer/epoch" in scalars(run_dir), "the epoch counter has a group of its own"


def test_config_yaml_says_how_many_threads_each_process_used(quick_run: Run, monkeypatch):
    """The run's own count, as HParams records it; a local DDP run's workers divide this process's cores."""
    from src.launch.ranks import usable_cores

    assert OmegaConf.load(quick_run.dir / "config.yaml").threads == hparams(quick_run.dir)["threads"]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert composed("strategy=ddp", "devices=2").threads == max(1, len(usable_cores()) // 2)
    assert composed("strategy=dp").threads == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's count, which each DDP worker's torch reads
    assert composed("strategy=ddp", "devices=2").threads == torch.get_num_threads()


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_writes_one_run_folder(ddp_run: Run):
    run_dir = ddp_run.dir
    assert_finished_run(ddp_run.result, run_dir)
    assert hparams(run_dir)["world_size"] == 2
    assert not (run_dir / "train_rank_1.log").exists(), "rank 1 said nothing: no empty log of it"
    # 4 steps, fewer than log_every_n_steps: no per-step xfer/ points, but every xfer/ scalar's epoch mean.
    series = scalars(run_dir)
    assert "xfer/bytes_per_step" not in series
    assert {"xfer/bytes_per_step_epoch", "xfer/hook_ms_epoch", "xfer/backward_comm_ms_epoch", "xfer/overlap_frac_epoch"} <= set(series)
    assert [p.name for p in run_dir.parent.iterdir()] == ["run"]
    # Only rank 0 writes TensorBoard files (assert_finished_run: one event file).


# Four processes: tests/test_readme.py, whose README command trains ResNet-18 under strategy=ddp devices=4.


@pytest.mark.slow
def test_linear_lr_scaling_grows_the_rate_with_the_global_batch(ddp_run: Run):
    """The shared DDP run: data.batch_size=128 optim.lr=0.05 optim.lr_scaling=linear optim.base_batch_size=32."""
    params = hparams(ddp_run.dir)
    assert params["lr"] == pytest.approx(0.05) and params["lr_used"] == pytest.approx(0.05 * 128 / 32)
    state = torch.load(ddp_run.dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(0.2)


def test_16_mixed_on_cpu_says_so_and_records_bf16(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "precision=16-mixed", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in result.stdout.splitlines() if "needs a CUDA GPU" in line]
    assert len(notes) == 1 and "uses bf16-mixed" in notes[0]
    assert "needs a CUDA GPU" in (run_dir / "train.log").read_text()
    params = hparams(run_dir)
    assert params["precision"] == "16-mixed" and params["precision_used"] == "bf16-mixed"


def test_resume_from_last_checkpoint_continues_where_it_stopped(tmp_path, quick_run: Run):
    run_dir = quick_run.copy(tmp_path)
    steps_first = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"]
    second = train_here(*QUICK, "max_epochs=2", "ckpt_path=last", f"hydra.run.dir={run_dir}")
    assert second.returncode == 0, second.stderr[-3000:]
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["epoch"] == 1 and state["global_step"] == 2 * steps_first
    # One epoch timed by each run: the resumed run trained only the missing epoch.
    assert len(scalars(run_dir)["time/epoch_s"]) == 2


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_bad_data_fails_with_one_line_and_no_run_folder(tmp_path, damage):
    root = write_tiny_fashion_mnist(tmp_path / "data")
    images = root / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    images.unlink() if damage == "missing" else images.write_bytes(b"\0\0\x08\x03" + b"\1" * 64)
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, f"data.root={root}", "data.download=false", "data.val_size=8", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: data.root=") and ("not found" if damage == "missing" else "corrupt") in last
    assert "train-images-idx3-ubyte" in last and not run_dir.exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_zero_says_a_failure(monkeypatch, capsys, rank):
    """Under torchrun or SLURM every rank runs the command line and meets the same bad input: one line in all."""
    for name, value in {"RANK": rank, "GROUP_RANK": "0", "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert cli.failed(UsageError("optim.lr=-1 is not allowed"), []) == 2
    assert capsys.readouterr().err == ("error: optim.lr=-1 is not allowed\n" if rank == "0" else "")


def test_debug_quick_says_whether_the_loss_fell_in_its_steps(tmp_path, quick_run):
    """The default LeNet, which learns from its first steps, shows it in its line; the book's, flat in its first steps,
    says it cannot tell."""
    fell = re.search(r"; train/loss fell from (\d\.\d{4}) to (\d\.\d{4}) in 4 steps; ", quick_run.result.stdout)
    assert fell and float(fell.group(2)) < float(fell.group(1)), quick_run.result.stdout[-2000:]
    book = train_here(*QUICK, "experiment=d2l_lenet", "max_epochs=1", f"hydra.run.dir={tmp_path / 'book'}")
    assert book.returncode == 0, book.stderr[-3000:]
    flat = re.search(r"; train/loss (did not fall|rose) in its 4 steps \((\d\.\d{4}) to (\d\.\d{4})\): these are too few",
                     book.stdout)
    assert flat, book.stdout[-2000:]
    # Two batches a step: the 4 batches are 2 optimizer steps.
    accumulated = train_here(*QUICK, "trainer.accumulate_grad_batches=2", f"hydra.run.dir={tmp_path / 'accumulated'}")
    assert accumulated.returncode == 0, accumulated.stderr[-3000:]
    assert re.search(r"; train/loss (fell from \S+ to \S+ in 2 steps|\S+( \S+)? in its 2 steps )", accumulated.stdout), \
        accumulated.stdout[-2000:]


@pytest.mark.slow
def test_the_default_run_learns_in_its_first_epoch(tmp_path, data_root):
    """A new user's first run: one epoch of the default LeNet on the whole data scores far above chance."""
    result = train_here(f"data.root={data_root}", "max_epochs=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]["test/acc"] >= 0.80


@pytest.mark.slow
def test_one_name_for_the_precision_and_the_logger_under_ddp(ddp_run):
    """The folder, config.yaml (beside the precision asked for), the result line and HParams name the precision
    used alike; the result line's logger is `src.train`, not the worker's `__mp_main__`; the epoch line says samples/s."""
    used = cpu_precision()  # what precision=auto means here, as the folder of a run named by default shows it
    saved = OmegaConf.load(ddp_run.dir / "config.yaml")
    assert (saved.precision, saved.precision_used) == ("auto", used)
    assert hparams(ddp_run.dir)["precision_used"] == used and hparams(ddp_run.dir)["threads"] == saved.threads
    line = next(line for line in ddp_run.result.stdout.splitlines() if " - test/acc=" in line)
    assert "[src.train][INFO] - " in line and f"(precision {used}, 2 processes," in line
    assert re.search(r"epoch 1/1 step \d+: .* \d+ samples/s$", (ddp_run.dir / "train.log").read_text(), re.M)


def test_a_slow_command_says_what_it_is_doing_and_a_quick_one_says_nothing(capsys):
    import time

    from src.launch.console import saying

    said = ""
    with saying("reading the runs below outputs", after_s=0.0):  # slower than 0 s: says it, from its timer's thread
        deadline = time.monotonic() + 300  # a bound on a hang, not on the machine's speed
        while "reading the runs below outputs ..." not in said and time.monotonic() < deadline:
            time.sleep(0.01)
            said += capsys.readouterr().err
    assert "reading the runs below outputs ...\n" in said
    with saying("never said", after_s=600):
        pass
    assert "never said" not in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "ranks"), [
    (["strategy=ddp", "devices=1"], [1]),  # a world of one: the launching process leaves the device to its rank
    (["strategy=ddp", "devices=2"], [2]),
    (["strategy=dp", "devices=2"], []),
    (["strategy=auto"], []),
])
def test_ddp_trains_in_spawned_ranks_one_device_too_and_the_rest_here(monkeypatch, overrides, ranks):
    from src.launch import workers

    started: list[int] = []
    monkeypatch.setattr(workers, "start", lambda task, cfg, nprocs: started.append(nprocs) or "in the ranks")
    result = workers.launch(lambda cfg: "in this process", composed(*overrides, "accelerator=cpu"))
    assert (result, started) == ("in the ranks" if ranks else "in this process", ranks)


@pytest.mark.slow
def test_the_rules_import_no_torch():
    """The rules (src/config.py) run on the composed config before anything is built, and need neither torch nor
    Lightning: only Hydra's composition and the rules' own tables."""
    script = ("import sys; from tests.helpers import composed; from src import config; cfg = composed('optim.lr=0.1'); "
              "config.check(cfg); print(sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'lightning')))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=user_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


ANSWERED_WITHOUT_TORCH = """
import json, sys
from tests.helpers import command_here
for module, *args in json.loads(sys.argv[1]):
    result = command_here(module, *args, cwd=sys.argv[2])
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "lightning"))
    print(json.dumps([result.returncode, result.stdout, result.stderr, loaded]))
"""


@pytest.mark.slow
def test_help_the_config_and_a_refused_config_are_answered_without_torch(tmp_path):
    """The entry points import torch and Lightning only for a run whose config passed its checks (`src.tasks`):
    `--help`, `--cfg job` and every refusal of a key or value come before them, in a fresh interpreter."""
    cases = [["src.train", "--help"], ["src.train", "--cfg", "job"], ["src.train", "max_epoch=3"],
             ["src.train", "strategy=nope"], ["src.train", "devices=0"], ["src.train", "logger=mlflow", "max_epochs=-1"],
             ["src.eval", "--help"], ["src.eval", "--cfg", "job"], ["src.eval", "ckpt_path=x.ckpt", "devices=0"]]
    result = subprocess.run([sys.executable, "-c", ANSWERED_WITHOUT_TORCH, json.dumps(cases), str(tmp_path)], cwd=REPO,
                            env=user_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [loaded for *_, loaded in answers] == [[]] * len(cases)
    (train_help, train_cfg, misspelt, option, value, logged, eval_help, eval_cfg, eval_value) = answers
    for help_, cfg in ((train_help, train_cfg), (eval_help, eval_cfg)):
        assert help_[0] == cfg[0] == 0 and "model: lenet, resnet18" in help_[1] and "devices: 1\n" in cfg[1]
    assert [status for status, *_ in (misspelt, option, value, logged, eval_value)] == [2] * 5
    assert misspelt[2].startswith("error: max_epoch is not a known key; did you mean max_epochs?")
    assert option[2].startswith("error: strategy=nope is not an option")
    assert value[2] == eval_value[2] == "error: devices=0 is not allowed; devices must be a whole number of at least 1\n"
    assert logged[2].startswith("error: max_epochs=-1 is not allowed")  # the logger's run name is not asked for
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides", [[], ["model=resnet18", "strategy=ddp", "logger=csv"]], ids=["plain", "overrides"])
@pytest.mark.parametrize("name", ["train", "eval"])
def test_help_is_hydras_text_with_each_groups_options(name, overrides):
    """`--help` lists the config groups from one reading of conf/; Hydra answers itself where a flag of its own is
    typed (`-cn`), with the same text. tests/test_output.py runs `--help` as a command line."""
    ours = command_here(f"src.{name}", "--help", *overrides)
    hydras = command_here(f"src.{name}", "--help", "-cn", name, *overrides)
    assert ours.returncode == hydras.returncode == 0, ours.stderr + hydras.stderr
    # Hydra lists the app's groups alone; ours adds the launchers and sweepers a sweep picks from
    assert [line for line in ours.stdout.splitlines() if not line.startswith("hydra/")] == hydras.stdout.splitlines()
    assert "model: lenet, resnet18\n" in ours.stdout and "logger: csv, mlflow, tensorboard, wandb\n" in ours.stdout


def test_help_leaves_a_template_with_hydras_own_parts_to_hydra():
    from src.launch.help import help_text

    assert help_text("train", ["hydra.help.template=groups: $APP_CONFIG_GROUPS"]).startswith("groups: callbacks: default\n")
    assert help_text("train", ["hydra.help.template=flags: $FLAGS_HELP"]) is None


@pytest.mark.parametrize(("overrides", "env", "expected"), [
    (["strategy=ddp", "devices=2"], {}, 2),
    (["strategy=ddp_powersgd", "devices=4"], {}, 4),
    (["strategy=ddp", "devices=1"], {}, 1),
    (["strategy=dp", "devices=2"], {}, 1),
    (["strategy=auto"], {}, 1),
], ids=lambda value: " ".join(value) if isinstance(value, list) else str(value))
def test_a_run_starts_a_process_per_device_under_ddp_only(overrides, env, expected):
    from src.launch.workers import processes_per_node

    assert processes_per_node(composed(*overrides)) == expected


def test_processes_that_torchrun_or_srun_started_are_told_apart_from_a_stray_variable(monkeypatch):
    from src.launch.ranks import external_rank

    for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "7")
    assert external_rank() is None, "a RANK alone in a user's shell starts nothing"
    for name, value in {"GROUP_RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert external_rank() == "7"
    for name in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")
    assert external_rank() is None, "an interactive allocation: the person started this process"
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert external_rank() == "1"


@pytest.mark.parametrize("name", ["plain", "a b", "a,b=c", "it's", "back\\slash", "end\\", "x\\'y", 'a"b', "[x]"])
def test_the_printed_resume_command_gives_the_folder_back_through_the_shell_and_hydra(tmp_path, name):
    """A folder name with a space broke the printed resume command."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from src.launch.cli import kept

    folder = tmp_path / name
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").touch()
    said = kept(folder)
    command = shlex.split(said.split("resume with: ", 1)[1])
    assert command[1:4] == ["-m", "src.train", "ckpt_path=last"]
    override = OverridesParser.create().parse_override(command[4])
    assert (override.key_or_group, override.value()) == ("hydra.run.dir", str(folder))


@pytest.mark.slow
def test_a_missing_checkpoint_or_data_folder_and_an_uneven_global_batch_are_refused_without_torch(tmp_path):
    """What the config and the file system decide comes before torch loads, in a fresh interpreter: one line, exit 2,
    no folder (benchmarks/answer_time.py times them)."""
    missing, nodata = tmp_path / "missing.ckpt", tmp_path / "nodata"
    cases = [["src.train", f"ckpt_path={missing}"], ["src.eval", f"ckpt_path={missing}"],
             ["src.train", f"data.root={nodata}", "data.download=false"],
             ["src.train", "data.batch_size=10", "strategy=ddp", "devices=4"]]
    result = subprocess.run([sys.executable, "-c", ANSWERED_WITHOUT_TORCH, json.dumps(cases), str(tmp_path)], cwd=REPO,
                            env=user_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(status, loaded) for status, _, _, loaded in answers] == [(2, [])] * len(cases)
    lines = [stderr for _, _, stderr, _ in answers]
    assert lines == [f"error: ckpt_path={missing}: no checkpoint at {missing}; give a .ckpt file, `last` or `auto`\n",
                     f"error: ckpt_path={missing}: no checkpoint at {missing}; give a .ckpt file or a run folder\n",
                     lines[2], "error: data.batch_size=10 is the global batch and must be a positive multiple of the 4 "
                     "processes (devices x num_nodes); try 8\n"]
    assert lines[2].startswith(f"error: data.root={nodata}: Fashion-MNIST not found") and lines[2].count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_help_lists_the_launchers_and_sweepers_a_sweep_picks_from():
    """The project's launchers (conf/hydra/launcher and hydra_plugins/project_launchers) and sweepers (Hydra's
    default and the ConfigStore's `optuna`), not every entry of Hydra's plugins."""
    result = command_here("src.train", "--help")
    assert result.returncode == 0, result.stderr
    assert "hydra/launcher: parallel, sequential, slurm\n" in result.stdout
    assert "hydra/sweeper: basic, optuna\n" in result.stdout


@pytest.mark.parametrize("typed, said", [
    ("model=resnet19", "model=resnet19 is not an option; did you mean model=resnet18? choose one of: lenet, resnet18"),
    ("hydra/launcher=paralel", "hydra/launcher=paralel is not an option; did you mean hydra/launcher=parallel?"),
])
def test_a_misspelt_option_is_one_line_with_the_option_meant(tmp_path, typed, said):
    result = command_here("src.train", typed, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: {said}"), line
    assert not (tmp_path / "run").exists()


def test_the_keys_a_sweep_sweeps_are_those_whose_recorded_value_is_not_one_value():
    """A job folder is named by the swept keys' values, read from the sweep's record as values: one value (a number,
    quoted text with a comma, a list) sweeps nothing; a sweep, and anything the reader does not read (a dict, an
    escaped comma, `glob(*)`, text Hydra's grammar refuses), names the folders."""
    from src.launch.naming import swept_keys

    assert swept_keys(["a={x:1,y:2}", "b=x\\,y", "c='1,2'", "d=[1,2]", "seed=1,2", "+optim.lr=interval(0.1,1)",
                       "~e", "model=glob(*)", "f=[1,2", "g=shuffle(range(3))", "h=0.5"]) == [
        "a", "b", "seed", "optim.lr", "model", "f", "g"]
