"""`test_weights`: a run tests its best validated checkpoint unless told to test its last weights, and
`python -m src.eval` given a run folder scores the same checkpoint."""

import json
import re
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch

from tests.helpers import QUICK, command_here, hparams, scalars, train_here, trained_once

# The best checkpoint watches val/acc with mode=min here, so that the "best" epoch is the first one
# and its weights differ from the last: a run that tested its last weights could not pass for one
# that tested the best.
TWO_EPOCHS = [*QUICK, "experiment=lenet_plus", "max_epochs=2", "callbacks.best_checkpoint.mode=min"]


def score_of(run_dir) -> float:
    return scalars(run_dir)["test/acc"][0]


def evaluate(run_dir, *args: str) -> float:
    """`python -m src.eval` of one process, in this process: the test/acc it logged."""
    result = command_here("src.eval", *QUICK, *args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return score_of(run_dir)


SETTINGS = {"best": [], "last": ["test_weights=last"], "no_val": ["max_epochs=1", "trainer.limit_val_batches=0"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_root):
    """A run of a setting (one process, trained in this process) when a test first asks for it, and its result line:
    trained `once` for the suite, and only if a test uses it."""

    @cache
    def run(name: str) -> tuple[Path, str, str]:
        trained = trained_once(tmp_path_factory, f"test_weights_{name}", *TWO_EPOCHS, *SETTINGS[name], here=True)
        output = "\n".join((trained.result.stdout, trained.result.stderr))
        line = next(line for line in output.splitlines() if "test/acc=" in line)
        return trained.dir, line, output

    return run


@pytest.fixture(scope="module")
def scores(runs, tmp_path_factory):
    """test/acc of the default run's best and last checkpoints, each scored on its own."""
    run_dir = runs("best")[0]
    folder = tmp_path_factory.mktemp("scores")
    best = [path for path in (run_dir / "checkpoints").glob("best-*.ckpt")]
    assert [path.name for path in best] == ["best-epoch1.ckpt"]
    return {"best": evaluate(folder / "best", f"ckpt_path={best[0]}"),
            "last": evaluate(folder / "last", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")}


def test_a_run_tests_its_best_checkpoint_by_default(runs, scores):
    run_dir, line, _ = runs("best")
    assert scores["best"] != scores["last"], "the two checkpoints must differ for this test to tell them apart"
    assert score_of(run_dir) == scores["best"]
    assert "tested best-epoch1.ckpt" in line
    assert hparams(run_dir)["tested_weights"] == "best"


def test_test_weights_last_tests_the_weights_training_ended_with(runs, scores):
    run_dir, line, _ = runs("last")
    assert score_of(run_dir) == scores["last"]  # the same seed and settings: the same last weights
    assert "tested the last weights" in line
    assert hparams(run_dir)["tested_weights"] == "last"


def test_eval_of_a_run_folder_scores_its_best_checkpoint_unless_told_last(runs, scores, tmp_path):
    run_dir = runs("best")[0]
    assert evaluate(tmp_path / "best", f"ckpt_path={run_dir}") == scores["best"]
    assert "/best-epoch1.ckpt -> " in json.loads((tmp_path / "best" / "result.json").read_text())["line"]
    assert evaluate(tmp_path / "last", f"ckpt_path={run_dir}", "test_weights=last") == scores["last"]
    assert "/last.ckpt -> " in json.loads((tmp_path / "last" / "result.json").read_text())["line"]


def test_a_best_checkpoint_is_named_by_its_epoch_as_train_log_counts_it(runs):
    """The first epoch was best (mode=min): train.log's `epoch 1/2`, Lightning's epoch 0."""
    run_dir = runs("best")[0]
    state = torch.load(run_dir / "checkpoints" / "best-epoch1.ckpt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 0 and "epoch 1/2 " in (run_dir / "train.log").read_text()


def test_a_folder_that_names_its_best_from_epoch_0_is_scored_and_resumed_alike(runs, scores, quick_run, tmp_path):
    """Folders written before the names counted from 1: the best file is found by its prefix, never its number."""
    old = Path(shutil.copytree(runs("best")[0], tmp_path / "old"))
    (old / "checkpoints" / "best-epoch1.ckpt").rename(old / "checkpoints" / "best-epoch0.ckpt")
    assert evaluate(tmp_path / "eval", f"ckpt_path={old}") == scores["best"]
    assert "/best-epoch0.ckpt -> " in json.loads((tmp_path / "eval" / "result.json").read_text())["line"]
    resumed = quick_run.copy(tmp_path)  # one epoch, no schedule: a resume may train a second
    (resumed / "checkpoints" / "best-epoch1.ckpt").rename(resumed / "checkpoints" / "best-epoch0.ckpt")
    longer = train_here("ckpt_path=last", "max_epochs=2", QUICK[0], f"hydra.run.dir={resumed}")
    assert longer.returncode == 0, longer.stderr[-3000:]
    tested = re.search(r"tested (best-epoch\d+\.ckpt)", longer.stdout)[1]  # the old one, or the second epoch's
    assert tested in ("best-epoch0.ckpt", "best-epoch2.ckpt") and (resumed / "checkpoints" / tested).is_file()


def test_a_run_without_validation_tests_its_last_weights_and_says_so(runs):
    run_dir, line, output = runs("no_val")
    assert "no best checkpoint was saved" in output
    assert "tested the last weights" in line
    assert hparams(run_dir)["tested_weights"] == "last"


def test_an_unknown_test_weights_is_one_error_line(tmp_path):
    result = train_here(*QUICK, "test_weights=newest", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode != 0
    assert "error: test_weights=newest is not allowed; test_weights must be one of: best, last" in result.stderr
    assert not (tmp_path / "run").exists()
