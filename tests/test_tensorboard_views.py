"""What TensorBoard itself serves of a sweep and of a single run: the HParams columns it opens on, the
figures in them, the run names and the scalar descriptions, read from its own HTTP endpoints."""

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tensorboard import default, program
from tensorboard.backend import application
from werkzeug.test import Client

from tests.helpers import QUICK, cpu_precision, free_port, scalars, train_here

PRECISION = cpu_precision()  # what precision=auto uses here
LABEL = f"lenet_auto_1dev_{PRECISION}"
TARGETS = "callbacks.time_to_accuracy.targets=[0.05,0.999]"  # one that chance beats, one that no quick run reaches
FIRST_METRICS = ["test/acc", "val/acc_best", "time/epoch_s_median", "time/s_to_val_acc_0.05",
                 "time/s_to_val_acc_0.999"]
SHOWN = 5  # hparams and metric columns the HParams tab ticks by default


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, data_root) -> Path:
    """Two runs that differ only in their seed, as one sweep with its report (the sequential launcher: in this process)."""
    folder = tmp_path_factory.mktemp("sweep")
    # Without the disturbance marks: the suite's other test process competes with these runs, which would leave
    # them out of the time to accuracy.
    result = train_here("-m", *QUICK, "seed=1,2", "tags=[smoke]", TARGETS, "~callbacks.disturbance",
                        f"hydra.sweep.dir={folder}")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def single(tmp_path_factory, data_root) -> Path:
    """A run with two settings typed, in a folder named as by default, under a log folder of its own (in this process)."""
    logdir = tmp_path_factory.mktemp("single")
    result = train_here(*QUICK, "optim.lr=0.05", "data.val_size=1000",
                        f"hydra.run.dir={logdir}/runs/${{run_stamp:}}_${{run_name}}")
    assert result.returncode == 0, result.stderr[-3000:]
    return logdir


class Served:
    """TensorBoard's WSGI app on a log folder, loaded once (its Python loader), queried without a port."""

    def __init__(self, logdir: Path) -> None:
        board = program.TensorBoard(default.get_plugins())
        board.configure(logdir=str(logdir), load_fast="false", reload_task="blocking", reload_interval=0)
        provider, multiplexer = board._make_data_provider()
        app = application.TensorBoardWSGIApp(board.flags, board.plugin_loaders, provider, board.assets_zip_provider,
                                             multiplexer)
        self.client = Client(app)

    def get(self, path: str, **query: str):
        response = self.client.get(path, query_string=query)
        assert response.status_code == 200, response.get_data(as_text=True)
        return json.loads(response.get_data())

    def post(self, path: str, body: dict):
        response = self.client.post(path, data=json.dumps(body), content_type="application/json")
        assert response.status_code == 200, response.get_data(as_text=True)
        return json.loads(response.get_data())

    def experiment(self) -> dict:
        return self.post("/data/plugin/hparams/experiment", {"experimentName": "", "hparamsLimit": 1000})

    def session_groups(self, experiment: dict) -> list[dict]:
        columns = [{"hparam": info["name"]} for info in experiment["hparamInfos"]]
        columns += [{"metric": info["name"]} for info in experiment["metricInfos"]]
        body = {"experimentName": "", "allowedStatuses": ["STATUS_SUCCESS", "STATUS_UNKNOWN"], "colParams": columns,
                "startIndex": 0, "sliceSize": 100}
        return self.post("/data/plugin/hparams/session_groups", body)["sessionGroups"]


def default_columns(experiment: dict) -> tuple[list[str], list[str]]:
    """The hparams and metrics the HParams tab ticks: the first five of each as served (differing hparams
    first; the tab keeps that order), as TensorBoard 2.21's dashboard picks them."""
    hparams = sorted(experiment["hparamInfos"], key=lambda info: not info.get("differs", False))
    return [info["name"] for info in hparams[:SHOWN]], [info["name"]["tag"] for info in experiment["metricInfos"][:SHOWN]]


@pytest.fixture(scope="module")
def served_sweep(sweep) -> Served:
    return Served(sweep)


def test_sweep_jobs_are_named_by_what_they_run_and_their_seed(served_sweep, sweep):
    jobs = [f"{LABEL}_seed=1", f"{LABEL}_seed=2"]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name != "report") == jobs
    assert set(served_sweep.get("/data/runs")) == {*jobs, "report"}


def test_hparams_opens_on_what_differs_and_the_metrics_that_answer(served_sweep):
    experiment = served_sweep.experiment()
    hparams, metrics = default_columns(experiment)
    assert hparams == ["devices", "model", "precision_used", "seed", "strategy"]  # seed differs; what the runs are fills in
    assert metrics == FIRST_METRICS  # the time to each target accuracy after the epoch time
    infos = {info["name"]: info for info in experiment["hparamInfos"]}
    assert infos["seed"]["differs"] and not infos["accelerator"].get("differs", False)
    for name in ("trainer.limit_train_batches", "trainer.accumulate_grad_batches", "model.loss.label_smoothing",
                 "data.val_size", "params/total", "params/trainable", "params/non_trainable", "tags"):
        assert name in infos, name
    assert infos["tags"]["domainDiscrete"] == ["smoke"]


def test_hparams_parallel_coordinates_draw_every_run_on_every_ticked_metric(served_sweep):
    """A sweep where no run reached a target had no value in that column for any run: TensorBoard's parallel
    coordinates, which draw a run only where it has every ticked column, drew no line at all. Every session has
    every metric column the tab ticks."""
    experiment = served_sweep.experiment()
    columns = set(default_columns(experiment)[1])
    groups = served_sweep.session_groups(experiment)
    drawn = [{value["name"]["tag"] for value in group["metricValues"]} for group in groups]
    assert groups and [columns - tags for tags in drawn] == [set()] * len(groups)


def test_hparams_figures_are_those_of_the_run_and_the_report(served_sweep, sweep):
    groups = served_sweep.session_groups(served_sweep.experiment())
    assert len(groups) == 2
    with (sweep / "report.csv").open(newline="") as file:
        report = {row["run"]: row for row in csv.DictReader(file)}
    for group in groups:
        [session] = group["sessions"]
        run = session["name"]
        seed = int(run[-1])
        assert group["name"].startswith(f"seed={seed} {LABEL} #"), "what differs first: the table cuts trial ids short"
        assert group["hparams"]["seed"] == str(seed) and group["hparams"]["devices"] == "1"  # whole, not 1.0000
        assert group["hparams"]["optim.lr" if "optim.lr" in group["hparams"] else "lr"] == pytest.approx(0.05)
        metrics = {value["name"]["tag"]: value["value"] for value in group["metricValues"]}
        logged = scalars(sweep / run)
        assert metrics["time/epoch_s_median"] == pytest.approx(statistics.median(logged["time/epoch_s"]))
        assert metrics["time/samples_per_s_median"] == pytest.approx(statistics.median(logged["time/samples_per_s"]))
        assert metrics["test/acc"] == pytest.approx(logged["test/acc"][-1])
        assert metrics["time/s_to_val_acc_0.05"] == pytest.approx(logged["time/to_val_acc_0.05"][0])
        assert metrics["time/s_to_val_acc_0.999"] == -1.0  # never reached: a number, so the run is drawn
        assert float(report[run]["s_to_val_acc_0.05"]) == pytest.approx(metrics["time/s_to_val_acc_0.05"], rel=1e-6)
        assert report[run]["s_to_val_acc_0.999"] == "never"
        assert float(report[run]["epoch_s"]) == pytest.approx(metrics["time/epoch_s_median"])  # the report's epoch s (median)


def test_scalars_have_descriptions_and_no_comm_bytes_on_one_process(served_sweep, sweep):
    tags = served_sweep.get("/data/plugin/scalars/tags")[f"{LABEL}_seed=1"]
    for tag in ("test/acc", "val/acc", "time/epoch_s", "time/epoch_s_median", "train/loss"):
        assert tags[tag]["description"], tag
    assert not any(tag.startswith("xfer/") for tag in tags)
    layout = served_sweep.get("/data/plugin/custom_scalars/layout")
    assert [category["title"] for category in layout["category"]][:3] == ["accuracy", "loss", "time"]


def test_sweep_report_groups_the_seeds(sweep):
    markdown = (sweep / "report.md").read_text()
    assert "## Seeds" in markdown and "speed-up" not in markdown.lower()
    assert not (sweep / "epoch_time.png").exists() and "Predicted scaling" not in markdown
    with (sweep / "seeds.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert (row["setting"], row["seeds"], row["n"]) == (f"lenet auto 1 dev {PRECISION}", "1,2", "2")
    if row["test acc 95% CI"] != "n=2 too small":  # two seeds' t interval reaches past 0 or 1 unless they nearly agree
        low, high = (float(x) for x in row["test acc 95% CI"].strip("[]").split(", "))
        assert 0 <= low <= float(row["test acc mean"]) <= high <= 1
    assert "## Time to accuracy" in markdown and (sweep / "acc_time.png").is_file()
    with (sweep / "time_to_accuracy.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert row["s to val acc 0.999"] == "never (0/2)"
    assert row["s to val acc 0.05"].endswith("(2/2) (n=2: too few seeds for a median)")


def test_single_run_is_named_by_the_precision_used_and_opens_on_what_was_typed(single):
    [run] = (single / "runs").iterdir()
    assert run.name.endswith(f"_{LABEL}")
    experiment = Served(single).experiment()
    hparams, metrics = default_columns(experiment)
    assert hparams == ["data.val_size", "lr", "lr_used", "model", "strategy"]  # typed, then what the run is
    assert metrics == [*FIRST_METRICS[:3], "time/s_to_val_acc_0.80", "time/s_to_val_acc_0.85"]  # the default targets
    [group] = Served(single).session_groups(experiment)  # what was typed first: the table cuts trial ids short
    assert group["name"].startswith(f"debug=quick optim.lr=0.05 data.val_size=1000 {LABEL} #"), group["name"]


@pytest.mark.slow  # `tensorboard --logdir`: a process of its own
def test_the_default_loader_agrees(sweep):
    """`tensorboard --logdir` as a user starts it, with its Rust loader where it has one."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "tensorboard"), "--logdir", str(sweep), "--host", "127.0.0.1",
               "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{base}/data/plugin/scalars/tags", timeout=60) as response:
                    tags = json.loads(response.read())
                if len(tags) == 2:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert process.poll() is None and time.monotonic() < deadline, "tensorboard did not serve the sweep"
            time.sleep(0.3)
        request = urllib.request.Request(f"{base}/data/plugin/hparams/experiment", data=b'{"experimentName": ""}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            experiment = json.loads(response.read())
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    assert default_columns(experiment)[0] == ["devices", "model", "precision_used", "seed", "strategy"]
    assert all(tags[run]["test/acc"]["description"] for run in tags)


def test_a_swept_precision_is_shown_as_typed_where_the_name_does_not(tmp_path):
    from omegaconf import OmegaConf

    from src.launch.naming import sweep_job_dirname

    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": ["precision=32,bf16-mixed", "seed=1,2"]}}}),
                   tmp_path / "multirun.yaml")
    named = {sweep_job_dirname([f"precision={p}", "seed=1"], 0, str(tmp_path), f"lenet_auto_1dev_{used}")
             for p, used in (("32", "32-true"), ("bf16-mixed", "bf16-mixed"))}
    assert named == {"lenet_auto_1dev_32-true_precision=32,seed=1", "lenet_auto_1dev_bf16-mixed_seed=1"}


@pytest.mark.slow  # a sweep of four runs, two of them ResNet-18
def test_a_sweep_over_models_opens_on_the_swept_keys_not_on_what_follows_from_the_model(tmp_path, data_root):
    """`model=lenet,resnet18 seed=1,2`: LeNet's own keys and the parameter counts differ only because the models
    do; the columns ticked by default are the swept keys and what the runs are."""
    tiny = ["trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "data.batch_size=4"]
    result = train_here("-m", *QUICK, *tiny, "model=lenet,resnet18", "seed=1,2", f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    experiment = Served(tmp_path).experiment()
    hparams, _ = default_columns(experiment)
    assert hparams == ["devices", "model", "precision_used", "seed", "strategy"]
    infos = {info["name"]: info for info in experiment["hparamInfos"]}
    for follows in ("model.net.pool", "model.net.batch_norm", "model.net.init", "params/total"):
        assert follows in infos and not infos[follows].get("differs", False), follows


def test_jobs_of_a_swept_key_that_a_plus_adds_get_folders_apart(tmp_path):
    from omegaconf import OmegaConf

    from src.launch.naming import sweep_job_dirname

    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": ["+callbacks.fault.step=2,1000"]}}}),
                   tmp_path / "multirun.yaml")
    named = [sweep_job_dirname([f"+callbacks.fault.step={step}"], 0, str(tmp_path), "lenet_auto_1dev_32-true")
             for step in (2, 1000)]
    assert named == ["lenet_auto_1dev_32-true_callbacks.fault.step=2", "lenet_auto_1dev_32-true_callbacks.fault.step=1000"]


def test_a_swept_experiment_is_named_once_by_the_run_label(tmp_path):
    from omegaconf import OmegaConf

    from src.launch.naming import run_label, sweep_job_dirname

    OmegaConf.save(OmegaConf.create({"hydra": {"overrides": {"task": ["experiment=d2l_lenet,lenet_plus"]}}}),
                   tmp_path / "multirun.yaml")
    named = [sweep_job_dirname([f"experiment={name}"], 0, str(tmp_path), run_label("lenet", "auto", 1, 1, "32-true", name))
             for name in ("d2l_lenet", "lenet_plus")]
    assert named == ["lenet_auto_1dev_32-true_d2l_lenet", "lenet_auto_1dev_32-true_lenet_plus"]
