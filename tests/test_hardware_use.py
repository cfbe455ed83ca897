"""How much of the hardware a run used (`src.callbacks.hardware`): FLOP counts against counts by hand from
the layer shapes, the peak that MFU divides by, and the figures in the scalars, the result line, the
report and the HParams tab of a real run."""

import csv
import functools
import mmap
import re
import statistics

import pytest
import torch
from lightning import Trainer
from lightning.fabric.utilities.throughput import _CUDA_FLOPS
from lightning.pytorch.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.callbacks import hardware
from src.callbacks.hardware import HardwareUse, count_flops, peak_flops
from src.callbacks.timing import EpochTimer
from src.data.fashion_mnist import FashionMNISTDataModule
from src.hparams import HPARAM_METRICS
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.models.resnet import resnet18
from src.report import main as report_main
from tests.helpers import call_main, scalars

H100 = "NVIDIA H100 80GB HBM3"  # what torch.cuda.get_device_name says of an H100 SXM


def conv_macs(out_channels: int, in_channels: int, kernel: int, out_size: int) -> int:
    """Multiply-accumulates of a square convolution over one image."""
    return out_channels * in_channels * kernel * kernel * out_size * out_size


def training_flops(layers: list[int]) -> int:
    """FLOPs of a forward and backward pass over one image, from each layer's forward multiply-accumulates
    (first layer first): a FLOP per multiply and one per add; backward computes each layer's weight gradient
    and input gradient, each as costly as its forward pass, but no input gradient for the first layer."""
    return 2 * (3 * sum(layers) - layers[0])


# LeNet on 28x28: conv 20@3x3 -> 26x26, pool -> 13x13, conv 50@5x5 -> 9x9, pool -> 4x4, 800 -> 128 -> 10.
LENET = [conv_macs(20, 1, 3, 26), conv_macs(50, 20, 5, 9), 800 * 128, 128 * 10]


def resnet18_layers() -> list[int]:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool, on 28x28: stages at 28, 14, 7 and 4 pixels a side."""
    layers = [conv_macs(64, 1, 3, 28)]
    width, size = 64, 28
    for stage, channels in enumerate((64, 128, 256, 512)):
        if stage:  # the first block halves the size: its 3x3 convolution strides 2, a 1x1 one takes the shortcut
            size = (size + 1) // 2
            layers += [conv_macs(channels, width, 3, size), conv_macs(channels, channels, 3, size),
                       conv_macs(channels, width, 1, size)]
        else:
            layers += [conv_macs(channels, width, 3, size)] * 2
        layers += [conv_macs(channels, channels, 3, size)] * 2
        width = channels
    return layers + [512 * 10]


def test_lenet_flops_by_hand():
    assert sum(LENET) == 2_250_360
    assert count_flops(LeNet(), (1, 28, 28), batch=8) == 8 * training_flops(LENET)


def test_resnet18_flops_by_hand():
    layers = resnet18_layers()
    assert sum(layers) / 1e9 == pytest.approx(0.456, abs=0.001)  # GMAC forward per image
    assert count_flops(resnet18(), (1, 28, 28), batch=4) == 4 * training_flops(layers)


def test_counting_leaves_the_network_untouched_and_the_precision_changes_no_count():
    net = LeNet(batch_norm=True)
    before = {name: value.clone() for name, value in net.state_dict().items()}
    fp32 = count_flops(net, (1, 28, 28), batch=16)
    bf16 = count_flops(net, (1, 28, 28), batch=16, precision=MixedPrecision("bf16-mixed", "cpu"))
    assert fp32 == bf16 == 16 * training_flops(LENET)
    assert all(torch.equal(before[name], value) for name, value in net.state_dict().items())  # BatchNorm's statistics too
    assert all(p.grad is None and p.device.type == "cpu" for p in net.parameters())


def test_the_peak_is_lightnings_for_a_listed_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "bf16-mixed") == (_CUDA_FLOPS["h100 sxm"][torch.bfloat16], "")
    assert peak_flops(cuda, "16-mixed") == (_CUDA_FLOPS["h100 sxm"][torch.float16], "")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Imaginary X1")
    peak, why = peak_flops(cuda, "bf16-mixed")
    assert peak is None and "NVIDIA Imaginary X1" in why
    peak, why = peak_flops(torch.device("cpu"), "bf16-mixed")
    assert peak is None and "not a CPU" in why


def short_bf16_fit(accelerator: str, net: torch.nn.Module, data_root, batch_size: int, batches: int) -> tuple[HardwareUse, EpochTimer]:
    """Two bf16 epochs of `batches` training batches, no validation: the HardwareUse and EpochTimer they leave."""
    usage, timer = HardwareUse(), EpochTimer()
    trainer = Trainer(accelerator=accelerator, devices=1, max_epochs=2, limit_train_batches=batches, limit_val_batches=0,
                      num_sanity_val_steps=0, precision="bf16-mixed", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, usage],
                      use_distributed_sampler=False)
    data = FashionMNISTDataModule(root=str(data_root), batch_size=batch_size, download=False)
    trainer.fit(Classifier(net, functools.partial(torch.optim.SGD, lr=0.1)), datamodule=data)
    return usage, timer


def test_mfu_of_a_run_against_a_listed_gpu(monkeypatch, data_root):
    """A short fit whose device reads as an H100: MFU is the run's TFLOP/s over the table's bf16 peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(hardware, "peak_flops", lambda device, precision: peak_flops(torch.device("cuda"), precision))
    usage, timer = short_bf16_fit("cpu", LeNet(), data_root, batch_size=32, batches=3)
    assert usage.flops_per_sample == training_flops(LENET)
    peak = _CUDA_FLOPS["h100 sxm"][torch.bfloat16]
    assert len(usage.mfu) == len(usage.tflops_per_s) == len(timer.samples_per_s) == 2
    for tflops, mfu, samples_per_s in zip(usage.tflops_per_s, usage.mfu, timer.samples_per_s):
        assert tflops == pytest.approx(training_flops(LENET) * samples_per_s / 1e12)
        assert mfu == pytest.approx(tflops * 1e12 / peak)
    assert usage.summary()["usage/mfu"] == pytest.approx(statistics.median(usage.mfu))


@pytest.mark.gpu
def test_mfu_on_this_gpu(data_root):
    """A short bf16 fit on the GPU: MFU against Lightning's peak for it, printed for the GPU check's record."""
    usage, timer = short_bf16_fit("gpu", resnet18(), data_root, batch_size=256, batches=20)
    peak, why = peak_flops(torch.device("cuda", 0), "bf16-mixed")
    if peak is None:
        pytest.skip(why)
    assert len(usage.mfu) == 2 and all(0 < mfu < 1 for mfu in usage.mfu)
    assert usage.mfu[-1] == pytest.approx(usage.tflops_per_s[-1] * 1e12 / peak)
    print(f"ResNet-18, batch 256, bf16-mixed, eager steps, {torch.cuda.get_device_name(0)}: "
          f"{usage.tflops_per_s[-1]:.1f} TFLOP/s, MFU {usage.mfu[-1]:.1%}, peak memory {usage.peak_memory:.0f} MiB")


def descriptions(run_dir, tags: list[str]) -> dict[str, str]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.SummaryMetadata(tag).summary_description for tag in tags}


def test_a_cpu_run_shows_its_use_in_scalars_result_line_report_and_hparams(quick_run, tmp_path):
    run_dir, logged = quick_run.dir, scalars(quick_run.dir)
    for tag in ("usage/tflops_per_s", "usage/peak_memory_mib", "usage/tflops_per_s_median"):
        assert tag in logged and all(value > 0 for value in logged[tag]), tag
    assert not any(tag.startswith("usage/mfu") for tag in logged)  # no peak is listed for a CPU
    assert all(descriptions(run_dir, [tag for tag in logged if tag.startswith("usage/")]).values())
    # TFLOP/s per device: LeNet's count by hand times the images per second the same epoch measured.
    assert logged["usage/tflops_per_s"] == pytest.approx([training_flops(LENET) * s / 1e12
                                                          for s in logged["time/samples_per_s"]])
    log = (run_dir / "train.log").read_text()
    assert "usage/mfu is not logged: Lightning's table of peak FLOP/s lists GPUs and TPUs, not a CPU" in log
    [line] = [line for line in quick_run.result.stdout.splitlines() if "test/acc=" in line]
    figures = re.search(r"median epoch \d+\.\d\d s, ([\d.e+-]+) TFLOP/s a device, peak memory (\d+) MiB \(", line)
    assert figures, line
    assert float(figures[1]) == pytest.approx(logged["usage/tflops_per_s_median"][-1], rel=1e-2)
    assert int(figures[2]) == round(logged["usage/peak_memory_mib"][-1])

    result = call_main(report_main, str(run_dir), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    with (tmp_path / "report.csv").open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert float(row["tflops_per_s"]) == pytest.approx(logged["usage/tflops_per_s"][0])
    assert float(row["peak_memory_mib"]) == pytest.approx(max(logged["usage/peak_memory_mib"]))
    assert row["mfu"] == ""
    header = (tmp_path / "report.md").read_text().split("\n| ")[1]
    assert "TFLOP/s a device (median)" in header and "peak memory MiB" in header and "MFU" not in header
    for tag in ("usage/tflops_per_s_median", "usage/mfu_median", "usage/peak_memory_mib"):
        assert tag in HPARAM_METRICS


def test_peak_memory_on_cpu_is_this_fits_own_not_an_earlier_jobs_in_the_same_process():
    """A sequential sweep runs its jobs in one process: 12 trials of one model reported 1046, 1136 ... 1419 MiB, the
    process's peak so far. A fit's start resets the peak Linux keeps (VmHWM)."""
    cpu, size = torch.device("cpu"), 512 * 2**20
    earlier_job = mmap.mmap(-1, size)  # memory an earlier job touched and gave back
    for offset in range(0, size, 2**20):
        earlier_job[offset:offset + 2**20] = b"x" * 2**20
    peak_with_it = hardware.peak_memory_mib(cpu)
    earlier_job.close()
    hardware.reset_peak_memory(cpu)
    assert hardware.peak_memory_mib(cpu) < peak_with_it - 400
