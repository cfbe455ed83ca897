"""`test_weights`: a run tests its best validated checkpoint unless told to test its last weights, and
`python -m src.eval` given a run folder scores the same checkpoint."""

import json
import pytest

from tests.helpers import QUICK, command_here, hparams, scalars, train_here

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_root):
    """One run of each setting (one process each, trained in this process), and its result line."""
    folder = tmp_path_factory.mktemp("test_weights")
    done = {}
    for name, args in {"best": [], "last": ["test_weights=last"], "no_val": ["max_epochs=1", "trainer.limit_val_batches=0"]}.items():
        result = train_here(*TWO_EPOCHS, *args, f"hydra.run.dir={folder / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        line = next(line for line in result.stdout.splitlines() + result.stderr.splitlines() if "test/acc=" in line)
        done[name] = (folder / name, line, result.stdout + result.stderr)
    return done


@pytest.fixture(scope="module")
def scores(runs, tmp_path_factory):
    """test/acc of the default run's best and last checkpoints, each scored on its own."""
    run_dir = runs["best"][0]
    folder = tmp_path_factory.mktemp("scores")
    best = [path for path in (run_dir / "checkpoints").glob("best-*.ckpt")]
    assert [path.name for path in best] == ["best-epoch0.ckpt"]
    return {"best": evaluate(folder / "best", f"ckpt_path={best[0]}"),
            "last": evaluate(folder / "last", f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")}


def test_a_run_tests_its_best_checkpoint_by_default(runs, scores):
    run_dir, line, _ = runs["best"]
    assert scores["best"] != scores["last"], "the two checkpoints must differ for this test to tell them apart"
    assert score_of(run_dir) == scores["best"]
    assert "tested best-epoch0.ckpt" in line
    assert hparams(run_dir)["tested_weights"] == "best"


def test_test_weights_last_tests_the_weights_training_ended_with(runs, scores):
    run_dir, line, _ = runs["last"]
    assert score_of(run_dir) == scores["last"]  # the same seed and settings: the same last weights
    assert "tested the last weights" in line
    assert hparams(run_dir)["tested_weights"] == "last"


def test_eval_of_a_run_folder_scores_its_best_checkpoint_unless_told_last(runs, scores, tmp_path):
    run_dir = runs["best"][0]
    assert evaluate(tmp_path / "best", f"ckpt_path={run_dir}") == scores["best"]
    assert "/best-epoch0.ckpt -> " in json.loads((tmp_path / "best" / "result.json").read_text())["line"]
    assert evaluate(tmp_path / "last", f"ckpt_path={run_dir}", "test_weights=last") == scores["last"]
    assert "/last.ckpt -> " in json.loads((tmp_path / "last" / "result.json").read_text())["line"]


def test_a_run_without_validation_tests_its_last_weights_and_says_so(runs):
    run_dir, line, output = runs["no_val"]
    assert "no best checkpoint was saved" in output
    assert "tested the last weights" in line
    assert hparams(run_dir)["tested_weights"] == "last"


def test_an_unknown_test_weights_is_one_error_line(tmp_path):
    result = train_here(*QUICK, "test_weights=newest", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode != 0
    assert "error: test_weights=newest is not allowed; test_weights must be one of: best, last" in result.stderr
    assert not (tmp_path / "run").exists()
