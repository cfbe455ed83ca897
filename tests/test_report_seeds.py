"""The sweep report on runs whose numbers are known: repeats with other seeds are grouped with their
statistics, and sections that do not apply to the runs are left out."""

import csv
import math
import statistics

import pytest
from matplotlib.image import imread
from omegaconf import OmegaConf

from src.report import main as report_main
from src.report import t_975
from tests.helpers import call_main
from tests.test_report import config, write_run

ACC = {1: 0.80, 2: 0.84, 3: 0.85}
EPOCH_S = {1: [2.0, 3.0], 2: [2.5, 2.5], 3: [4.0, 3.0]}


@pytest.fixture
def seeds(tmp_path):
    """Three seeds of one single-device setting, and one run of another learning rate."""
    root = tmp_path / "sweep"
    for seed, acc in ACC.items():
        write_run(root / f"lenet_auto_1dev_32-true_seed={seed}", {**config("auto", 1), "seed": seed},
                  {"time/epoch_s": EPOCH_S[seed], "test/acc": [acc], "val/acc": [acc - 0.1, acc]},
                  {"seed": seed, "lr": 0.1, "precision_used": "32-true"})
    write_run(root / "lenet_auto_1dev_32-true_optim.lr=0.2", {**config("auto", 1), "seed": 1},
              {"time/epoch_s": [1.0], "test/acc": [0.7]}, {"seed": 1, "lr": 0.2, "precision_used": "32-true"})
    return root


def test_t_quantiles():
    assert t_975(1) == 12.706 and t_975(2) == 4.303 and t_975(30) == 2.042
    assert t_975(40) == pytest.approx(2.021, abs=1e-3) and t_975(120) == pytest.approx(1.980, abs=1e-3)


def test_repeats_with_other_seeds_are_grouped_with_mean_sd_and_interval(seeds):
    result = call_main(report_main, str(seeds))
    assert result.returncode == 0, result.stderr
    with (seeds / "seeds.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))  # the lr=0.2 run has no repeat: no row
    accs, times = list(ACC.values()), [statistics.median(t) for t in EPOCH_S.values()]
    assert (row["seeds"], row["n"]) == ("1,2,3", "3")
    assert float(row["test acc mean"]) == pytest.approx(statistics.mean(accs), abs=1e-4)
    assert float(row["test acc sd"]) == pytest.approx(statistics.stdev(accs), abs=1e-4)
    half = 4.303 * statistics.stdev(accs) / math.sqrt(3)
    low, high = (float(x) for x in row["test acc 95% CI"].strip("[]").split(", "))
    assert (low, high) == (pytest.approx(statistics.mean(accs) - half, abs=1e-4), pytest.approx(statistics.mean(accs) + half, abs=1e-4))
    assert float(row["epoch s mean"]) == pytest.approx(statistics.mean(times), abs=1e-3)

    markdown = (seeds / "report.md").read_text()
    assert "## Seeds" in markdown and "| seed |" in markdown
    # One device everywhere: no speed-ups between seeds, no plot against devices, no scaling without DDP.
    assert "speed-up" not in markdown.lower() and "epoch_time.png" not in markdown and "Predicted scaling" not in markdown
    assert not (seeds / "epoch_time.png").exists() and not (seeds / "scaling.md").exists()
    assert imread(seeds / "val_acc.png").shape[0] > 100


def test_legend_tells_seeds_and_settings_apart(seeds):
    from src.report import _labels, collect_runs

    labels = _labels(collect_runs(seeds))
    assert len(set(labels)) == len(labels) == 4
    assert sum(" seed 1" in label for label in labels) == 2  # two settings ran seed 1: told apart by lr
    assert any("lr=0.2" in label for label in labels)


def test_the_report_over_outputs_tells_the_truth(tmp_path):
    """Evaluations apart from training runs; no seed statistics over two runs of one seed; no interval where it
    would reach past what a time can take; the bytes column from the epoch means of a run too short for per-step points."""
    root = tmp_path / "outputs"
    setting = {"seed": 42, "lr": 0.1, "precision_used": "32-true"}
    write_run(root / "runs" / "a", {**config("auto", 1), "seed": 42}, {"time/epoch_s": [1.0], "test/acc": [0.8]}, setting)
    write_run(root / "runs" / "b", {**config("auto", 1), "seed": 42}, {"time/epoch_s": [9.0], "test/acc": [0.7]}, setting)
    for seed, epoch_s in ((1, 0.5), (2, 14.0)):  # far apart: Student's t over 2 seeds reaches below 0 s
        write_run(root / "runs" / f"seed{seed}", {**config("ddp", 2), "seed": seed},
                  {"time/epoch_s": [epoch_s], "test/acc": [0.8], "xfer/bytes_per_step_epoch": [1000.0]},
                  {"seed": seed, "lr": 0.1, "precision_used": "32-true"})
    # An evaluation records no HParams row: what it scored is its config's ckpt_path.
    scored = write_run(root / "eval" / "scored", {**config("auto", 1), "seed": 42, "ckpt_path": "outputs/runs/a",
                                                  "precision_used": "32-true"}, {"test/acc": [0.75]})
    (scored / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"name": "eval"}}}), scored / ".hydra" / "hydra.yaml")

    result = call_main(report_main, str(root))
    assert result.returncode == 0, result.stderr
    with (root / "report.csv").open(newline="") as file:
        rows = {row["run"]: row for row in csv.DictReader(file)}
    assert set(rows) == {"runs/a", "runs/b", "runs/seed1", "runs/seed2"}
    assert rows["runs/seed1"]["comm_bytes_per_step"] == "1000.0"
    markdown = (root / "report.md").read_text()
    assert "## Evaluations" in markdown and "| eval/scored | outputs/runs/a | 0.7500 |" in markdown
    with (root / "seeds.csv").open(newline="") as file:
        groups = list(csv.DictReader(file))
    assert [group["seeds"] for group in groups] == ["1,2"]  # not the two runs of seed 42
    assert groups[0]["epoch s 95% CI"] == "n=2 too small"  # not [0.000, ...]: t over 2 seeds reaches below 0 s
