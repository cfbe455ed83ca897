"""`python -m src.eval`: a saved model's test accuracy and loss, on any strategy and number of processes (DDP's:
tests/test_evaluation.py)."""

import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.eval import as_trained, with_checkpoint_model
from src.records import bounded
from tests.helpers import DATA_ROOT, QUICK, command_here, hparams, scalars

SCORE = [f"data.root={DATA_ROOT}", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_root):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    # Label smoothing changes the loss: an eval that dropped the run's model overrides would report another test/loss.
    result = command_here("src.train", *QUICK, "trainer.limit_train_batches=20", "trainer.limit_test_batches=1.0",
                          "model.loss.label_smoothing=0.1", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def evaluate(tmp_path, *args: str):
    """`python -m src.eval` of one process, in this process."""
    run_dir = tmp_path / "eval"
    return command_here("src.eval", *SCORE, *args, f"hydra.run.dir={run_dir}"), run_dir


def test_eval_scores_a_checkpoint_as_the_training_run_did_without_training(tmp_path, trained):
    result, run_dir = evaluate(tmp_path, f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}")
    assert result.returncode == 0, result.stderr[-3000:]
    series = scalars(run_dir)
    assert series["test/acc"] == scalars(trained)["test/acc"], "the same weights on the same 10,000 images"
    assert series["test/loss"] == scalars(trained)["test/loss"], "the same loss, label smoothing included"
    assert "train/loss" not in series and not (run_dir / "checkpoints").exists()
    lines = [line for line in result.stdout.splitlines() if "test/acc=" in line]
    assert len(lines) == 1 and f"test/acc={series['test/acc'][0]:.4f} test/loss=" in lines[0]
    assert f"of {trained / 'checkpoints' / 'last.ckpt'} -> {run_dir}" in lines[0]
    # An evaluation is no training: it adds no row to TensorBoard's HParams table, and says its line as src.eval.
    assert hparams(run_dir) == {}
    assert "[src.eval]" in result.stdout + result.stderr


def test_eval_into_a_runs_folder_is_refused_and_leaves_it_as_it_was(tmp_path, trained):
    """`hydra.run.dir=<a finished training run>` overwrote its config.yaml, .hydra/* and result.json."""
    run_dir = Path(shutil.copytree(trained, tmp_path / "copy"))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    result = command_here("src.eval", *SCORE, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"error: hydra.run.dir={run_dir} holds a run; src.eval writes into a folder of its own: leave hydra.run.dir "
        "out (outputs/eval/<date>_<time>_...), or give a new folder"]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("args, message", [
    ([], "error: ckpt_path is required"),
    (["ckpt_path=/nonexistent.ckpt"], "error: ckpt_path=/nonexistent.ckpt: no checkpoint at /nonexistent.ckpt"),
])
def test_eval_without_a_checkpoint_is_one_line(tmp_path, args, message):
    result, run_dir = evaluate(tmp_path, *args)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_eval_takes_the_model_of_the_checkpoints_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model_name: resnet18\n")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert with_checkpoint_model([f"ckpt_path={ckpt}"]) == [f"ckpt_path={ckpt}", "model=resnet18"]
    assert with_checkpoint_model([f"ckpt_path={run_dir}"])[-1] == "model=resnet18"
    assert with_checkpoint_model([f"ckpt_path={ckpt}", "model=lenet"]) == [f"ckpt_path={ckpt}", "model=lenet"]
    assert with_checkpoint_model([f"ckpt_path={tmp_path / 'elsewhere.ckpt'}"]) == [f"ckpt_path={tmp_path / 'elsewhere.ckpt'}"]


def test_eval_builds_the_model_the_run_built_with_this_commands_model_overrides_on_top(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = {"model_name": "mlp", "model": {"net": {"hidden": 32}, "loss": {"_target_": "CE", "label_smoothing": 0.1}}}
    OmegaConf.save(OmegaConf.create(saved), run_dir / "config.yaml")
    composed = {"ckpt_path": str(run_dir), "model_name": "mlp", "model": {"net": {"hidden": 64}, "loss": {"_target_": "CE", "label_smoothing": 0.0}}}
    cfg = OmegaConf.create(composed)
    assert OmegaConf.to_container(as_trained(cfg, [], "model")) == saved["model"]
    mixed = as_trained(cfg, ["model.net.hidden=64", "optim.lr=0.1"], "model")
    assert OmegaConf.to_container(mixed) == {"net": {"hidden": 64}, "loss": {"_target_": "CE", "label_smoothing": 0.1}}
    cfg.model_name = "lenet"  # another model named: the composed one
    assert as_trained(cfg, [], "model") is cfg.model


def test_eval_reads_the_data_where_its_command_says_and_scores_as_the_run_did(tmp_path, trained):
    """Given where the data is, in a folder without data: the training's test accuracy again, nothing downloaded."""
    result = command_here("src.eval", f"ckpt_path={trained}", f"data.root={DATA_ROOT}",
                          "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert scalars(next((tmp_path / "outputs" / "eval").iterdir()))["test/acc"] == scalars(trained)["test/acc"]
    assert not (tmp_path / "data").exists()


def test_eval_never_reads_or_downloads_where_a_runs_record_says(tmp_path, trained):
    """A run's config.yaml naming `data.root=<elsewhere>` with `data.download=true` made src.eval download into it:
    where the data is read is typed. Left out where the run read elsewhere than conf/'s default, it is one line that
    says so, and nothing is read, downloaded or written."""
    run_dir = Path(shutil.copytree(trained, tmp_path / "run"))
    elsewhere = tmp_path / "elsewhere"
    recorded = run_dir / "config.yaml"
    text = recorded.read_text()
    assert f"  root: {DATA_ROOT}\n" in text and "  download: true\n" in text
    recorded.write_text(text.replace(f"  root: {DATA_ROOT}\n", f"  root: {elsewhere}\n", 1))
    result = command_here("src.eval", f"ckpt_path={run_dir}", "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert result.returncode == 2 and not elsewhere.exists() and not (tmp_path / "outputs").exists()
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: data.root is needed: {recorded} says the run read its data from data.root={bounded(elsewhere)}, and where "
        "data is read is typed, never taken from a run's records; type data.root=<a folder holding FashionMNIST/raw>")
    typed = command_here("src.eval", f"ckpt_path={run_dir}", f"data.root={DATA_ROOT}",
                         "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert typed.returncode == 0 and not elsewhere.exists(), typed.stderr[-3000:]


def test_a_failed_eval_leaves_no_folder_behind(tmp_path, trained):
    """The data cannot be found (and may not be downloaded): no eval folder, no `outputs/eval/` made for it. Run in a
    folder of its own: a folder made and removed in the checkout's outputs/ would also be seen there by a test that
    ends meanwhile in another test process (tests/conftest.py). A failed download's own cleanup: tests/test_data.py."""
    nodata = tmp_path / "nodata"
    result = command_here("src.eval", f"ckpt_path={trained}", f"data.root={nodata}", "data.download=false", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: data.root={nodata}: Fashion-MNIST not found")
    assert not nodata.exists() and not (tmp_path / "outputs").exists()


def test_eval_help_lists_the_groups_a_test_uses_only():
    """The help's text, in this process: tests/test_cli.py runs `--help` as a command line."""
    result = command_here("src.eval", "--help")
    assert result.returncode == 0, result.stderr
    choices = result.stdout.split("Choices (group=option):")[1].split("Every key")[0]
    assert [line.split(":")[0] for line in choices.split("\n") if line.strip()] == ["model", "strategy", "logger"]
    assert "strategy: auto, ddp, ddp_bf16, ddp_fp16, ddp_powersgd, ddp_powersgd_fp16, dp" in choices


def test_eval_logs_its_score_at_the_step_its_checkpoint_was_trained_to(tmp_path, trained):
    """TensorBoard over outputs/ shows an evaluation's test/acc beside its run's: at the step the run logged its own
    test/acc, the last before its checkpoint, not at step 0."""
    import torch

    from tests.helpers import scalar_steps

    checkpoint = trained / "checkpoints" / "last.ckpt"
    global_step = torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]
    result, run_dir = evaluate(tmp_path, f"ckpt_path={checkpoint}")
    assert result.returncode == 0, result.stderr[-3000:]
    steps = scalar_steps(run_dir)
    assert global_step > 1 and steps["test/acc"] == steps["test/loss"] == [global_step - 1]
    assert steps["test/acc"] == scalar_steps(trained)["test/acc"], "beside the training run's own score"
