"""What a person reads: error and log lines beside progress bars, the model summary, the result
line, `--help` and `python -m src.sysinfo`."""

import io
import logging
import re
import string
import subprocess
import sys
import threading

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from src import sysinfo
from src.callbacks.model_summary import SummaryWithoutZeroFlops, without_zero_flops
from src.callbacks.progress import EpochBar
from src.config import CONF_DIR
from src.checkpoints import unreadable as unreadable_checkpoint
from src.launch.console import ConsoleHandler, counted, open_progress_bars, print_error, processes, register
from tests.helpers import INTERPRETER, QUICK, REPO, run_cli, train_here, user_env


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: a carriage return goes back to the line's start and
    what follows overwrites it (cursor movement between nested bars is not needed here)."""
    lines = []
    for raw in text.split("\n"):
        line: list[str] = []
        column = 0
        for char in raw:
            if char == "\r":
                column = 0
                continue
            line[column:column + 1] = [char]
            column += 1
        lines.append("".join(line).rstrip())
    return lines


@pytest.fixture(autouse=True)
def no_bar_left_open():
    yield
    for bar in open_progress_bars():
        bar.close()


def to_terminal(monkeypatch) -> io.StringIO:
    """One stream for the bars and stderr, as in a terminal or with `2>&1`."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def a_bar(stream: io.StringIO, **kwargs) -> tqdm:
    """A bar registered with the console, as the project's EpochBar registers each bar Lightning opens."""
    bar = register(tqdm(total=10, desc="Epoch 0", file=stream, ncols=60, mininterval=0, **kwargs))
    bar.update(3)
    return bar


def test_an_error_starts_a_line_of_its_own_below_a_progress_bar(monkeypatch):
    terminal = to_terminal(monkeypatch)
    bar = a_bar(terminal, leave=True)
    print_error("train/loss is nan")
    lines = screen(terminal.getvalue())
    assert lines[-1] == "" and lines[-2] == "error: train/loss is nan", lines
    assert lines[-3].startswith("Epoch 0:  30%"), "the bar keeps its last state"
    assert bar not in open_progress_bars()
    bar.close()  # Lightning or interpreter exit closing it again draws nothing more
    assert screen(terminal.getvalue())[-2] == "error: train/loss is nan"


def test_a_validation_bar_below_the_epoch_bar_is_cleared(monkeypatch):
    terminal = to_terminal(monkeypatch)
    bars = [a_bar(terminal, leave=True), a_bar(terminal, leave=False, position=1)]  # as Lightning holds them
    print_error("run stopped by SIGTERM")
    assert terminal.getvalue().endswith("\nerror: run stopped by SIGTERM\n")
    assert not open_progress_bars() and all(bar.disable for bar in bars)


@pytest.mark.parametrize("bar", ["none", "disabled", "closed"])
def test_without_a_bar_on_screen_the_error_line_is_all_that_is_written(monkeypatch, bar):
    terminal = to_terminal(monkeypatch)
    if bar != "none":
        shown = a_bar(terminal, disable=bar == "disabled")
        shown.close()
    before = terminal.getvalue()
    print_error("optim.lr=-1 is not allowed")
    assert terminal.getvalue() == before + "error: optim.lr=-1 is not allowed\n"


def test_another_thread_starts_the_error_with_a_newline_and_leaves_the_bar(monkeypatch):
    terminal = to_terminal(monkeypatch)
    bar = a_bar(terminal, leave=True)
    thread = threading.Thread(target=print_error, args=("rank 1 died",))
    thread.start()
    thread.join()
    assert terminal.getvalue().endswith("\nerror: rank 1 died\n")
    assert bar in open_progress_bars()


def test_a_log_line_goes_above_the_bar_not_on_its_end():
    stream = io.StringIO()
    handler = ConsoleHandler(stream)
    record = logging.LogRecord("src.callbacks.timing", logging.INFO, __file__, 1, "epoch 1/1 step 4", None, None)
    bar = a_bar(stream, leave=True)
    handler.emit(record)
    bar.close()
    lines = screen(stream.getvalue())
    assert "epoch 1/1 step 4" in lines and lines[-2].startswith("Epoch 0:  30%"), lines
    plain = io.StringIO()
    ConsoleHandler(plain).emit(record)
    assert plain.getvalue() == "epoch 1/1 step 4\n", "without a bar it is Hydra's stream handler"


def hydra_config(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides), return_hydra_config=True)


def test_the_console_log_handler_is_the_bar_aware_one():
    handler = hydra_config("train").hydra.job_logging.handlers.console
    assert handler["class"] == "src.launch.console.ConsoleHandler" and handler.stream == "ext://sys.stdout"


class Tiny(LightningModule):
    def __init__(self, example: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        if example:
            self.example_input_array = torch.zeros(1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize("example", [False, True])
def test_the_model_summary_shows_flops_only_when_it_counted_them(caplog, example):
    summary = summarize(Tiny(example))
    caplog.set_level(logging.INFO, logger="src.callbacks.model_summary")
    SummaryWithoutZeroFlops.summarize(summary._get_summary_data(), summary.total_parameters, summary.trainable_parameters,
                                      summary.model_size, summary.total_training_modes, summary.total_flops)
    table = caplog.messages[-1]
    assert "Total params" in table and "Modules in eval mode" in table
    assert ("FLOPs" in table and "Total Flops" in table) == example
    assert not re.search(r"^0\s+Total Flops", table, flags=re.M)
    if example:
        assert table == "\n" + str(summary), "Lightning's own table, as its ModelSummary prints it"


@pytest.mark.parametrize("enabled", [True, False])
def test_lightnings_model_summary_is_replaced_and_none_is_added(enabled):
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=enabled)
    callbacks = without_zero_flops(trainer.callbacks)
    assert [type(c) for c in callbacks if isinstance(c, ModelSummary)] == ([SummaryWithoutZeroFlops] if enabled else [])


class Stepping(Tiny):
    """Tiny, with a step of each stage on two batches."""

    def __init__(self) -> None:
        super().__init__(example=False)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        return self(batch[0]).sum()

    validation_step = test_step = predict_step = training_step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 4)), batch_size=2)

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


class BarsSeen(Callback):
    """The first word of each bar the console lists at each batch's end, innermost first."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_train_batch_end(self, *_) -> None:
        self.seen.append([bar.desc.split()[0] for bar in open_progress_bars()])

    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = on_train_batch_end


def test_each_bar_lightning_opens_through_the_epoch_bar_is_one_the_console_lists():
    seen = BarsSeen()
    trainer = Trainer(accelerator="cpu", max_epochs=1, num_sanity_val_steps=1, callbacks=[EpochBar(), seen],
                      logger=False, enable_checkpointing=False, enable_model_summary=False)
    model = Stepping()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model)
    assert seen.seen == [["Sanity"], *[["Epoch"]] * 2, *[["Validation", "Epoch"]] * 2, *[["Testing"]] * 2,
                         *[["Predicting"]] * 2], seen.seen
    assert not open_progress_bars(), "each closed at its stage's end"


def test_counts_are_said_in_words():
    assert (processes(1), processes(2)) == ("1 process", "2 processes")
    assert (counted(1, "run"), counted(3, "run"), counted(0, "sweep job")) == ("1 run", "3 runs", "0 sweep jobs")


def test_a_quick_run_reads_cleanly(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "trainer.enable_model_summary=true", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if "test/acc=" in line]
    # What was tested; whether the loss fell; the highest target accuracy reached; where other work ran beside it, so.
    assert re.search(r"\(precision \S+, 1 process, tested (best-epoch\d+\.ckpt|the last weights)"
                     r"(; train/loss [^()]*(\([^)]*\)[^)]*)?)?; val/acc (reached none of [\d., ]+|[\d.]+ after [\d.]+ s "
                     r"of training, step \d+)(; 1 of 1 epoch times disturbed: [^()]*\([^)]*\)[^()]*)?\) -> ", line), line
    assert "Total params" in result.stdout and "Total Flops" not in result.stdout and "FLOPs" not in result.stdout
    assert "smaller than the logging interval" not in result.stderr
    assert "Trainer already configured with model summary" not in result.stdout
    # Neither Lightning's advertisement nor its notice of one batch an epoch, where the user asked for 4 steps.
    assert "Tip" not in result.stdout and "was configured so" not in result.stdout


@pytest.mark.slow
def test_a_ddp_run_reads_cleanly(ddp_run):
    """No line of torch's own C++ log in a healthy run: rank 0 once tried to serve the store that the
    elastic agent already serves and torch logged `[E1124 ...] ... has failed to bind`."""
    assert not re.findall(r"^\[[EW]\d{4} .*$", ddp_run.result.stderr, re.M)
    assert "Traceback" not in ddp_run.result.stderr


def help_text(name: str) -> str:
    """`--help` as Hydra renders it from the config's help template."""
    help_cfg = hydra_config(name).hydra.help
    groups = "model: lenet, resnet18"
    return string.Template(help_cfg.template).substitute(APP_CONFIG_GROUPS=groups, CONFIG="", FLAGS_HELP="", HYDRA_CONFIG_GROUPS="")


@pytest.mark.parametrize("name", ["train", "eval"])
def test_help_says_what_the_command_does_and_how_to_call_it(name):
    text = help_text(name)
    assert text.startswith(f"{INTERPRETER} -m src.{name}: ") and f"Usage: {INTERPRETER} -m src.{name} " in text
    assert "ckpt_path" in text and "data.root" in text and "model: lenet, resnet18" in text
    assert f"{INTERPRETER} -m src.{name} --cfg job" in text
    assert "powered by Hydra" not in text and "_target_" not in text


@pytest.mark.slow
def test_train_help_on_the_command_line():
    result = run_cli("src.train", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{INTERPRETER} -m src.train: train a model") and "strategy: auto, ddp," in result.stdout
    assert "_target_" not in result.stdout
    # The commands it prints run as printed, from the checkout in a fresh shell: the interpreter is the running one.
    command = result.stdout.split(":", 1)[0].split()
    assert subprocess.run([*command, "--help"], cwd=REPO, env=user_env(), capture_output=True, timeout=120).returncode == 0


def test_sysinfo_names_no_python_calls_and_writes_cudnn_as_released():
    info = {**sysinfo.collect(), "gpus": []}
    report = sysinfo.format_report(info)
    assert "GPUs:         none found by CUDA" in report and "torch.cuda" not in report and "()" not in report
    assert [sysinfo.cudnn_version(n) for n in (92400, 90100, 8902, None)] == ["9.24.0", "9.1.0", "8.9.2", "none"]


@pytest.mark.parametrize("cpu_bf16", [False, True])
def test_bf16_on_a_cpu_without_native_bf16_is_warned(cpu_bf16):
    info = {**sysinfo.collect(), "cpu_bf16": cpu_bf16, "cpu_cores": 2}
    warnings = sysinfo.precision_warnings(info, "bf16-mixed", "cpu", processes=1)
    assert warnings == ([] if cpu_bf16 else [
        "precision=bf16-mixed on this CPU: no native bf16 (AVX512-BF16 or AMX), so it is emulated and slower than fp32; "
        "use precision=32"])
    assert sysinfo.precision_warnings(info, "32-true", "cpu", processes=1) == []


def test_a_file_that_is_no_checkpoint_is_said_in_words(tmp_path):
    text, saved = tmp_path / "notes.txt", tmp_path / "cut.ckpt"
    text.write_text("hello\n")
    torch.save({"w": torch.zeros(1000)}, saved)
    saved.write_bytes(saved.read_bytes()[:2000])
    reasons = []
    for path in (text, saved, tmp_path):
        with pytest.raises(Exception) as caught:
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        reasons.append(unreadable_checkpoint(caught.value))
    assert reasons == ["it is not in the format torch.save writes",
                       "it is damaged or cut short, or a zip archive that torch did not write", "Is a directory"]
