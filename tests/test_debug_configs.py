"""conf/debug/: each recipe composes and passes the checks, and runs in this process as its comment says, keeping its
run folder (checkpoints, result, TensorBoard) as a full run does."""

import json

import pytest
import yaml

from src import config
from src.config import CONF_DIR
from tests.helpers import DATA_ROOT, composed, epoch_lines, scalars, train_here

RECIPES = sorted(path.stem for path in (CONF_DIR / "debug").glob("*.yaml"))


def test_the_recipes_users_know_from_the_lightning_hydra_template_are_there():
    assert {"fdr", "limit", "overfit", "profiler", "quick"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_composes_passes_the_checks_and_says_what_it_is_in_its_first_lines(name):
    config.check(composed(f"debug={name}"), named=False)
    lines = (CONF_DIR / "debug" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_" and lines[1].startswith("# ") and f"debug={name}" in "\n".join(lines[:8])


def run(tmp_path, name: str, *args: str):
    folder = tmp_path / name
    result = train_here(f"data.root={DATA_ROOT}", f"debug={name}", f"hydra.run.dir={folder}", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (folder / "result.json").is_file() and list((folder / "checkpoints").glob("*.ckpt"))
    return result, folder, epoch_lines((folder / "train.log").read_text())


def test_fdr_runs_one_step_of_each_stage_and_keeps_the_run_folder_fast_dev_run_would_drop(tmp_path, data_root):
    result, folder, epochs = run(tmp_path, "fdr")
    assert epochs == [(1, 1)]
    assert yaml.safe_load((folder / "config.yaml").read_text())["trainer"]["fast_dev_run"] is False
    assert "test/acc" in json.loads((folder / "result.json").read_text())["metrics"]


def test_limit_runs_three_epochs_of_eight_steps(tmp_path, data_root):
    _, _, epochs = run(tmp_path, "limit")
    assert epochs == [(1, 8), (2, 16), (3, 24)]


def test_overfit_trains_on_the_same_images_each_epoch_and_its_loss_falls(tmp_path, data_root):
    """Three of its epochs: one loader batch each (8 steps), the same images, so the training loss falls."""
    _, folder, epochs = run(tmp_path, "overfit", "max_epochs=3")
    assert epochs == [(1, 8), (2, 16), (3, 24)]
    losses = scalars(folder)["train/loss"]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_profiler_prints_its_table_and_keeps_it_in_train_log(tmp_path, data_root):
    result, folder, epochs = run(tmp_path, "profiler")
    assert epochs == [(1, 16)]
    assert "Profiler Report" in (folder / "train.log").read_text()


# ---------------------------------------------------------------- "did you mean": only keys that are there

MISTYPED = ["model.optimizer.lr=0.1", "model.nett.foo=1", "optim.lrr.x=1", "trainer.foo.bar=1", "data.batch.size=1",
            "model.net.nam=1", "optimizer.lr=0.1", "model.lr=0.1", "optim.learning_rate=0.1", "trainer.max_epoch=3",
            "callbacks.best_checkpoint.monitr.x=1", "model.net.num_clases.x=1", "lr=0.1", "data.batchsize=64"]


@pytest.mark.parametrize("typed", MISTYPED)
def test_an_unknown_key_never_gets_a_suggestion_of_a_key_that_is_not_there(typed):
    import re

    from omegaconf import OmegaConf

    from tests.test_bad_input import hydra_refusal

    said = hydra_refusal(typed)
    assert said.startswith(f"{typed.partition('=')[0]} is not ")
    cfg = composed()
    for suggested in re.findall(r"did you mean (\S+?)\?", said):
        assert OmegaConf.select(cfg, suggested, default="<absent>") != "<absent>", said
