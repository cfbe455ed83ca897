"""The TensorBoard logger of every run, the other loggers beside it, and where a resumed run's logging takes up."""

import csv
import fcntl
import io
import json
import logging
import os
import re
import secrets
import string
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig
from tensorboard.compat.proto.summary_pb2 import DataClass, Summary, SummaryMetadata
from torch.utils.tensorboard.summary import custom_scalars

from src import records
from src.checkpoints import Saved
from src.errors import UsageError, interpreter
from src.folders import check_in_place, open_file, read_bytes, write_file
from src.launch.stops import RunStopped, held
from src.records import TO_TARGET

EPOCH_TAG = "trainer/epoch"

# What each scalar is, shown in TensorBoard beside its chart (the card's info button in Time Series).
DESCRIPTIONS = {
    "train/loss": "training loss, mean over the epoch's global batches",
    "train/acc": "training accuracy over the epoch's global batches",
    "val/acc": "accuracy on the held-out validation images (data.val_size), after each epoch",
    "val/acc_best": "best val/acc so far",
    "test/acc": "accuracy on the 10,000 test images, at the end",
    "test/loss": "loss on the test images, at the end",
    "time/epoch_s": "wall seconds of the training epoch, validation excluded, CUDA synchronized",
    "time/samples_per_s": "training images per second over all processes, this epoch",
    "time/epoch_s_median": "median of time/epoch_s over the run's epochs: the figure of the result line and report.md",
    "time/samples_per_s_median": "median of time/samples_per_s over the run's epochs",
    "time/trained_s": "training seconds so far (as time/epoch_s counts them), at each validation: the x of accuracy "
                      "against time",
    "usage/cpu_share": "the process's CPU seconds over the epoch's wall seconds times its threads: below 1 where it "
                       "waited, for other work or for itself (Python, data, communication)",
    "usage/others_share": "the share of the run's cores' time that processes outside the run used this epoch: the "
                          "cores' busy time less the run's processes' (/proc; Linux)",
    "usage/cpu_wait": "the share of the run's threads' time on or waiting for a CPU that they spent waiting "
                      "(/proc/<pid>/task/*/schedstat; Linux)",
    "usage/gpu_util": "mean utilization of rank 0's GPU through the epoch, % (NVML)",
    "usage/disturbed": "1 where the epoch competed with other work (usage/others_share and usage/cpu_wait at least "
                       "0.1: other processes took a tenth of the run's cores while its threads waited): its time "
                       "measured the machine's load too",
    "usage/tflops_per_s": "model TFLOP/s per device this epoch: FLOPs of forward and backward per image (torch's "
                          "FLOP counter) x time/samples_per_s / devices",
    "usage/mfu": "model FLOPs utilisation: usage/tflops_per_s over the device's peak for the precision used "
                 "(Lightning's table; not logged where it lists none, as on CPUs)",
    "usage/peak_memory_mib": "rank 0's peak memory since fitting started, MiB: CUDA's allocator peak, or the "
                             "process's peak resident size on CPU (on Linux; elsewhere the process's peak so far)",
    "usage/tflops_per_s_median": "median of usage/tflops_per_s over the run's epochs",
    "usage/mfu_median": "median of usage/mfu over the run's epochs",
    EPOCH_TAG: "Lightning's epoch counter (from 0) at each epoch-end point",
}
# `xfer/<name>_epoch` is the epoch's mean of `xfer/<name>`.
TRANSFERS = {
    "xfer/bytes_per_step": "bytes of every all-reduce the DDP hook issued in the optimizer step, per process (payload)",
    "xfer/compression_ratio": "the step's gradients as fp32 bytes divided by xfer/bytes_per_step",
    "xfer/hook_ms": "sum over the step's buckets of the time from the hook's call to its result (may overlap backward)",
    "xfer/buckets_per_step": "DDP buckets reduced in the optimizer step (hook calls)",
    "xfer/backward_compute_ms": "DDP's timing: start of the backward pass to the last gradient ready",
    "xfer/backward_comm_ms": "DDP's timing: first bucket's all-reduce launched to the last one done",
    "xfer/overlap_ms": "the part of xfer/backward_comm_ms spent while gradients were still computed",
    "xfer/overlap_frac": "xfer/overlap_ms / xfer/backward_comm_ms: the share of communication hidden behind backward",
}
DESCRIPTIONS |= TRANSFERS | {f"{tag}_epoch": f"mean over the epoch of {tag}: {text}" for tag, text in TRANSFERS.items()}

def description(tag: str) -> str | None:
    if tag.startswith(records.HPARAMS_TO_TARGET):
        return records.hparams_target(tag[len(records.HPARAMS_TO_TARGET):])
    if tag.startswith(TO_TARGET):
        return (f"training seconds (as time/epoch_s counts them) until val/acc first reached {tag[len(TO_TARGET):]}, "
                "at that step; no point where it never did")
    return DESCRIPTIONS.get(tag)


# TensorBoard's Custom Scalars tab (tags are regexes): the answer first, communication last; Time Series orders
# groups by name, hence `usage/*` after test and time, and `xfer/*` last.
LAYOUT = {
    "accuracy": {"test and validation": ["Multiline", ["test/acc$", "val/acc$", "val/acc_best$"]],
                 "training": ["Multiline", ["train/acc$"]]},
    "loss": {"training and validation": ["Multiline", ["train/loss$", "val/loss$", "test/loss$"]]},
    "time": {"epoch seconds (validation excluded)": ["Multiline", ["time/epoch_s$", "time/epoch_s_median$"]],
             "images per second": ["Multiline", ["time/samples_per_s$", "time/samples_per_s_median$"]],
             "training seconds to each val/acc target": ["Multiline", ["time/to_val_acc_"]],
             "what each epoch competed with": ["Multiline", ["usage/others_share$", "usage/cpu_wait$", "usage/disturbed$"]]},
    "hardware use": {"model TFLOP/s per device": ["Multiline", ["usage/tflops_per_s$", "usage/tflops_per_s_median$"]],
                     "MFU (share of the peak)": ["Multiline", ["usage/mfu$", "usage/mfu_median$"]],
                     "peak memory MiB": ["Multiline", ["usage/peak_memory_mib$"]]},
    "communication (DDP)": {
        "bytes per optimizer step": ["Multiline", ["xfer/bytes_per_step$", "xfer/bytes_per_step_epoch$"]],
        "hook ms": ["Multiline", ["xfer/hook_ms$", "xfer/hook_ms_epoch$"]],
        "backward pass ms": ["Multiline", ["xfer/backward_compute_ms$", "xfer/backward_comm_ms$", "xfer/overlap_ms$"]],
        "share of communication hidden": ["Multiline", ["xfer/overlap_frac$", "xfer/overlap_frac_epoch$"]],
        "compression": ["Multiline", ["xfer/compression_ratio$", "xfer/buckets_per_step$"]],
    },
}


class RunLogger(TensorBoardLogger):
    """With `epoch` as `trainer/epoch` (not first among the scalars), descriptions and the Custom Scalars layout. A
    stop signal waits for a write to end (`held`): raised inside the writer's queue, the final flush would wait 120 s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._described: set[str] = set()
        self._laid_out = False
        self.writer: Any = None  # the SummaryWriter, once opened (on rank 0)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        self.writer = super().experiment
        return self.writer

    def add_summary(self, summary: Summary, step: int | None) -> None:
        self.experiment.file_writer.add_summary(summary, step)

    @rank_zero_only  # as Lightning's: the other ranks' loggers write nothing
    @held()
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        metrics = {EPOCH_TAG if name == "epoch" else name: value for name, value in metrics.items()}
        if not self._laid_out:  # at the first points' step: `add_custom_scalars` writes step 0, back in a resumed run
            self._laid_out = True
            self.add_summary(custom_scalars(LAYOUT), step)
        for tag in [t for t in metrics if t not in self._described and description(t)]:
            self._described.add(tag)
            value = float(metrics.pop(tag))
            # TensorBoard keeps a tag's first metadata; its Rust loader needs the scalar data class set too.
            about = SummaryMetadata(summary_description=description(tag), data_class=DataClass.DATA_CLASS_SCALAR,
                                    plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
            point = Summary.Value(tag=tag, simple_value=value, metadata=about)
            self.add_summary(Summary(value=[point]), step)
        super().log_metrics(metrics, step)

    @rank_zero_only
    @held()
    def finalize(self, status: str) -> None:
        """Flush, and keep the file open until `close` unless the stage failed: Lightning finalizes after fitting and
        after testing, and a writer opened again starts another file, which TensorBoard may read first (`.10`, `.9`)."""
        if self.writer is not None:
            self.writer.flush()
            if status != "success":
                self.writer.close()

    @rank_zero_only
    @held()
    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @rank_zero_only
    @held()
    def save(self) -> None:
        """Flush. Not Lightning's save, which writes an `hparams.yaml` holding `{}` and opens a writer where none is."""
        if self.writer is not None:
            self.writer.flush()


class CSVRunLogger(CSVLogger):
    """Keeps the rows a resumed run logged before `purge_step` (Lightning's writer deletes the metrics.csv it finds)."""

    def __init__(self, *args: Any, purge_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in ("metrics.csv", "hparams.yaml"):  # Lightning's writer opens them by their names
            check_in_place(Path(self.log_dir, name), Path(self.save_dir))
        saved, self._kept = Path(self.log_dir, "metrics.csv"), []
        if purge_step is not None and saved.is_file():
            with io.StringIO(read_bytes(saved, 64 * records.LIMIT).decode(errors="replace"), newline="") as file:
                rows = [{k: v for k, v in row.items() if v} for row in csv.DictReader(file)]
            self._kept = [row for row in rows if int(row["step"]) < purge_step]

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._kept is None:
            return super().experiment
        with warnings.catch_warnings():  # that it deletes metrics.csv: the rows kept are written again
            warnings.filterwarnings("ignore", "Experiment logs directory")
            writer = super().experiment
        writer.metrics[:0], self._kept = self._kept, None
        return writer


log = logging.getLogger(__name__)
# The date and time that start a run folder's name, or a sweep folder's (`run_stamp`, conf/hydra/default.yaml).
STAMP = re.compile(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d")


def folder_run_name(run_dir: str) -> str:
    """An MLflow run's name: its run folder's, which starts with the date and time; a sweep job's after its sweep
    folder's, which holds them (`2026-12-07_15-20-03/lenet_auto_1dev_32-true_seed=2`)."""
    folder = Path(run_dir)
    if STAMP.match(folder.parent.name) and not STAMP.match(folder.name):
        return f"{folder.parent.name}/{folder.name}"
    return folder.name


def where_to_see(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's own page in MLflow's UI, by its route: the UI's start page opens on its GenAI view, the run some
    clicks away."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/{page}"
    ui = Path(interpreter()).parent / "mlflow"
    return f"{ui} ui --backend-store-uri {tracking_uri}, then http://127.0.0.1:5000/{page}"


class MLflowRunLogger(MLFlowLogger):
    """Lightning's MLflow logger, whose run is made as it is built, one process at a time on a SQLite store (processes
    each creating a new store's tables would all but one fail); MLflow's telemetry off unless the environment says. A
    SQLite store's new experiment keeps its artifacts beside the store, `<store folder>/mlartifacts`: MLflow's own
    default is `./mlruns` of whatever folder the command ran in. A server chooses its own. With `run_id` (a resume) it
    logs on into that run where the store holds it, else into a new one."""

    def __init__(self, *args: Any, tracking_uri: str, run_id: str | None = None, artifact_location: str | None = None,
                 run_name: str | None = None, **kwargs: Any) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read as mlflow is first imported, just below
        run_dir = (kwargs.get("tags") or {}).get("run_dir")
        run_name = run_name or (folder_run_name(run_dir) if run_dir else None)
        store = Path(tracking_uri.removeprefix("sqlite:///")) if tracking_uri.startswith("sqlite:///") else None
        if store is not None and artifact_location is None:
            artifact_location = (store.parent / "mlartifacts").absolute().as_uri()
        lock = Path(f"{store}.lock") if store is not None else None
        with os.fdopen(open_file(lock, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") if lock else nullcontext() as held:
            if held:
                fcntl.flock(held, fcntl.LOCK_EX)
            if rank_zero_only.rank == 0 and run_id is not None:
                run_id = self.taken_up(run_id, tracking_uri, kwargs.get("tags") or {})
            super().__init__(*args, tracking_uri=tracking_uri, run_id=run_id, artifact_location=artifact_location,
                             run_name=run_name, **kwargs)
            _ = self.experiment  # on rank 0: the store, its experiment and this run (the other ranks log nothing)
        if rank_zero_only.rank == 0:
            log.info(f"MLflow run: {where_to_see(tracking_uri, self.experiment_id, self.run_id)}")

    @staticmethod
    def taken_up(run_id: str, tracking_uri: str, tags: Any) -> str | None:
        """The earlier run running again, where this store holds it tagged with this very folder (`run_dir`); else
        None, a new run: the id is read from the folder, which anyone may have written, and only the tag ties the
        two (a folder moved since, or copied, logs its resume into a new run)."""
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(tracking_uri)
        try:
            found = client.get_run(run_id)
        except MlflowException:
            found = None
        here = tags.get("run_dir")
        if found is None or found.info.lifecycle_stage == "deleted" or here is None or found.data.tags.get("run_dir") != here:
            return None
        client.update_run(run_id, status="RUNNING")
        for name, value in tags.items():
            client.set_tag(run_id, name, value)
        return run_id

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        """The settings the run does not hold yet: MLflow refuses to change a param, and a resumed run keeps those it
        began with (as its HParams record in TensorBoard does)."""
        held = self.experiment.get_run(self.run_id).data.params
        super().log_hyperparams({name: value for name, value in dict(params).items() if name not in held})

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        # Lightning finalizes a fit that raised as failed, from inside its `except`: a stop signal's is KILLED
        super().finalize("KILLED" if isinstance(sys.exc_info()[1], RunStopped) else status)


class WandbRunLogger(WandbLogger):
    """Without the `anonymous=None` W&B warns about; its run ends at `close` (Lightning's `finalize` leaves it open),
    or as a stage fails. Its id is chosen as it is built, so that the run folder can keep it for a resume (`id`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("version") is None and kwargs.get("id") is None:  # as W&B makes one: 8 lower-case letters, digits
            kwargs["id"] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.started = False  # whether this process began (or took up) its W&B run
        super().__init__(*args, **kwargs)
        # Private: Lightning passes W&B `anonymous=None`, which W&B warns of; no public argument leaves it out
        self._wandb_init.pop("anonymous", None)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        run = super().experiment
        self.started = True
        return run

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if status != "success" and self.started:
            self.experiment.finish(exit_code=1)  # not left open for the next run in this process (a sweep's job)

    @rank_zero_only
    def close(self) -> None:
        self.finalize("success")
        self.experiment.finish()


# The run each logger beside TensorBoard logs into, by its name under `logger`, kept in the run folder so that a
# resume logs on into the same MLflow and W&B run: {"mlflow": "<run id>", "wandb": "<run id>"}.
RUN_IDS = "logger_runs.json"
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def kept_run_ids(run_dir: Path) -> dict[str, str]:
    """The ids a run folder kept, read as JSON data: a mapping of logger names to plain ids, else refused."""
    path = run_dir / RUN_IDS
    if not path.is_file():
        return {}
    data = records.load(path)
    if not isinstance(data, dict) or not all(isinstance(name, str) and RUN_ID.fullmatch(name) and isinstance(run, str)
                                             and RUN_ID.fullmatch(run) for name, run in data.items()):
        raise UsageError(f"{path}: holds no logger run ids (a mapping of logger names to ids of letters, digits, _ and "
                         "-); move it away to log the rest of the run into new MLflow and W&B runs")
    return data


def resuming(node: DictConfig, run_id: str | None) -> dict[str, Any]:
    """The argument that makes a logger log on into the run it logged before: MLflow's `run_id`, W&B's `id` (which
    Lightning's logger resumes, `resume="allow"`); none where the command gives one."""
    kind = str(node.get("_target_", "")).rpartition(".")[2]
    key = {MLflowRunLogger.__name__: "run_id", WandbRunLogger.__name__: "id"}.get(kind)
    return {key: run_id} if key and run_id and node.get(key) is None else {}


def keep_run_ids(loggers: dict[str, Logger], run_dir: Path, kept: dict[str, str]) -> None:
    """On rank 0 (only it has the runs): the ids beside those an earlier attempt kept for loggers not used now."""
    ids = dict(kept)
    for name, logger in loggers.items():
        if isinstance(logger, MLflowRunLogger):
            ids[name] = logger.run_id
        elif isinstance(logger, WandbRunLogger):
            ids[name] = logger.version
    if ids != kept:
        write_file(run_dir / RUN_IDS, json.dumps(ids, indent=1))


def takes_purge_step(config: DictConfig) -> bool:
    return str(config.get("_target_", "")).rpartition(".")[2] in (RunLogger.__name__, CSVRunLogger.__name__)


def close_loggers(loggers: list[Logger]) -> None:
    for logger in loggers:
        if isinstance(logger, (RunLogger, WandbRunLogger)):
            logger.close()
        else:
            logger.finalize("success")


def purge_step(resumed: Saved | None, run_dir: Path) -> int | None:
    """The first step a run resumed in its own folder logs again (Lightning logs optimizer step n at n - 1), so no step
    shows twice; 0 where an earlier attempt logged but left no checkpoint (a sweep job stopped in its first epoch)."""
    if resumed is not None and resumed.step >= 0 and resumed.path.parent.parent.resolve() == run_dir.resolve():
        return resumed.step
    return 0 if any(run_dir.glob("events.out.tfevents.*")) else None
