"""Time to accuracy: the training seconds and optimizer steps until val/acc first reached each target, on the epoch
timer's clock; kept over a resume, recorded as typed values, and compared per setting in the report."""

import csv
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger
from matplotlib.image import imread
from torch.utils.data import DataLoader, TensorDataset

from src import config, records
from src.callbacks import timing
from src.callbacks.timing import EpochTimer, TimeToAccuracy
from src.errors import UsageError
from src.report import main as report_main
from src.report import mean_curve, resolution_digits, time_to_cell
from tests.helpers import QUICK, call_main, composed, scalar_steps, scalars, train_here
from tests.test_report import config as run_config
from tests.test_report import write_run
from tests.test_timing import Clock

TRAIN_S, VALIDATE_S = 1.0, 10.0
ACCURACIES = [0.50, 0.82, 0.84, 0.91]  # at validations after 2, 4, 6 and 8 training batches




class Climbing(BoringModel):
    """Each training batch takes TRAIN_S of the clock, each validation VALIDATE_S; val/acc follows ACCURACIES."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.validations = clock, 0

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 32), torch.zeros(8)), batch_size=2)

    def training_step(self, batch, batch_idx):
        self.clock.now += TRAIN_S
        return super().training_step(batch[0], batch_idx)

    def validation_step(self, batch, batch_idx):
        self.clock.now += VALIDATE_S
        return super().validation_step(batch, batch_idx)

    def on_validation_epoch_end(self):
        self.log("val/acc", ACCURACIES[self.validations])
        self.validations += 1


class Kept(Logger):
    """What the callbacks log, in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[tuple[int, dict]] = []

    name, version = "kept", 0

    def log_metrics(self, metrics, step=None):
        self.points.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def logged(self, tag: str) -> list[tuple[int, float]]:
        return [(step, metrics[tag]) for step, metrics in self.points if tag in metrics]


class Compiled(Climbing):
    """Its first training step compiles: WARMUP_S more of the clock, counted in `warmup_s` as the module counts it."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.warmup_s = 0.0

    def training_step(self, batch, batch_idx):
        if not self.warmup_s:
            self.clock.now += WARMUP_S
            self.warmup_s = WARMUP_S
        return super().training_step(batch, batch_idx)


WARMUP_S = 5.0


def climb(monkeypatch, targets=(0.80, 0.85, 0.95), max_epochs: int = 2,
          model: type[Climbing] = Climbing) -> tuple[TimeToAccuracy, Kept, Clock]:
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    reached, kept = TimeToAccuracy(targets), Kept()
    trainer = Trainer(max_epochs=max_epochs, limit_train_batches=4, limit_val_batches=1, val_check_interval=2,
                      num_sanity_val_steps=0, callbacks=[EpochTimer(), reached], logger=kept, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, accelerator="cpu", devices=1)
    trainer.fit(model(clock))
    return reached, kept, clock


def test_each_target_is_timed_on_training_seconds_at_the_first_validation_that_reached_it(monkeypatch):
    reached, kept, clock = climb(monkeypatch)
    assert clock.now == pytest.approx(8 * TRAIN_S + 4 * VALIDATE_S)  # validation took most of the wall time
    # 0.82 after 4 training batches, 0.91 after 8: validation is left out of the seconds; 0.95 never.
    assert reached.summary() == [{"target": 0.80, "seconds": 4 * TRAIN_S, "step": 4, "warmup_s": 0.0},
                                 {"target": 0.85, "seconds": 8 * TRAIN_S, "step": 8, "warmup_s": 0.0},
                                 {"target": 0.95, "seconds": None, "step": None, "warmup_s": None}]
    assert reached.verdict() == "val/acc 0.85 after 8.0 s of training, step 8"
    assert [value for _, value in kept.logged("time/trained_s")] == [2.0, 4.0, 6.0, 8.0]
    assert kept.logged("time/to_val_acc_0.80") == [(3, 4.0)] and kept.logged("time/to_val_acc_0.85") == [(7, 8.0)]
    assert not kept.logged("time/to_val_acc_0.95")


def test_the_warm_up_counts_in_the_time_to_accuracy_and_not_in_the_epoch_time(monkeypatch):
    """compile=true pays its compilation before any target: leaving it out would make it look faster than it is."""
    reached, kept, _ = climb(monkeypatch, model=Compiled)
    assert reached.summary()[:2] == [{"target": 0.80, "seconds": 4 * TRAIN_S + WARMUP_S, "step": 4, "warmup_s": WARMUP_S},
                                     {"target": 0.85, "seconds": 8 * TRAIN_S + WARMUP_S, "step": 8, "warmup_s": WARMUP_S}]
    assert [value for _, value in kept.logged("time/epoch_s")] == [4 * TRAIN_S, 4 * TRAIN_S]
    assert [value for _, value in kept.logged("time/trained_s")] == [7.0, 9.0, 11.0, 13.0]
    assert reached.verdict() == "val/acc 0.85 after 13.0 s of training (warm-up 5.0 s of it), step 8"


def test_a_run_resumed_mid_epoch_carries_the_epoch_s_seconds_and_its_warm_up(monkeypatch):
    """`step.ckpt` is saved mid-epoch: the resumed run's clock goes on from the seconds trained before it."""
    clock = Clock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    trainer = SimpleNamespace(world_size=1, is_last_batch=False)
    module = SimpleNamespace(device=torch.device("cpu"), warmup_s=0.0)
    batch = (torch.zeros(2, 32), torch.zeros(2))
    before = EpochTimer()
    before.on_train_start(trainer, module)
    before.on_train_epoch_start(trainer, module)
    clock.now += 3.0 + 2.0
    module.warmup_s = 2.0  # compiled in the first step
    before.on_train_batch_end(trainer, module, None, batch, 0)
    state = json.loads(json.dumps(before.state_dict()))  # as step.ckpt keeps it
    assert (state["epoch_so_far_s"], state["epoch_samples"], state["warmup_s"]) == (3.0, 2, 2.0)

    resumed, again = EpochTimer(), SimpleNamespace(device=torch.device("cpu"), warmup_s=0.0)
    resumed.load_state_dict(state)
    resumed.on_train_start(trainer, again)  # no on_train_epoch_start mid-epoch
    clock.now += 4.0 + 1.5
    again.warmup_s = 1.5  # the new process compiles again
    assert resumed.trained_s(again) == pytest.approx(3.0 + 4.0)
    assert resumed.warmup_s(again) == pytest.approx(2.0 + 1.5)

    trainer.is_last_batch = True  # an epoch's last batch: a checkpoint now is at the epoch's end, nothing to carry
    resumed.on_train_batch_end(trainer, again, None, batch, 1)
    assert resumed.state_dict()["epoch_so_far_s"] == 0.0


def test_a_run_that_reached_no_target_says_so(monkeypatch):
    reached, _, _ = climb(monkeypatch, targets=(0.99,), max_epochs=1)
    assert reached.verdict() == "val/acc reached none of 0.99"


def test_what_was_reached_survives_a_resume_but_not_a_start_from_another_folder():
    first = TimeToAccuracy()
    first.reached = {"0.80": (4.0, 4, 1.5)}
    resumed = TimeToAccuracy()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint keeps it
    assert resumed.reached == {"0.80": (4.0, 4, 1.5)}
    older = TimeToAccuracy()  # a checkpoint written before the warm-up was kept
    older.load_state_dict({"reached": {"0.80": [4.0, 4]}})
    assert older.reached == {"0.80": (4.0, 4, 0.0)}
    foreign = TimeToAccuracy()
    foreign.not_taken_up = True
    foreign.load_state_dict(first.state_dict())
    assert foreign.reached == {}


def test_targets_must_be_accuracies():
    cfg = composed("callbacks.time_to_accuracy.targets=[0.8,1.5]")
    with pytest.raises(UsageError, match=r"^callbacks\.time_to_accuracy\.targets=\[0\.8, 1\.5\] is not allowed; .*"
                                         r"a list of validation accuracies in \(0, 1\]"):
        config.check(cfg)
    config.check(composed("callbacks.time_to_accuracy.targets=[]"))  # none: the callback times nothing


def test_the_record_is_read_back_as_typed_values(tmp_path):
    reached = [{"target": 0.85, "seconds": 8.0, "step": 8}, {"target": 0.9, "seconds": None, "step": None}]
    records.Result({"test/acc": 0.9}, "line", 8, time_to_accuracy=reached).save(tmp_path)
    assert records.result(tmp_path).time_to_accuracy == reached
    for bad in ([{"target": 2.0, "seconds": 1.0, "step": 1}], [{"target": 0.8, "seconds": 1.0, "step": None}],
                [{"target": 0.8, "seconds": "1", "step": 1}], [{"target": 0.8, "seconds": 1.0, "step": True}], "x"):
        data = json.loads((tmp_path / "result.json").read_text())
        (tmp_path / "result.json").write_text(json.dumps({**data, "time_to_accuracy": bad}))
        assert records.result(tmp_path).time_to_accuracy == [], bad


def test_a_real_run_records_its_times_to_accuracy(tmp_path, data_root):
    run = tmp_path / "run"
    result = train_here(*QUICK, "max_epochs=2", "callbacks.time_to_accuracy.targets=[0.05,0.999]", f"hydra.run.dir={run}")
    assert result.returncode == 0, result.stderr[-3000:]
    [low, high] = records.result(run).time_to_accuracy
    assert low["target"] == 0.05 and low["seconds"] > 0 and low["step"] == 4  # ten classes: chance beats 0.05
    assert high == {"target": 0.999, "seconds": None, "step": None, "warmup_s": None}
    assert low["warmup_s"] == 0.0  # nothing compiled
    assert f"val/acc 0.05 after {low['seconds']:.1f} s of training, step 4" in result.stdout + result.stderr
    points, steps = scalars(run), scalar_steps(run)
    assert steps["time/trained_s"] == steps["val/acc"]  # each validation's accuracy beside its training seconds
    assert points["time/to_val_acc_0.05"] == [pytest.approx(low["seconds"])]  # TensorBoard keeps float32
    assert points["time/trained_s"][0] == pytest.approx(low["seconds"])
    # Each epoch says what it competed with; how much depends on what else this machine runs.
    assert len(points["usage/disturbed"]) == len(points["time/epoch_s"]) == 2
    said = re.search(r"(\d+) of 2 epoch times disturbed", result.stdout + result.stderr)  # the result line's count
    assert sum(points["usage/disturbed"]) == (int(said[1]) if said else 0) and set(points["usage/disturbed"]) <= {0.0, 1.0}
    assert all(share > 0 for share in points["usage/cpu_share"])
    assert len(points["usage/others_share"]) == len(points["usage/cpu_wait"]) == 2  # Linux: read from /proc


# ---- the report on made-up runs ----

def seeds_of(root, strategy: str, times: dict[int, tuple[float | None, float | None]], disturbed=None):
    """A run per seed: its seconds to 0.80 and 0.90 (None: never reached), and a two-validation curve."""
    for seed, (to_80, to_90) in times.items():
        folder = write_run(root / f"{strategy}_seed={seed}", {**run_config(strategy, 2), "seed": seed},
                           {"time/epoch_s": [5.0, 5.0], "time/trained_s": [5.0, 10.0], "val/acc": [0.7 + seed / 100, 0.9],
                            "test/acc": [0.9], **({"usage/disturbed": disturbed[seed]} if disturbed else {})},
                           {"seed": seed, "strategy": strategy})
        result = records.result(folder)
        reached = [{"target": 0.8, "seconds": to_80, "step": None if to_80 is None else 10},
                   {"target": 0.9, "seconds": to_90, "step": None if to_90 is None else 20}]
        records.Result(result.metrics, result.line, result.step, time_to_accuracy=reached).save(folder)


def test_the_report_says_which_setting_gets_there_first(tmp_path):
    root = tmp_path / "sweep"
    seeds_of(root, "ddp", {1: (4.0, 9.0), 2: (6.0, None), 3: (5.0, 12.0)})
    seeds_of(root, "ddp_fp16", {1: (3.0, None), 2: (2.0, None), 3: (2.5, 8.0)})
    result = call_main(report_main, str(root))
    assert result.returncode == 0, result.stderr
    with (root / "time_to_accuracy.csv").open(newline="") as file:
        rows = {row["setting"].split()[1]: row for row in csv.DictReader(file)}
    # Validated every 5 s: whole seconds.
    assert rows["ddp"]["validated every"] == "5 s" and rows["ddp"]["seeds"] == "3 seeds"
    assert rows["ddp"]["s to val acc 0.80"] == "5 [4, 6] (3/3)"
    assert rows["ddp"]["s to val acc 0.90"] == "12 [9, 12] (2/3)"  # the seed that never got there is slowest
    assert rows["ddp_fp16"]["s to val acc 0.80"] == "2 [2, 3] (3/3)"
    assert rows["ddp_fp16"]["s to val acc 0.90"] == "never (1/3)"
    markdown = (root / "report.md").read_text()
    assert "## Time to accuracy" in markdown and "](acc_time.png)" in markdown
    assert imread(root / "acc_time.png").shape[0] > 100
    with (root / "report.csv").open(newline="") as file:
        per_run = {row["run"]: row for row in csv.DictReader(file)}
    assert per_run["ddp_fp16_seed=1"]["s_to_val_acc_0.80"] == "3.0"
    assert per_run["ddp_fp16_seed=1"]["s_to_val_acc_0.90"] == "never"


def test_the_median_counts_a_seed_that_never_reached_as_slowest():
    assert time_to_cell([10.0, None, None], marked=False) == "never (1/3)"
    assert time_to_cell([10.0, 20.0, None], marked=True) == "20.0* [10.0, 20.0] (2/3)"


def test_a_median_of_fewer_than_three_seeds_says_so():
    assert time_to_cell([7.0], marked=False) == "7.0 (1/1) (n=1: too few seeds for a median)"
    assert time_to_cell([4.0, 6.0], marked=False, digits=0) == "5 [4, 6] (2/2) (n=2: too few seeds for a median)"


def test_a_figure_is_printed_to_what_the_validation_interval_can_tell():
    """15.8 s and 17.8 s to 0.80, validated every 8 s, are both the first validation: whole seconds, never tenths."""
    assert [resolution_digits(interval) for interval in (8.0, 9.9, 16.0, 0.5, None)] == [0, 0, -1, 1, 1]
    assert time_to_cell([15.8, 17.8, 19.5], marked=False, digits=0) == "18 [16, 20] (3/3)"
    assert time_to_cell([15.8, 17.8, 19.5], marked=False, digits=-1) == "20 [20, 20] (3/3)"


def test_curves_over_seeds_are_averaged_where_all_of_them_reach():
    xs, mean, low, high = mean_curve([[(0.0, 0.0), (10.0, 1.0)], [(2.0, 0.2), (4.0, 0.8), (8.0, 0.8)]])
    assert xs == [2.0, 4.0, 8.0]  # from the latest start to the earliest end
    assert mean == pytest.approx([0.2, 0.6, 0.8]) and low == pytest.approx([0.2, 0.4, 0.8])
    assert high == pytest.approx([0.2, 0.8, 0.8])


def test_a_run_mostly_disturbed_is_left_out_of_the_median_and_a_partly_disturbed_one_marked(tmp_path):
    root = tmp_path / "sweep"
    seeds_of(root, "ddp", {1: (4.0, 9.0), 2: (6.0, 10.0), 3: (50.0, 90.0)},
             disturbed={1: [0.0, 0.0, 0.0], 2: [1.0, 0.0, 0.0], 3: [1.0, 1.0, 0.0]})
    result = call_main(report_main, str(root))
    assert result.returncode == 0, result.stderr
    with (root / "time_to_accuracy.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert row["seeds"] == "3 seeds (1 mostly disturbed: counted only after `;`)"
    # Without the mostly disturbed run, then with it: never dropped silently.
    assert row["s to val acc 0.80"] == ("5* [4, 6] (2/2) (n=2: too few seeds for a median); "
                                        "with the 1 disturbed: 6* [4, 50] (3/3)")
    assert not math.isnan(float(row["s to val acc 0.90"].split("*")[0]))


def test_a_sweep_whose_runs_were_all_disturbed_still_answers_marked_and_says_what_to_do(tmp_path):
    root = tmp_path / "sweep"
    seeds_of(root, "ddp", {1: (4.0, 9.0)}, disturbed={1: [1.0, 1.0]})
    seeds_of(root, "ddp_fp16", {1: (3.0, 8.0)}, disturbed={1: [1.0, 0.0]})
    assert call_main(report_main, str(root)).returncode == 0
    with (root / "time_to_accuracy.csv").open(newline="") as file:
        rows = {row["setting"].split()[1]: row for row in csv.DictReader(file)}
    assert rows["ddp"]["seeds"] == "1 seed (all mostly disturbed: figures marked *)"
    assert rows["ddp"]["s to val acc 0.80"] == "4* (1/1) (n=1: too few seeds for a median)"
    assert rows["ddp_fp16"]["s to val acc 0.90"] == "8* (1/1) (n=1: too few seeds for a median)"
    markdown = (root / "report.md").read_text()
    assert "left out*" not in markdown
    assert "Every run was disturbed" in markdown and "run again on a quiet machine" in markdown and "taskset" in markdown


def test_a_run_stopped_before_its_last_epoch_has_not_reached_yet_and_is_not_slowest(tmp_path):
    root = tmp_path / "sweep"
    seeds_of(root, "ddp", {1: (4.0, 9.0), 2: (6.0, 10.0), 3: (5.0, None)})
    for seed, max_epochs in ((1, 2), (2, 2), (3, 4)):  # seed 3 trained 2 of its 4 epochs, then stopped
        folder = root / f"ddp_seed={seed}"
        (folder / "config.yaml").write_text((folder / "config.yaml").read_text() + f"max_epochs: {max_epochs}\n")
    assert call_main(report_main, str(root)).returncode == 0
    with (root / "time_to_accuracy.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    # The median over the two that could say: not `never`, not 10 s counted against the stopped one.
    assert row["s to val acc 0.90"] == "10 [9, 10] (2/3, 1 not reached yet) (n=2: too few seeds for a median)"
    with (root / "report.csv").open(newline="") as file:
        per_run = {r["run"]: r for r in csv.DictReader(file)}
    assert per_run["ddp_seed=3"]["s_to_val_acc_0.90"] == "not reached yet"
    assert per_run["ddp_seed=1"]["s_to_val_acc_0.90"] == "9.0"
    assert "not reached yet" in (root / "report.md").read_text()


def test_a_killed_run_s_unreached_targets_are_not_reached_yet(tmp_path):
    root = tmp_path / "sweep"
    write_run(root / "killed", {**run_config("ddp", 2), "callbacks": {"time_to_accuracy": {"targets": [0.8]}}},
              {"time/epoch_s": [5.0], "time/trained_s": [5.0], "val/acc": [0.5]}, finished=False)
    assert call_main(report_main, str(root)).returncode == 0
    with (root / "time_to_accuracy.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert row["s to val acc 0.80"] == "not reached yet (0/1, 1 not reached yet)"


def test_the_warm_up_is_counted_in_the_figures_and_shown_apart(tmp_path):
    root = tmp_path / "sweep"
    seeds_of(root, "ddp", {1: (14.0, 19.0), 2: (16.0, 20.0), 3: (15.0, 22.0)})
    for seed in (1, 2, 3):
        folder = root / f"ddp_seed={seed}"
        data = json.loads((folder / "result.json").read_text())
        for entry in data["time_to_accuracy"]:
            entry["warmup_s"] = 10.0 + seed
        (folder / "result.json").write_text(json.dumps(data))
    assert call_main(report_main, str(root)).returncode == 0
    with (root / "time_to_accuracy.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert row["warm-up s (included)"] == "12" and row["s to val acc 0.80"] == "15 [14, 16] (3/3)"
    assert "warm-up (compiling, capturing CUDA graphs) is included" in (root / "report.md").read_text()
