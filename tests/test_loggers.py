"""The loggers beside TensorBoard (conf/logger/): CSV, MLflow and W&B, each read back by its own library's reader,
alone or several at once; the report of a run logged without TensorBoard; a logger whose package is missing."""

import csv
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from src.config import CONF_DIR
from src.errors import UsageError
from src.loggers import RUN_IDS, CSVRunLogger, WandbRunLogger, close_loggers, takes_purge_step
from src.records import result as recorded
from src.report import main as report_main
from tests.helpers import (INTERPRETER, QUICK, REPO, call_main, command_here, composed, cpu_precision, hparams,
                           scalar_steps, scalars, train_here, user_env)

# What W&B adds to each history row: its own counters, and Lightning's step as the x-axis.
WANDB_COUNTERS = {"_step", "_runtime", "_timestamp", "trainer/global_step"}
# Scalars the callbacks log straight to the loggers (epoch timing, hardware use), not through Lightning.
FROM_CALLBACKS = {"time/epoch_s", "time/samples_per_s", "time/epoch_s_median", "usage/peak_memory_mib"}


def tensorboard_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's scalars, `trainer/epoch` under Lightning's own name, as the other loggers have it."""
    steps, values = scalar_steps(run_dir), scalars(run_dir)
    return {"epoch" if tag == "trainer/epoch" else tag: list(zip(steps[tag], values[tag])) for tag in values}


def csv_points(path: Path) -> dict[str, list[tuple[int, float]]]:
    points: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            for tag, value in row.items():
                if tag != "step" and value:
                    points.setdefault(tag, []).append((int(row["step"]), float(value)))
    return points


def mlflow_run(tracking_uri: str, run_dir: Path):
    """The MLflow run (and its client) that the run folder logged to, found by its tag."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("dptrain")
    [run] = client.search_runs([experiment.experiment_id], filter_string=f"tags.run_dir = '{run_dir}'")
    return client, run


def mlflow_points(client, run) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)] for tag in run.data.metrics}


def wandb_records(run_dir: Path) -> list:
    """The records of the run's one W&B transaction log (`wandb/offline-run-*/run-<id>.wandb`)."""
    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return wandb_records_of(path)


def wandb_records_of(path: Path) -> list:
    """A W&B transaction log's records, each parsed as W&B's own Record message. The file is W&B's 7-byte header, then
    LevelDB's log format: 32 KiB blocks of chunks, each a 7-byte header (checksum, length, type: 1 whole, 2 first,
    3 middle, 4 last) and its bytes; a block's tail shorter than a header is padding."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, records, chunks, at = path.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while at + 7 <= len(data):
        if 32768 - at % 32768 < 7:
            at += 32768 - at % 32768
            continue
        length, kind = struct.unpack("<HB", data[at + 4:at + 7])
        chunks, at = chunks + data[at + 7:at + 7 + length], at + 7 + length
        if kind in (1, 4):
            records.append(Record.FromString(chunks))
            chunks = b""
    return records


def wandb_points(records: list) -> dict[str, list[tuple[int, float]]]:
    points: dict[str, list[tuple[int, float]]] = {}
    for record in (r for r in records if r.HasField("history")):
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for tag in row.keys() - WANDB_COUNTERS:
            points.setdefault(tag, []).append((row["trainer/global_step"], row[tag]))
    return points


def wandb_config(records: list) -> dict[str, object]:
    config = {}
    for record in (r for r in records if r.HasField("config")):
        config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    return {name: value for name, value in config.items() if not name.startswith("_")}


def assert_same_points(points: dict[str, list[tuple[int, float]]], expected: dict[str, list[tuple[int, float]]]) -> None:
    """The same scalars at the same steps with the same values (TensorBoard keeps them as float32)."""
    assert sorted(points) == sorted(expected)
    for tag, series in expected.items():
        assert [step for step, _ in sorted(points[tag])] == [step for step, _ in sorted(series)], tag
        assert [value for _, value in sorted(points[tag])] == pytest.approx([value for _, value in sorted(series)], rel=1e-6), tag


@pytest.fixture(scope="module")
def every_logger(tmp_path_factory, data_root) -> tuple[Path, str]:
    """A run logged to TensorBoard, CSV, MLflow (a store of its own) and W&B at once: its folder and MLflow store."""
    folder = tmp_path_factory.mktemp("loggers")
    run_dir, tracking_uri = folder / "run", f"sqlite:///{folder / 'mlflow.db'}"
    result = train_here(*QUICK, "logger=[tensorboard,csv,mlflow,wandb]", f"logger.mlflow.tracking_uri={tracking_uri}",
                        f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc=" in result.stdout.strip().splitlines()[-1]  # the result line stays the run's last
    return run_dir, tracking_uri


@pytest.mark.slow
def test_every_logger_gets_the_same_scalars(every_logger):
    run_dir, tracking_uri = every_logger
    expected = tensorboard_points(run_dir)
    assert FROM_CALLBACKS | {"train/loss", "val/acc", "test/acc", "epoch"} <= expected.keys()
    assert_same_points(csv_points(run_dir / "csv" / "metrics.csv"), expected)
    assert_same_points(mlflow_points(*mlflow_run(tracking_uri, run_dir)), expected)
    assert_same_points(wandb_points(wandb_records(run_dir)), expected)


@pytest.mark.slow
def test_every_logger_gets_the_run_settings(every_logger):
    run_dir, tracking_uri = every_logger
    settings = hparams(run_dir)  # TensorBoard's HParams record
    assert {"model", "precision_used", "optimizer", "lr_used", "seed", "params/total"} <= settings.keys()
    in_csv = yaml.safe_load((run_dir / "csv" / "hparams.yaml").read_text())
    assert in_csv == settings  # TensorBoard keeps numbers as floats: 42.0 == 42
    assert mlflow_run(tracking_uri, run_dir)[1].data.params == {name: str(value) for name, value in in_csv.items()}
    assert wandb_config(wandb_records(run_dir)) == in_csv


@pytest.mark.slow
def test_every_logger_is_closed_at_the_end(every_logger):
    run_dir, tracking_uri = every_logger
    _, run = mlflow_run(tracking_uri, run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name  # the folder the command named
    assert any(record.HasField("exit") for record in wandb_records(run_dir))  # written by the W&B run's finish
    assert "test/acc" in csv_points(run_dir / "csv" / "metrics.csv")  # the rows of the test, written when closed


@pytest.mark.parametrize("logger", ["tensorboard", "csv", "mlflow", "wandb", "[csv,wandb]"])
def test_every_logger_list_keeps_tensorboard(logger):
    """TensorBoard is every run's logger: a run logged to W&B alone was missing from TensorBoard and the report."""
    assert next(iter(composed(f"logger={logger}").logger)) == "tensorboard"


def test_logger_csv_writes_tensorboard_too_and_a_run_without_event_files_is_reported_from_its_metrics_csv(tmp_path,
                                                                                                          data_root):
    run_dir = tmp_path / "run"
    result = command_here("src.train", *QUICK, "logger=csv", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    [events] = run_dir.glob("events.out.tfevents.*")
    events.unlink()  # as a run logged before every list kept TensorBoard
    report = call_main(report_main, str(run_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr
    with (tmp_path / "report" / "report.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert float(row["test_acc"]) == pytest.approx(recorded(run_dir).metrics["test/acc"])
    assert row["precision"] == cpu_precision()  # the precision used, from the CSV logger's hparams.yaml
    assert float(row["epoch_s"]) > 0 and float(row["samples_per_s"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_a_logger_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, package):
    """The command as it runs where the package is not installed: here it is hidden from the interpreter's imports."""
    hide = (f"import runpy, sys; sys.modules[{package!r}] = None; sys.argv = ['src.train'] + sys.argv[1:]; "
            "runpy.run_module('src.train', run_name='__main__')")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", hide, *QUICK, f"logger=[tensorboard,{package}]", f"hydra.run.dir={run_dir}"],
                            cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: logger={package} needs the {package} package, which is not installed; install it with: "
        f"{INTERPRETER} -m pip install -e '.[{package}]'"]
    assert not run_dir.exists()


def test_each_csv_row_names_its_epoch_and_step_as_tensorboard_does(tmp_path, data_root):
    """Two epochs of 4 steps: the timing rows too carry their epoch, and the test's rows the last training epoch and
    step (Lightning's counters after training would put them one epoch and one step on)."""
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "logger=csv", "max_epochs=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    with (run_dir / "csv" / "metrics.csv").open(newline="") as file:
        rows = [{k: v for k, v in row.items() if v} for row in csv.DictReader(file)]
    assert all("epoch" in row for row in rows), [row for row in rows if "epoch" not in row]
    at = {(int(row["epoch"]), int(row["step"])) for row in rows}
    assert at == {(0, 3), (1, 7)}
    epochs = dict(zip(scalar_steps(run_dir)["trainer/epoch"], scalars(run_dir)["trainer/epoch"]))
    assert {(int(epochs[step]), step) for _, step in at} == at, "TensorBoard's epoch at each step"
    [test] = [row for row in rows if "test/acc" in row]
    assert (test["epoch"], test["step"]) == ("1", "7") and scalar_steps(run_dir)["test/acc"] == [7]
    assert {row["epoch"] for row in rows if "time/epoch_s" in row or "time/epoch_s_median" in row} == {"0", "1"}


def test_logger_mlflow_uses_the_default_store_beside_its_artifacts_and_the_report_says_what_it_cannot_read(
        tmp_path, data_root, monkeypatch):
    """The default store is outputs/mlflow.db of the folder the command runs in; MLflow's own artifact root would be
    ./mlruns there. A run logged to MLflow alone (its event files gone) is one the report cannot read."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = command_here("src.train", *QUICK, "logger=mlflow", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "outputs" / "runs").iterdir()
    assert not (tmp_path / "mlruns").exists()
    experiment = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}").get_experiment_by_name("dptrain")
    assert experiment.artifact_location == (tmp_path / "outputs" / "mlartifacts").as_uri()
    _, run = mlflow_run(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}", run_dir)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["test/acc"] == pytest.approx(recorded(run_dir).metrics["test/acc"])
    assert run.data.params["model"] == "lenet" and FROM_CALLBACKS <= run.data.metrics.keys()
    assert not (run_dir / "csv").exists()

    assert call_main(report_main, str(run_dir), "--out", str(tmp_path / "report_tb")).returncode == 0  # its TensorBoard
    [events] = run_dir.glob("events.out.tfevents.*")
    events.unlink()  # as a run logged before every list kept TensorBoard
    report = call_main(report_main, str(run_dir), "--out", str(tmp_path / "report"))
    assert report.returncode == 2
    [line] = report.stderr.strip().splitlines()
    assert line.startswith(f"error: {run_dir}: left out (") and "MLflow or W&B" in line, line


def test_a_resumed_csv_logger_keeps_the_rows_before_its_checkpoint(tmp_path, recwarn):
    first = CSVRunLogger(tmp_path, name="csv", version="")
    for step in range(6):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.save()
    resumed = CSVRunLogger(tmp_path, name="csv", version="", purge_step=4)  # a checkpoint at optimizer step 4
    resumed.log_metrics({"train/loss": 40.0, "val/acc": 0.5}, step=4)
    resumed.save()
    assert csv_points(tmp_path / "csv" / "metrics.csv") == {
        "train/loss": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)], "val/acc": [(4, 0.5)]}
    assert not [w for w in recwarn if "Experiment logs directory" in str(w.message)]


@pytest.mark.slow
def test_a_wandb_run_ends_when_its_logger_is_closed(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")  # put back after the test: the offline logger sets it
    logger = WandbRunLogger(offline=True, save_dir=tmp_path, project="dptrain", settings={"silent": True, "console": "off"})
    logger.log_metrics({"train/loss": 1.0}, step=0)
    assert wandb.run is not None
    close_loggers([logger])
    assert wandb.run is None
    wandb.teardown()  # as the process's exit does: W&B's service writes the last records of the run's file after it ended
    records = wandb_records(tmp_path)
    assert any(record.HasField("exit") for record in records) and wandb_points(records) == {"train/loss": [(0, 1.0)]}


@pytest.mark.slow
def test_the_mlflow_logger_turns_off_mlflows_usage_reports(tmp_path):
    """MLflow sends reports of its use to its makers' servers, unless told not to or where it sees CI or pytest: so the
    logger is built in an interpreter whose environment has none of their variables."""
    code = ("import sys; from src.loggers import MLflowRunLogger; MLflowRunLogger(tracking_uri=sys.argv[1]); "
            "from mlflow.telemetry import client, utils; print(utils._IS_IN_CI_ENV_OR_TESTING, client.get_telemetry_client())")
    result = subprocess.run([sys.executable, "-c", code, f"sqlite:///{tmp_path / 'mlflow.db'}"], cwd=REPO,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "None"]


def test_the_loggers_that_take_a_resumed_runs_purge_step():
    configs = {path.stem: OmegaConf.load(path)[path.stem] for path in (CONF_DIR / "logger").glob("*.yaml")}
    assert {name for name, config in configs.items() if takes_purge_step(config)} == {"tensorboard", "csv"}
    assert {"tensorboard", "csv", "mlflow", "wandb"} <= configs.keys()


def stopped_after_epoch_one(run_dir: Path, *args: str, cwd: Path | None = None) -> list[str]:
    """A run of two epochs stopped by SIGTERM right after its first epoch's checkpoints, in this process (run from
    `cwd`); what its resume types again (the stop, which a resume never takes from the records, and `args`)."""
    again = ["+callbacks.term._target_=tests.faults.SignalAfterCheckpoints", "+callbacks.term.epoch=0",
             f"+callbacks.term.mark={(cwd or run_dir.parent) / 'stopped'}", *args]
    result = command_here("src.train", *QUICK, "max_epochs=2", *again, f"hydra.run.dir={run_dir}", cwd=cwd)
    assert result.returncode == 143, result.stderr[-3000:]
    return again


def test_a_resumed_run_logs_on_into_its_mlflow_run_which_holds_its_settings_from_the_start(tmp_path, data_root):
    """Two MLflow runs for one run folder were seen: the stopped attempt's left RUNNING without params, the resume's."""
    run_dir, tracking_uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    again = stopped_after_epoch_one(run_dir, "logger=mlflow", f"logger.mlflow.tracking_uri={tracking_uri}")
    client, stopped = mlflow_run(tracking_uri, run_dir)
    assert stopped.info.status == "KILLED" and stopped.data.params["model"] == "lenet"
    assert json.loads((run_dir / RUN_IDS).read_text()) == {"mlflow": stopped.info.run_id}
    assert [step for step, _ in mlflow_points(client, stopped)["val/acc"]] == scalar_steps(run_dir)["val/acc"]

    resumed = train_here(*QUICK, "ckpt_path=last", *again, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, run = mlflow_run(tracking_uri, run_dir)  # one run for the folder, the same one
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert len(mlflow_points(client, run)["val/acc"]) == 2 and run.data.params["tested_weights"] == "best"
    assert {name: value for name, value in run.data.params.items() if name != "tested_weights"} == stopped.data.params


@pytest.mark.slow  # W&B's own service process
def test_a_resumed_run_logs_on_into_its_wandb_run(tmp_path, data_root, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    again = stopped_after_epoch_one(run_dir, "logger=wandb")
    [stopped] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    resumed = train_here(*QUICK, "ckpt_path=last", *again, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    import wandb

    wandb.teardown()  # as the process's exit does: the service writes the run's last records
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    run_id = json.loads((run_dir / RUN_IDS).read_text())["wandb"]
    assert stopped in files and [file.name for file in files] == [f"run-{run_id}.wandb"] * 2  # one W&B run, resumed
    first = wandb_records_of(stopped)
    assert any(record.HasField("exit") and record.exit.exit_code == 1 for record in first)  # ended as it stopped
    assert wandb_config(first)["model"] == "lenet"  # its settings from the start


def test_a_logger_run_ids_record_is_read_as_plain_ids_and_taken_by_mlflow_and_wandb_alone(tmp_path):
    from src.loggers import kept_run_ids, resuming

    assert kept_run_ids(tmp_path) == {}
    (tmp_path / RUN_IDS).write_text('{"mlflow": "0123abcd", "wandb": "x1y2z3"}')
    assert kept_run_ids(tmp_path) == {"mlflow": "0123abcd", "wandb": "x1y2z3"}
    nodes = composed("logger=[tensorboard,csv,mlflow,wandb]").logger
    assert [resuming(node, "x1y2z3") for node in nodes.values()] == [{}, {}, {"run_id": "x1y2z3"}, {"id": "x1y2z3"}]
    for bad in ('{"mlflow": "../../etc"}', '["0123abcd"]', '{"mlflow": 7}', '{"mlflow": "${oc.env:HOME}"}'):
        (tmp_path / RUN_IDS).write_text(bad)
        with pytest.raises(UsageError, match=rf"^{tmp_path / RUN_IDS}: holds no logger run ids"):
            kept_run_ids(tmp_path)


def test_a_run_moved_with_its_checkout_resumes_there_into_a_new_mlflow_run(tmp_path, data_root, monkeypatch):
    """The default store is named by the folder the command runs in: a resume from the moved checkout was refused, as
    its logger.mlflow.tracking_uri named the old one. It resumes, into a new MLflow run tagged with the folder where it
    is now: only that tag ties a folder to a tracking run, and the old run is left as it was."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    checkout, moved = tmp_path / "checkout", tmp_path / "moved"
    checkout.mkdir()
    again = stopped_after_epoch_one(Path("outputs/runs/run"), "logger=mlflow", cwd=checkout)
    checkout.rename(moved)
    resumed = command_here("src.train", *QUICK, "ckpt_path=last", *again, "hydra.run.dir=outputs/runs/run", cwd=moved)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, run = mlflow_run(f"sqlite:///{moved / 'outputs' / 'mlflow.db'}", moved / "outputs" / "runs" / "run")
    assert run.info.status == "FINISHED" and len(mlflow_points(client, run)["val/acc"]) == 1  # the second epoch
    _, before = mlflow_run(f"sqlite:///{moved / 'outputs' / 'mlflow.db'}", checkout / "outputs" / "runs" / "run")
    assert before.info.run_id != run.info.run_id and len(mlflow_points(client, before)["val/acc"]) == 1


def test_a_resume_never_logs_into_another_folders_mlflow_run(tmp_path, data_root):
    """`logger_runs.json` pointing at another folder's MLflow run made a resume rewrite that run's tags, metrics and
    end time: a run tagged with a folder that is there and is not this one is never taken up."""
    run_dir, other_dir, tracking_uri = tmp_path / "run", tmp_path / "other", f"sqlite:///{tmp_path / 'mlflow.db'}"
    again = stopped_after_epoch_one(run_dir, "logger=mlflow", f"logger.mlflow.tracking_uri={tracking_uri}")
    client, stopped = mlflow_run(tracking_uri, run_dir)
    other_dir.mkdir()
    other = client.create_run(stopped.info.experiment_id, tags={"run_dir": str(other_dir)})
    client.set_terminated(other.info.run_id, status="FINISHED")
    before = client.get_run(other.info.run_id)
    (run_dir / RUN_IDS).write_text(json.dumps({"mlflow": other.info.run_id}))
    resumed = train_here(*QUICK, "ckpt_path=last", *again, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = client.get_run(other.info.run_id)
    assert (after.data.tags, after.data.metrics, after.info.end_time, after.info.status) == (
        before.data.tags, before.data.metrics, before.info.end_time, before.info.status)
    assert json.loads((run_dir / RUN_IDS).read_text())["mlflow"] not in (other.info.run_id, stopped.info.run_id)


def test_an_mlflow_run_is_named_by_its_folder_with_its_date_and_time_and_says_where_its_page_is(
        tmp_path, data_root, monkeypatch):
    """MLflow's UI opens on its GenAI view: the run prints, and keeps in train.log, the command that serves its store
    and the address of its own page, by the store's experiment and run ids."""
    import re

    from src.loggers import STAMP

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    result = command_here("src.train", *QUICK, "logger=mlflow", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (tmp_path / "outputs" / "runs").iterdir()
    store = f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    _, run = mlflow_run(store, run_dir)
    assert run.info.run_name == run_dir.name and STAMP.match(run.info.run_name)
    said = re.findall(r"MLflow run: (\S+) ui --backend-store-uri (\S+), then http://127\.0\.0\.1:5000/#/experiments/"
                      r"(\w+)/runs/(\w+)$", result.stdout + result.stderr, flags=re.M)
    mlflow_ui = Path(sys.executable).parent / "mlflow"  # the command ran outside the checkout: by its full path
    assert said == [(str(mlflow_ui), store, run.info.experiment_id, run.info.run_id)]
    assert f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}" in (run_dir / "train.log").read_text()



def test_a_sweep_jobs_mlflow_run_takes_the_date_and_time_of_its_sweep_folder_and_a_server_its_own_address():
    from src.loggers import folder_run_name, where_to_see

    assert folder_run_name("outputs/multirun/2026-12-07_15-20-03/lenet_auto_1dev_32-true_seed=2") == \
        "2026-12-07_15-20-03/lenet_auto_1dev_32-true_seed=2"
    assert folder_run_name("outputs/runs/2026-12-07_15-20-03_lenet_auto_1dev_32-true-2") == \
        "2026-12-07_15-20-03_lenet_auto_1dev_32-true-2"
    assert folder_run_name("/tmp/my_run") == "my_run"  # a folder the command named: its name as it is
    assert where_to_see("http://tracker:5000/", "3", "ab12") == "http://tracker:5000/#/experiments/3/runs/ab12"


def test_a_run_name_given_to_the_mlflow_logger_is_kept(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from src.loggers import MLflowRunLogger

    monkeypatch.setattr(sys, "argv", ["src/train.py"])  # as command_here sets it: with pytest's, MLflow starts git
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    named = MLflowRunLogger(tracking_uri=store, run_name="mine", tags={"run_dir": str(tmp_path / "2026-12-07_15-20-03_x")})
    unnamed = MLflowRunLogger(tracking_uri=store, tags={"run_dir": str(tmp_path / "2026-12-07_15-20-03_x")})
    client = MlflowClient(store)
    assert client.get_run(named.run_id).info.run_name == "mine"
    assert client.get_run(unnamed.run_id).info.run_name == "2026-12-07_15-20-03_x"
