"""The TensorBoard logger of every run, the other loggers beside it, and where a resumed run's logging takes up."""

import csv
import fcntl
import os
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

from src.checkpoints import Saved
from src.launch.stops import held

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
    "usage/tflops_per_s": "model TFLOP/s per device this epoch: FLOPs of forward and backward per image (torch's "
                          "FLOP counter) x time/samples_per_s / devices",
    "usage/mfu": "model FLOPs utilisation: usage/tflops_per_s over the device's peak for the precision used "
                 "(Lightning's table; not logged where it lists none, as on CPUs)",
    "usage/peak_memory_mib": "rank 0's peak memory so far, MiB: CUDA's allocator peak since fitting started, or the "
                             "process's peak resident size on CPU",
    "usage/tflops_per_s_median": "median of usage/tflops_per_s over the run's epochs",
    "usage/mfu_median": "median of usage/mfu over the run's epochs",
    EPOCH_TAG: "Lightning's epoch counter (from 0) at each epoch-end point",
    "xfer/bytes_per_step": "bytes of every all-reduce the DDP hook issued in the optimizer step, per process (payload)",
    "xfer/compression_ratio": "the step's gradients as fp32 bytes divided by xfer/bytes_per_step",
    "xfer/hook_ms": "sum over the step's buckets of the time from the hook's call to its result (may overlap backward)",
    "xfer/buckets_per_step": "DDP buckets reduced in the optimizer step (hook calls)",
    "xfer/backward_compute_ms": "DDP's timing: start of the backward pass to the last gradient ready",
    "xfer/backward_comm_ms": "DDP's timing: first bucket's all-reduce launched to the last one done",
    "xfer/overlap_ms": "the part of xfer/backward_comm_ms spent while gradients were still computed",
    "xfer/overlap_frac": "xfer/overlap_ms / xfer/backward_comm_ms: the share of communication hidden behind backward",
}


# TensorBoard's Custom Scalars tab: the answer first (accuracy, loss, time), then hardware use, communication
# last. Time Series orders its groups by name: test and time open first; hardware use (`usage/*`) comes after
# them, and the transfer scalars are `xfer/*` so that they come after all the rest. Each chart's tags are regexes.
LAYOUT = {
    "accuracy": {"test and validation": ["Multiline", ["test/acc$", "val/acc$", "val/acc_best$"]],
                 "training": ["Multiline", ["train/acc$"]]},
    "loss": {"training and validation": ["Multiline", ["train/loss$", "val/loss$", "test/loss$"]]},
    "time": {"epoch seconds (validation excluded)": ["Multiline", ["time/epoch_s$", "time/epoch_s_median$"]],
             "images per second": ["Multiline", ["time/samples_per_s$", "time/samples_per_s_median$"]]},
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


def description(tag: str) -> str | None:
    """A tag's description; `xfer/<name>_epoch` is the epoch's mean of `xfer/<name>`."""
    if tag in DESCRIPTIONS:
        return DESCRIPTIONS[tag]
    if tag.startswith("xfer/") and tag.endswith("_epoch") and tag[: -len("_epoch")] in DESCRIPTIONS:
        return f"mean over the epoch of {tag[: -len('_epoch')]}: " + DESCRIPTIONS[tag[: -len("_epoch")]]
    return None


class RunLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger, with Lightning's `epoch` counter filed as `trainer/epoch`, so
    that it joins a group of its own instead of standing first among the run's scalars, each known
    tag's description written with its first point (Lightning's logger passes none), and the
    Custom Scalars layout (`LAYOUT`) with the run's first points. A stop signal waits for a write or flush to end
    (`held`): raised inside the writer's queue, it would leave the flush on the way out waiting 120 s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._described: set[str] = set()
        self._laid_out = False

    @rank_zero_only  # as Lightning's: the other ranks' loggers write nothing
    @held()
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        metrics = {EPOCH_TAG if name == "epoch" else name: value for name, value in metrics.items()}
        if not self._laid_out:  # the run's first points: the Custom Scalars layout goes with them, at their step
            self._laid_out = True  # (`add_custom_scalars` writes step 0, which goes back in a resumed run's file)
            self.experiment._get_file_writer().add_summary(custom_scalars(LAYOUT), step)
        for tag in [t for t in metrics if t not in self._described and description(t)]:
            self._described.add(tag)
            value = float(metrics.pop(tag))
            # TensorBoard keeps a tag's first metadata: a plain scalar point that carries the description.
            # TensorBoard's Rust loader takes it only with the scalar data class set as well.
            about = SummaryMetadata(summary_description=description(tag), data_class=DataClass.DATA_CLASS_SCALAR,
                                    plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
            point = Summary.Value(tag=tag, simple_value=value, metadata=about)
            # SummaryWriter has no public call for a Summary of one's own; `_get_file_writer` (private) also
            # reopens the writer Lightning closed when fitting ended, as add_scalar would.
            self.experiment._get_file_writer().add_summary(Summary(value=[point]), step)
        super().log_metrics(metrics, step)

    @rank_zero_only
    @held()
    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        super().log_hyperparams(*args, **kwargs)

    @rank_zero_only
    @held()
    def finalize(self, status: str) -> None:
        """Flush, and keep the file open until `close`: Lightning finalizes after fitting and again after testing,
        and a writer opened again starts another event file. TensorBoard reads a run's files in the order of
        their names, whose last field is a counter of the process, so a file `.10` would be read before `.9`,
        points and all. A failed or stopped stage closes it: nothing more is written."""
        if self._experiment is not None:
            self._experiment.flush()
            if status != "success":
                self._experiment.close()

    @rank_zero_only
    @held()
    def close(self) -> None:
        """Close the run's event file, after its last summary (the HParams record)."""
        if self._experiment is not None:
            self._experiment.close()

    @rank_zero_only
    @held()
    def save(self) -> None:
        """Flush what was written. Not Lightning's save, which writes an `hparams.yaml` holding `{}` (the run's
        settings are in its config.yaml and HParams record) and opens a writer, so an empty event file, where
        none is open (`_experiment`, the attribute Lightning's own `finalize` reads)."""
        if self._experiment is not None:
            self._experiment.flush()


class CSVRunLogger(CSVLogger):
    """Lightning's CSV logger, whose run resumed in its own folder keeps the rows its earlier part logged before
    `purge_step` (as TensorBoard's): Lightning's writer deletes the metrics.csv it finds."""

    def __init__(self, *args: Any, purge_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        saved, self._kept = Path(self.log_dir, "metrics.csv"), []
        if purge_step is not None and saved.is_file():
            with saved.open(newline="") as file:
                rows = [{k: v for k, v in row.items() if v} for row in csv.DictReader(file)]
            self._kept = [row for row in rows if int(row["step"]) < purge_step]

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            with warnings.catch_warnings():  # that it deletes metrics.csv: the rows kept are written again
                warnings.filterwarnings("ignore", "Experiment logs directory")
                super().experiment.metrics[:0] = self._kept
        return self._experiment


class MLflowRunLogger(MLFlowLogger):
    """Lightning's MLflow logger, whose MLflow run is made as it is built, by one process at a time where the store is
    a SQLite file: a run's processes, or a sweep's parallel jobs, would each create a new store's tables and experiment,
    and all but one fail. MLflow's usage reports to its makers' servers are off (unless MLFLOW_DISABLE_TELEMETRY says
    otherwise): a run logged to a local store stays on this machine."""

    def __init__(self, *args: Any, tracking_uri: str, **kwargs: Any) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # read as mlflow is first imported, just below
        lock = Path(tracking_uri.removeprefix("sqlite:///") + ".lock") if tracking_uri.startswith("sqlite:///") else None
        if lock is not None:
            lock.parent.mkdir(parents=True, exist_ok=True)
        with lock.open("a") if lock else nullcontext() as held:
            if held:
                fcntl.flock(held, fcntl.LOCK_EX)
            super().__init__(*args, tracking_uri=tracking_uri, **kwargs)
            _ = self.experiment  # on rank 0: the store, its experiment and this run (the other ranks log nothing)


class WandbRunLogger(WandbLogger):
    """Lightning's W&B logger, without the `anonymous=None` it hands W&B (which warns that it has no effect), whose W&B
    run ends at `close`, after the run's last record: Lightning's `finalize` leaves it open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wandb_init.pop("anonymous", None)

    @rank_zero_only
    def close(self) -> None:
        self.finalize("success")
        self.experiment.finish()


def takes_purge_step(config: DictConfig) -> bool:
    """Whether a `logger=` option takes the purge step of a resumed run: TensorBoard's, and the CSV logger."""
    return str(config.get("_target_", "")).rpartition(".")[2] in (RunLogger.__name__, CSVRunLogger.__name__)


def close_loggers(loggers: list[Logger]) -> None:
    """Every logger's files closed, after the run's last record."""
    for logger in loggers:
        if isinstance(logger, (RunLogger, WandbRunLogger)):
            logger.close()
        else:
            logger.finalize("success")


def purge_step(resumed: Saved | None, run_dir: Path) -> int | None:
    """Resuming in its own folder, a run hides the TensorBoard points its earlier part logged after
    the checkpoint (TensorBoard's purge step), so no step appears twice. Lightning logs optimizer
    step n at TensorBoard step n - 1, so the first point after a checkpoint at step s is at s.
    Starting over in a folder where an earlier attempt logged but left no checkpoint to take up
    (a sweep job stopped in its first epoch), it hides all of that attempt's points: step 0."""
    if resumes_in(resumed, run_dir):
        return resumed.step
    return 0 if any(run_dir.glob("events.out.tfevents.*")) else None


def resumes_in(resumed: Saved | None, run_dir: Path) -> bool:
    """Whether a run takes up a checkpoint of its own folder, where its earlier part logged."""
    return resumed is not None and resumed.step >= 0 and resumed.path.parent.parent.resolve() == run_dir.resolve()
