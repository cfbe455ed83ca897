"""`python -m src.report` and a sweep's own report: on a real two-run sweep, on synthetic runs whose numbers
are known, and on bad input."""

import csv
import statistics
from pathlib import Path

import pytest
from matplotlib.image import imread
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary

from src import report as report_module
from src.report import COLUMNS, FILES, collect_runs, markdown_table, read_run
from src.report import main as report_main
from src.records import Result
from src.runs import RunFolder
from tests.helpers import call_main, hparams, run_cli, scalars

def report(*args: str):
    """`python -m src.report <args>`, in this process: the command's start-up is tested once, on the real sweep."""
    return call_main(report_main, *args)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0][:len(COLUMNS)] == list(COLUMNS)  # then the seconds to each target accuracy the runs timed
    return [dict(zip(rows[0], row)) for row in rows[1:]]


def assert_nothing_written(result, *folders: Path) -> None:
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for folder in folders:
        assert not folder.exists() or not any(name in {p.name for p in folder.iterdir()} for name in FILES)


# ---- a real sweep: LeNet under DDP on 1 and 2 processes, whose report the sweep writes as it ends ----

@pytest.fixture
def sweep(ddp_sweep) -> Path:
    """The sweep of LeNet under DDP on 2 processes and 1 (conftest's `ddp_sweep`): read here, never written."""
    return ddp_sweep.dir


@pytest.mark.slow
def test_sweep_callback_writes_the_report_and_a_tensorboard_table(sweep):
    for name in FILES:
        assert (sweep / name).is_file(), name
    rows = read_csv(sweep / "report.csv")
    assert sorted(int(r["devices"]) for r in rows) == [1, 2]
    events = EventAccumulator(str(sweep / "report"), size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("report/text_summary")
    assert text.tensor_proto.string_val[0].decode() == markdown_table(collect_runs(sweep))


@pytest.mark.slow
def test_cli_report_matches_the_runs_event_files(sweep, tmp_path):
    out = tmp_path / "report"
    result = run_cli("src.report", str(sweep), "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = {row["run"]: row for row in read_csv(out / "report.csv")}
    run_dirs = [p.parent.parent for p in sweep.glob("*/.hydra/config.yaml")]
    assert set(rows) == {d.name for d in run_dirs} and len(rows) == 2

    epoch_s = {}
    for run_dir in run_dirs:
        row, logged = rows[run_dir.name], scalars(run_dir)
        config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
        assert (row["model"], row["strategy"]) == ("lenet", "ddp")
        assert (int(row["devices"]), int(row["num_nodes"])) == (config.devices, config.num_nodes)
        assert row["precision"] == hparams(run_dir)["precision_used"]
        assert float(row["test_acc"]) == pytest.approx(logged["test/acc"][-1])
        assert float(row["epoch_s"]) == pytest.approx(statistics.median(logged["time/epoch_s"]))
        assert float(row["samples_per_s"]) == pytest.approx(statistics.median(logged["time/samples_per_s"]))
        if config.devices == 1:  # one process sends nothing: no bytes are counted
            assert row["comm_bytes_per_step"] == "" and "xfer/bytes_per_step" not in logged
        else:
            assert float(row["comm_bytes_per_step"]) == pytest.approx(statistics.median(logged["xfer/bytes_per_step"]))
        epoch_s[config.devices] = float(row["epoch_s"])
    speedups = {int(r["devices"]): float(r["speedup"]) for r in rows.values()}
    assert speedups[1] == pytest.approx(1.0)
    assert speedups[2] == pytest.approx(epoch_s[1] / epoch_s[2])

    for name in ("val_acc.png", "epoch_time.png"):
        height, width, _ = imread(out / name).shape
        assert height > 100 and width > 100
    markdown = (out / "report.md").read_text()
    assert all(name in markdown for name in rows) and "](val_acc.png)" in markdown
    assert not (out / "report").exists()  # TensorBoard text is the callback's, not the CLI's


# ---- synthetic runs: the numbers are ours, so the arithmetic can be checked exactly ----

def write_run(folder: Path, config: dict, series: dict[str, list[float]], params: dict | None = None,
              finished: bool = True) -> Path:
    """A run folder of known numbers; `finished`: with its result, as a run that ended writes it."""
    folder.mkdir(parents=True)
    if finished:
        Result({}, "done", step=len(series.get("time/epoch_s", []))).save(folder)
    OmegaConf.save(OmegaConf.create(config), folder / "config.yaml")
    with SummaryWriter(log_dir=str(folder)) as writer:
        for tag, values in series.items():
            for step, value in enumerate(values):
                writer.add_scalar(tag, value, step)
        if params:
            for summary in hparams_summary(params, {}):
                writer.file_writer.add_summary(summary)
    return folder


def config(strategy: str, devices: int, num_nodes: int = 1, precision: str = "32") -> dict:
    return {"model_name": "resnet18", "strategy_name": strategy, "devices": devices, "num_nodes": num_nodes,
            "precision": precision}


TIMES = {"one": [3.0, 5.0, 4.0], "four": [1.0, 2.0, 1.5, 9.0], "fp32": [2.0, 2.5], "dp": [7.0]}
COMM = [100.0, 400.0, 200.0]


@pytest.fixture
def synthetic(tmp_path) -> Path:
    root = tmp_path / "outputs"
    write_run(root / "one", config("ddp", 1, precision="16-mixed"),
              {"time/epoch_s": TIMES["one"], "test/acc": [0.5, 0.7]}, {"precision_used": "bf16-mixed"})
    write_run(root / "deep" / "er" / "four", config("ddp", 2, num_nodes=2, precision="16-mixed"),
              {"time/epoch_s": TIMES["four"], "xfer/bytes_per_step": COMM}, {"precision_used": "bf16-mixed"})
    write_run(root / "fp32", config("ddp", 4), {"time/epoch_s": TIMES["fp32"]}, {"precision_used": "32-true"})
    write_run(root / "dp", config("dp", 2), {"time/epoch_s": TIMES["dp"]})
    (root / "config_only").mkdir(parents=True)
    (root / "config_only" / "config.yaml").write_text("devices: 1\n")
    with SummaryWriter(log_dir=str(root / "events_only")) as writer:
        writer.add_scalar("time/epoch_s", 1.0, 0)
    return root


def test_synthetic_runs_give_known_medians_and_speedups(synthetic, tmp_path):
    result = report(str(synthetic), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    rows = {row["run"]: row for row in read_csv(tmp_path / "out" / "report.csv")}
    assert set(rows) == {"one", "deep/er/four", "fp32", "dp"}  # config-only and events-only folders are no runs

    one, four = rows["one"], rows["deep/er/four"]
    assert one["precision"] == four["precision"] == "bf16-mixed"  # what ran, not what was asked for
    assert rows["dp"]["precision"] == "32"  # no HParams summary: the config's value
    assert float(one["epoch_s"]) == statistics.median(TIMES["one"])
    assert float(one["test_acc"]) == pytest.approx(0.7)
    assert float(one["speedup"]) == 1.0
    assert float(four["speedup"]) == pytest.approx(statistics.median(TIMES["one"]) / statistics.median(TIMES["four"]))
    assert float(four["comm_bytes_per_step"]) == statistics.median(COMM)
    assert (four["devices"], four["num_nodes"]) == ("2", "2")
    # No one-device run of the same strategy and precision: no speed-up, and empty cells stay empty.
    assert rows["fp32"]["speedup"] == rows["dp"]["speedup"] == ""
    assert one["comm_bytes_per_step"] == one["samples_per_s"] == ""


def test_a_speed_up_compares_runs_that_differ_in_devices_alone(tmp_path):
    """A one-device run of 4 batches an epoch is no baseline for a two-device run of 60 (measured before: 41.45)."""
    def run(name: str, devices: int, batches: int, epoch_s: float) -> None:
        write_run(tmp_path / name, config("ddp", devices), {"time/epoch_s": [epoch_s]},
                  {"devices": devices, "world_size": devices, "trainer.limit_train_batches": batches})

    run("short", 1, 4, 1.0)
    run("long", 1, 60, 12.0)
    run("long_on_two", 2, 60, 8.0)
    run("odd_on_two", 2, 30, 4.0)
    result = report(str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    rows = {row["run"]: row for row in read_csv(tmp_path / "out" / "report.csv")}
    assert float(rows["long_on_two"]["speedup"]) == pytest.approx(12.0 / 8.0)
    assert rows["odd_on_two"]["speedup"] == "", "no one-device run of 30 batches"
    assert float(rows["short"]["speedup"]) == float(rows["long"]["speedup"]) == 1.0


def test_a_run_that_stopped_before_its_result_is_marked_with_the_precision_it_recorded(tmp_path):
    """A killed run has no result.json and no HParams summary (both are written as a run ends)."""
    write_run(tmp_path / "done", config("ddp", 1, precision="auto"), {"time/epoch_s": [1.0]}, {"precision_used": "32-true"})
    write_run(tmp_path / "killed", {**config("ddp", 1, precision="auto"), "precision_used": "bf16-mixed"},
              {"time/epoch_s": [1.0]}, finished=False)
    result = report(str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    rows = {row["run"]: row for row in read_csv(tmp_path / "out" / "report.csv")}
    assert (rows["killed"]["finished"], rows["killed"]["precision"]) == ("no", "bf16-mixed")
    assert (rows["done"]["finished"], rows["done"]["precision"]) == ("yes", "32-true")
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| finished |" in table and "| killed | resnet18 | ddp | 1 | 1 | bf16-mixed | no |" in table


@pytest.mark.parametrize("epoch_tag", ["trainer/epoch", "epoch"])  # runs written before the rename too
def test_val_acc_is_placed_at_the_epoch_lightning_logged(tmp_path, epoch_tag):
    run = write_run(tmp_path / "run", config("auto", 1), {})
    with SummaryWriter(log_dir=str(run)) as writer:
        for epoch, (step, acc) in enumerate([(9, 0.4), (19, 0.6), (29, 0.7)]):
            writer.add_scalar("val/acc", acc, step)
            writer.add_scalar(epoch_tag, epoch, step)
    assert read_run(RunFolder(run, tmp_path)).val_acc == [(1, pytest.approx(0.4)), (2, pytest.approx(0.6)), (3, pytest.approx(0.7))]


def test_missing_folder_is_one_error_line(tmp_path):
    out = tmp_path / "out"
    assert_nothing_written(report(str(tmp_path / "nowhere"), "--out", str(out)), out)
    assert not out.exists()


def test_folder_without_runs_is_one_error_line_and_writes_nothing(synthetic):
    empty = synthetic / "config_only"
    assert_nothing_written(report(str(empty)), empty)
    assert_nothing_written(report(str(synthetic / "events_only")), synthetic / "events_only")


def test_out_that_is_a_file_and_missing_argument_are_one_error_line(synthetic, tmp_path):
    target = tmp_path / "taken"
    target.write_text("x")
    assert_nothing_written(report(str(synthetic), "--out", str(target)), synthetic)
    assert target.read_text() == "x"
    assert_nothing_written(report())


def test_an_unreadable_run_is_left_out_with_a_line_and_the_rest_is_reported(synthetic):
    (synthetic / "one" / "config.yaml").write_text("devices: [\n")
    result = report(str(synthetic))
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stderr.splitlines() if str(synthetic / "one") in line]
    assert line.startswith(f"warning: {synthetic / 'one'}: left out ({synthetic / 'one' / 'config.yaml'}: cannot be read")
    rows = [row for row in (synthetic / "report.md").read_text().splitlines() if row.startswith("| ")]
    assert len(rows) == 4 and not any(row.startswith("| one ") for row in rows)  # the header and three runs


def test_the_report_prints_its_own_lines_once_each(synthetic, caplog, monkeypatch):
    """A resumed run's event files purge the points it replays, as TensorBoard shows them; TensorBoard's reader says
    so at length, once per reading (a DDP run's scaling section read the folders again). The report reads each
    folder's event files once, what TensorBoard shows, without its text, and says a left-out run once."""
    readings = []
    reload = EventAccumulator.Reload
    monkeypatch.setattr(EventAccumulator, "Reload", lambda self: readings.append(self.path) or reload(self))
    four = synthetic / "deep" / "er" / "four"
    with SummaryWriter(log_dir=str(four), purge_step=2) as writer:  # resumed at step 2: drops 1.5 and 9.0
        writer.add_scalar("time/epoch_s", 6.0, 2)
    write_run(synthetic / "hooked", {**config("ddp", 2), "strategy": {"hook": None}}, {"time/epoch_s": [1.0]})
    (synthetic / "one" / "config.yaml").write_text("devices: [\n")
    result = report(str(synthetic))
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("warning:")] == [
        f"warning: {synthetic / 'one'}: left out ({synthetic / 'one' / 'config.yaml'}: cannot be read as a record "
        "(while parsing a flow node expected the node content, but found '<stream end>' in \"<byte string>\", "
        "line 2, column 1: ^))"]
    assert not [record for record in caplog.records if record.name.startswith("tensorboard")]
    assert readings and sorted(readings) == sorted(set(readings)), "a folder's event files read twice"
    rows = {row["run"]: row for row in read_csv(synthetic / "report.csv")}
    assert float(rows["deep/er/four"]["epoch_s"]) == statistics.median([1.0, 2.0, 6.0])


def test_a_crafted_folder_name_and_setting_reach_the_report_and_the_terminal_as_text(tmp_path):
    """Anyone may have written a run folder: its name and its records show in report.md as written (no HTML, heading
    or extra cell), start no formula in report.csv, and print no terminal escape."""
    name, model = "=1+2|<img src=x onerror=alert(1)>\x1b[2J", "-2+3 *x* `y`\n# Injected"
    write_run(tmp_path / name, {**config("ddp", 1), "model_name": model}, {"time/epoch_s": [2.0], "test/acc": [-0.5]})
    write_run(tmp_path / "bad\x1b[31m", config("ddp", 1), {"time/epoch_s": [1.0]})
    (tmp_path / "bad\x1b[31m" / "config.yaml").write_text("devices: [\n")
    result = report(str(tmp_path), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout + result.stderr
    assert f"warning: {tmp_path}/bad\\x1b[31m: left out ({tmp_path}/bad\\x1b[31m/config.yaml: " in result.stderr

    markdown = (tmp_path / "out" / "report.md").read_text()
    [row] = [line for line in markdown.splitlines() if "onerror" in line]
    assert row.startswith(r"| =1+2\|&lt;img src=x onerror=alert(1)&gt;\\x1b\[2J | -2+3 \*x\* \`y\`\\n\# Injected | ddp |")
    assert "<" not in markdown and "\x1b" not in markdown and not any(line.startswith("# Injected")
                                                                      for line in markdown.splitlines())
    [run] = read_csv(tmp_path / "out" / "report.csv")
    assert (run["run"], run["model"], run["test_acc"]) == ("'" + name, "'" + model, "-0.5")  # a number stays one


# ---- disturbed runs: shown and marked everywhere, never dropped ----

def test_a_speed_up_from_disturbed_runs_is_shown_marked_and_beside_the_one_without_them(tmp_path):
    root = tmp_path / "outputs"
    write_run(root / "one", {**config("ddp", 1), "seed": 1}, {"time/epoch_s": [4.0], "usage/disturbed": [0.0]}, {"seed": 1})
    write_run(root / "one_busy", {**config("ddp", 1), "seed": 2}, {"time/epoch_s": [12.0], "usage/disturbed": [1.0]},
              {"seed": 2})
    write_run(root / "two", config("ddp", 2), {"time/epoch_s": [2.0, 2.0], "usage/disturbed": [0.0, 0.0]})
    write_run(root / "four", config("ddp", 4), {"time/epoch_s": [1.0, 9.0], "usage/disturbed": [1.0, 1.0]})
    assert report(str(root)).returncode == 0
    rows = {row["run"]: row for row in read_csv(root / "report.csv")}
    assert float(rows["two"]["speedup"]) == pytest.approx(4.0 / 2.0)  # without the mostly disturbed baseline run
    assert float(rows["two"]["speedup_all"]) == pytest.approx(8.0 / 2.0)  # with it
    assert float(rows["four"]["speedup"]) == pytest.approx(4.0 / 5.0)  # mostly disturbed itself: shown, marked
    markdown = (root / "report.md").read_text()
    [two] = [line for line in markdown.splitlines() if line.startswith("| two |")]
    [four] = [line for line in markdown.splitlines() if line.startswith("| four |")]
    assert "| 2.00 | 4.00* |" in two and "| 0.80* |" in four and "left out" not in markdown
    assert "two (1 run); four (1 run)" in markdown and "`speed-up, disturbed runs too`" in markdown


def test_the_epoch_time_plot_marks_disturbed_points(tmp_path, monkeypatch):
    plotted = []
    monkeypatch.setattr(report_module, "_plot", lambda path, lines, **settings: plotted.append(lines))
    write_run(tmp_path / "one", config("ddp", 1), {"time/epoch_s": [4.0], "usage/disturbed": [0.0]})
    write_run(tmp_path / "two", config("ddp", 2), {"time/epoch_s": [3.0], "usage/disturbed": [1.0]})
    report_module.plot_epoch_time(collect_runs(tmp_path), tmp_path / "epoch_time.png")
    [[line, marked]] = plotted
    assert line[2]["label"].endswith(" *")
    assert (list(marked[0]), list(marked[1])) == ([2], [3.0]) and marked[2]["label"].startswith("* disturbed")


def test_seed_statistics_of_disturbed_epoch_times_are_marked(tmp_path):
    for seed, disturbed in ((1, 0.0), (2, 1.0), (3, 0.0)):
        write_run(tmp_path / f"s{seed}", {**config("ddp", 1), "seed": seed},
                  {"time/epoch_s": [2.0 + seed], "test/acc": [0.8], "usage/disturbed": [disturbed]}, {"seed": seed})
    assert report(str(tmp_path)).returncode == 0
    with (tmp_path / "seeds.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert (row["epoch s mean"], row["epoch s sd"]) == ("4.000*", "1.000*") and row["test acc mean"] == "0.8000"
