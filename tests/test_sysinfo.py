"""`src.sysinfo` on this machine, and on A100-, V100-, T4- and P100-like GPUs faked through torch.cuda."""

import logging
import os
import re
import threading
from types import SimpleNamespace

import lightning
import pytest
import torch
from lightning import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src import sysinfo
from src.callbacks.sysinfo import SystemInfoLogger
from tests.helpers import run_cli, user_env

GiB = 2**30
A100 = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=80 * GiB, major=8, minor=0)
V100 = SimpleNamespace(name="Tesla V100-SXM2-32GB", total_memory=32 * GiB, major=7, minor=0)
T4 = SimpleNamespace(name="Tesla T4", total_memory=15 * GiB, major=7, minor=5)
P100 = SimpleNamespace(name="Tesla P100-PCIE-16GB", total_memory=16 * GiB, major=6, minor=0)

NVLINK_TOPOLOGY = (
    "\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tNV12\tSYS\tPXB\t0-63\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tNV12\tPXB\t0-63\t0\t\tN/A\n"
    "GPU2\tSYS\tNV12\t X \tSYS\t64-127\t1\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\t X \n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)


def fake_gpus(monkeypatch, *gpus: SimpleNamespace, topology: str | None = None, peer: bool = True) -> None:
    """torch.cuda as it looks with these GPUs; is_bf16_supported behaves as torch's does for GPU 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: gpus[index])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: bool(gpus) and (gpus[0].major >= 8 or including_emulation))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: peer)
    monkeypatch.setattr(sysinfo, "_nvidia_smi_topology", lambda: topology)


@pytest.mark.parametrize(
    ("gpu", "fp16_tc", "bf16", "recommended"),
    [(A100, True, True, "bf16-mixed"), (V100, True, False, "16-mixed"), (T4, True, False, "16-mixed"),
     (P100, False, False, "32")],
    ids=["A100", "V100", "T4", "P100"],
)
def test_tensor_core_flags_and_recommendation(monkeypatch, gpu, fp16_tc, bf16, recommended):
    fake_gpus(monkeypatch, gpu)
    info = sysinfo.collect()
    [found] = info["gpus"]
    assert found["name"] == gpu.name and found["capability"] == f"{gpu.major}.{gpu.minor}"
    assert found["memory_gib"] == pytest.approx(gpu.total_memory / GiB)
    assert (found["fp16_tensor_cores"], found["bf16"]) == (info["fp16_tensor_cores"], info["bf16"]) == (fp16_tc, bf16)
    assert info["recommended_precision"] == recommended
    report = sysinfo.format_report(info)
    assert gpu.name in report and f"precision={recommended}" in report


@pytest.mark.parametrize(
    ("gpu", "precision", "warned"),
    [(A100, "bf16-mixed", False), (A100, "16-mixed", False), (V100, "bf16-mixed", True), (T4, "bf16-mixed", True),
     (T4, "16-mixed", False), (P100, "16-mixed", True), (P100, "32-true", False)],
)
def test_precision_warnings_on_gpus(monkeypatch, gpu, precision, warned):
    fake_gpus(monkeypatch, gpu)
    warnings = sysinfo.precision_warnings(sysinfo.collect(), precision, "gpu", processes=1)
    assert len(warnings) == int(warned)
    for warning in warnings:
        assert "\n" not in warning and gpu.name in warning and f"precision={precision}" in warning


def test_bf16_warning_points_a_t4_at_16_mixed_and_a_p100_at_32(monkeypatch):
    fake_gpus(monkeypatch, T4, P100)
    warnings = sysinfo.precision_warnings(sysinfo.collect(), "bf16-mixed", "gpu", processes=2)
    assert [w.rsplit("precision=", 1)[1] for w in warnings] == ["16-mixed", "32"]


def test_mixed_gpus_are_judged_by_the_weakest(monkeypatch):
    fake_gpus(monkeypatch, A100, T4)
    info = sysinfo.collect()
    assert (info["fp16_tensor_cores"], info["bf16"], info["recommended_precision"]) == (True, False, "16-mixed")


def test_cpu_run_with_more_processes_than_cores_is_warned(monkeypatch):
    fake_gpus(monkeypatch)
    info = sysinfo.collect()
    cores = info["cpu_cores"]
    assert cores == len(os.sched_getaffinity(0))
    assert sysinfo.precision_warnings(info, "32-true", "cpu", processes=cores) == []
    [warning] = sysinfo.precision_warnings(info, "32-true", "cpu", processes=cores + 1)
    assert f"{cores + 1} DDP processes on {cores} CPU cores" in warning
    assert info["recommended_precision"] == ("bf16-mixed" if info["cpu_bf16"] else "32")
    assert "no CUDA GPU" in info["precision_reason"]


@pytest.mark.parametrize(("cpu_bf16", "expected"), [(True, "bf16-mixed"), (False, "32")])
def test_without_gpus_bf16_is_recommended_only_where_the_cpu_has_it(cpu_bf16, expected):
    precision, reason = sysinfo.recommend_precision([], cpu_bf16)
    assert precision == expected and ("has native bf16" if cpu_bf16 else "lacks native bf16") in reason


def test_nvlink_from_nvidia_smi(monkeypatch):
    fake_gpus(monkeypatch, A100, A100, A100, topology=NVLINK_TOPOLOGY)
    interconnect = sysinfo.collect()["interconnect"]
    assert interconnect["links"] == {"GPU0-GPU1": "NV12", "GPU0-GPU2": "SYS", "GPU1-GPU2": "NV12"}
    assert interconnect["summary"] == "mixed NVLink and PCIe" and interconnect["source"] == "nvidia-smi topo -m"
    assert "NVLink (12 links)" in sysinfo.format_report(sysinfo.collect())


def test_pcie_only_topology(monkeypatch):
    pcie = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tPHB\t0-15\nGPU1\tPHB\t X \t0-15\n"
    fake_gpus(monkeypatch, T4, T4, topology=pcie)
    interconnect = sysinfo.collect()["interconnect"]
    assert (interconnect["summary"], interconnect["links"]) == ("PCIe", {"GPU0-GPU1": "PHB"})


@pytest.mark.parametrize("topology", [None, "NVIDIA-SMI has failed because it couldn't communicate with the driver"])
def test_peer_access_without_a_usable_nvidia_smi(monkeypatch, topology):
    fake_gpus(monkeypatch, T4, T4, topology=topology, peer=False)
    interconnect = sysinfo.collect()["interconnect"]
    assert interconnect["source"] == "torch.cuda.can_device_access_peer"
    assert interconnect["links"] == {"GPU0-GPU1": "no peer"} and "host memory" in interconnect["summary"]


@pytest.mark.slow
def test_cli_on_this_machine():
    result = run_cli("src.sysinfo", timeout=120, env={**user_env(), "OMP_NUM_THREADS": "1"})  # the count it is given
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(rf"CPU cores:\s+{len(os.sched_getaffinity(0))}\b", out)
    assert re.search(r"CPU threads:\s+1 for torch's operators", out)
    assert f"torch {torch.__version__}" in out and f"lightning {lightning.__version__}" in out
    assert re.search(rf"gloo {'yes' if torch.distributed.is_gloo_available() else 'no'}", out)
    if not torch.cuda.is_available():
        assert "GPUs:" in out and "none" in out.splitlines()[0]
        assert f"precision={'bf16-mixed' if sysinfo.cpu_has_bf16() else '32'}: no CUDA GPU" in out
    else:
        assert out.count("compute capability") == torch.cuda.device_count()


def test_callback_logs_the_report_as_tensorboard_text(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="", version="")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=logger,
                      callbacks=[SystemInfoLogger()], enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False)
    trainer.fit(BoringModel())
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("system/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "```\n" + sysinfo.format_report(sysinfo.collect()) + "\n```"


def test_callback_warns_in_one_line_on_rank_zero_only(monkeypatch, caplog):
    monkeypatch.setattr(sysinfo, "_cpu_cores", lambda: 2)
    texts = []
    trainer = SimpleNamespace(is_global_zero=True, loggers=[SimpleNamespace(experiment=SimpleNamespace(
        add_text=lambda tag, text, global_step: texts.append((tag, global_step))))], accelerator=CPUAccelerator(),
        precision="32-true", world_size=8, num_nodes=2, global_step=6)
    with caplog.at_level(logging.WARNING, logger="src.callbacks.sysinfo"):
        for rank_zero in (True, False):
            trainer.is_global_zero = rank_zero
            callback = SystemInfoLogger()
            callback.on_fit_start(trainer, None)
            callback.on_train_start(trainer, None)
            callback.on_train_batch_end(trainer, None, None, None, 0)
            callback.on_train_end(trainer, None)
    assert texts == [("system", 6)]  # once, at the step training starts from: a resumed run's, here 6
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage().startswith("4 DDP processes on 2 CPU cores")


def test_the_interconnect_is_read_beside_training_and_written_again_once_it_is_known(monkeypatch):
    """`nvidia-smi topo -m` may take 20 s: rank 0 starts training meanwhile (its peers would wait for it); the text
    comes at the start saying so, and again at the first batch end after the reader is done, at a step that never
    goes back (TensorBoard purges what follows a step that does). One that takes too long is written as not read."""
    from src.callbacks import sysinfo as callback_module

    readers = [threading.Event(), threading.Event()]
    links = {"summary": "NVLink", "source": "nvidia-smi topo -m", "links": {"GPU0-GPU1": "NV12"}}
    monkeypatch.setattr(sysinfo, "interconnect_of", lambda count: readers.pop(0).wait() and links)
    reading, slow = readers
    texts = []
    trainer = SimpleNamespace(is_global_zero=True, loggers=[SimpleNamespace(experiment=SimpleNamespace(
        add_text=lambda tag, text, global_step: texts.append((global_step, text))))], accelerator=CPUAccelerator(),
        precision="32-true", world_size=1, num_nodes=1, global_step=10)
    callback = SystemInfoLogger()
    callback.on_fit_start(trainer, None)
    callback.on_train_start(trainer, None)  # returns with the reader still waiting
    trainer.global_step = 11
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert [step for step, _ in texts] == [10] and "Interconnect: being read (nvidia-smi topo -m)" in texts[0][1]
    reading.set()
    callback._reader.join()
    trainer.global_step = 12
    callback.on_train_batch_end(trainer, None, None, None, 1)
    callback.on_train_batch_end(trainer, None, None, None, 2)
    callback.on_train_end(trainer, None)
    assert [step for step, _ in texts] == [10, 11] and "Interconnect: NVLink (from nvidia-smi topo -m)" in texts[1][1]

    monkeypatch.setattr(callback_module, "TOPOLOGY_WAIT_S", 0.01)
    monkeypatch.setattr(callback_module, "QUICK_READ_S", 0.01)
    callback.on_fit_start(trainer, None)
    callback.on_train_start(trainer, None)
    callback.on_train_end(trainer, None)
    slow.set()
    assert "Interconnect: not read: nvidia-smi topo -m took over 0.01 s" in texts[-1][1] and len(texts) == 4


class StandInNvml:
    """The driver's NVML library as ctypes sees it: each function fills what it is passed by reference, returns 0."""

    def __init__(self, devices: list[tuple[str, int, int, int]]) -> None:
        self.devices, self.calls = devices, []

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append(name)
            fill = type(self).__dict__.get(f"_{name}")
            if fill is not None:
                fill(self, *args)
            return 0
        return call

    def _nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.devices)

    def _nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index.value + 1  # a handle is a pointer: never 0

    def _nvmlDeviceGetName(self, handle, name, length):
        name.value = self.devices[handle.value - 1][0].encode()

    def _nvmlDeviceGetMemoryInfo(self, handle, memory):
        memory._obj.total = self.devices[handle.value - 1][1]

    def _nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.devices[handle.value - 1][2:]


def test_the_launching_process_reads_its_gpus_through_nvml_as_cuda_numbers_them(monkeypatch):
    """No CUDA context: NVML gives each visible device's name, memory and compute capability, in CUDA's order."""
    nvml = StandInNvml([("Tesla V100", 16 * 2**30, 7, 0), ("NVIDIA H100 80GB HBM3", 80 * 2**30, 9, 0)])
    monkeypatch.setattr(sysinfo.ctypes, "CDLL", lambda name: nvml if name == "libnvidia-ml.so.1" else None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert sysinfo.nvml_gpus() == [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_gib": 80.0, "capability": "9.0",
                                    "fp16_tensor_cores": True, "bf16": True}]
    assert nvml.calls[0] == "nvmlInit_v2" and nvml.calls[-1] == "nvmlShutdown"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [gpu["name"] for gpu in sysinfo.nvml_gpus()] == ["Tesla V100", "NVIDIA H100 80GB HBM3"]
    assert sysinfo.recommend_precision(sysinfo.nvml_gpus(), False)[0] == "16-mixed"  # judged by the V100
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8c6b1a3e")  # by UUID: only CUDA maps it
    assert sysinfo.nvml_gpus() is None


@pytest.mark.parametrize(("visible", "indices"), [
    (None, [0, 1, 2, 3]), ("", []), ("2,0", [2, 0]), ("0,7,1", [0]), ("1,,0", [1]), ("-1", []), ("0,0", [0]),
    ("MIG-1", None),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(monkeypatch, visible, indices):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sysinfo.visible_nvml_indices(4) == indices


def test_a_run_records_its_thread_count_in_hparams(quick_run):
    """The thread count changed the result at the same seed (val/acc 0.8586 against 0.8520): it is a setting."""
    from tests.helpers import hparams

    assert hparams(quick_run.dir)["threads"] == torch.get_num_threads()
