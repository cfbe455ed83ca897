"""`python -m src.sysinfo`: what this machine offers for data-parallel training, and which precision suits it."""

import ctypes
import os
import re
import subprocess
from pathlib import Path
from typing import Any

HALF_PRECISIONS = ("16-mixed", "16", "16-true")
# Link codes of `nvidia-smi topo -m` other than NV#, from its legend.
PCIE_LINKS = {
    "PIX": "PCIe, at most one PCIe bridge", "PXB": "PCIe, several PCIe bridges", "PHB": "PCIe through a host bridge",
    "NODE": "PCIe across host bridges in one NUMA node", "SYS": "PCIe across NUMA nodes (SMP interconnect)",
}


def described(index: int, name: str, memory_bytes: int, major: int, minor: int) -> dict[str, Any]:
    return {"index": index, "name": name, "memory_gib": round(memory_bytes / 2**30, 1), "capability": f"{major}.{minor}",
            "fp16_tensor_cores": (major, minor) >= (7, 0),  # Volta
            "bf16": (major, minor) >= (8, 0)}  # Ampere


def gpu_info(index: int) -> dict[str, Any]:
    """Through CUDA: in a rank, which holds its device anyway."""
    import torch  # imported where used: `--help` answers without it

    props = torch.cuda.get_device_properties(index)
    return described(index, props.name, props.total_memory, props.major, props.minor)


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def visible_nvml_indices(count: int) -> list[int] | None:
    """NVML's index of each device CUDA numbers, from `CUDA_VISIBLE_DEVICES` as CUDA reads it (up to the first entry
    that is no device); None for entries that are no plain index (UUIDs, MIG): CUDA alone maps those."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    indices: list[int] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry.lstrip("-").isdigit():
            return None if entry else indices
        if not 0 <= int(entry) < count or int(entry) in indices:
            return indices
        indices.append(int(entry))
    return indices


def nvml_gpus() -> list[dict[str, Any]] | None:
    """`gpu_info` of every device this process may use, from the driver's NVML library, which makes no CUDA context:
    the launching process leaves the GPUs to its ranks. None where NVML cannot tell."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        indices = None if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) else visible_nvml_indices(count.value)
        gpus = []
        for index, nvml_index in enumerate(indices if indices is not None else []):
            handle, name, memory = ctypes.c_void_p(), ctypes.create_string_buffer(96), _NvmlMemory()
            major, minor = ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(nvml_index), ctypes.byref(handle))
                    or nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(len(name)))
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))):
                return None
            gpus.append(described(index, name.value.decode(errors="replace"), memory.total, major.value, minor.value))
        return gpus if indices is not None else None
    finally:
        nvml.nvmlShutdown()


class _NvmlUtilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class NvmlUtilization:
    """A rank's GPU's utilization, %, through NVML (no CUDA call, so no synchronization); `read` is None where NVML
    cannot tell."""

    def __init__(self, cuda_index: int) -> None:
        self._nvml, self._handle = None, ctypes.c_void_p()
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return
        count = ctypes.c_uint()
        if nvml.nvmlInit_v2() != 0:
            return
        indices = None if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) else visible_nvml_indices(count.value)
        if indices is None or cuda_index >= len(indices) or \
                nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(indices[cuda_index]), ctypes.byref(self._handle)):
            nvml.nvmlShutdown()
            return
        self._nvml = nvml

    def read(self) -> float | None:
        rates = _NvmlUtilization()
        if self._nvml is None or self._nvml.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(rates)):
            return None
        return float(rates.gpu)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None


def launching_gpus() -> list[dict[str, Any]]:
    """The GPUs as the launching process sees them: through NVML, else through CUDA."""
    import torch

    found = nvml_gpus()
    return found if found is not None else [gpu_info(i) for i in range(torch.cuda.device_count())]


def _nvidia_smi_topology() -> str | None:
    try:
        result = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):  # no nvidia-smi, or it hangs
        return None
    return result.stdout if result.returncode == 0 else None


def parse_topology(text: str) -> dict[str, str]:
    """Link code (NV12, PIX, SYS, ...) of every GPU pair `GPUi-GPUj`, i < j."""
    rows = [[cell.strip() for cell in re.sub(r"\x1b\[[0-9;]*m", "", line).split("\t")] for line in text.splitlines()]
    header = next((cells for cells in rows if any(re.match(r"GPU\d+", cell) for cell in cells[1:])), [])
    columns = {k: int(cell[3:]) for k, cell in enumerate(header) if re.fullmatch(r"GPU\d+", cell)}
    links = {}
    for cells in rows:
        if re.fullmatch(r"GPU\d+", cells[0]):
            row = int(cells[0][3:])
            links.update({f"GPU{row}-GPU{col}": cells[k] for k, col in columns.items() if row < col and k < len(cells)})
    return links


def interconnect_of(count: int) -> dict[str, Any]:
    """From nvidia-smi where it runs, else from CUDA peer access."""
    import torch

    if count < 2:
        return {"summary": "none (fewer than 2 GPUs)", "source": None, "links": {}}
    links = parse_topology(_nvidia_smi_topology() or "")
    if links:
        nvlink = [code.startswith("NV") for code in links.values()]
        summary = "NVLink" if all(nvlink) else "mixed NVLink and PCIe" if any(nvlink) else "PCIe"
        return {"summary": summary, "source": "nvidia-smi topo -m", "links": links}
    links = {f"GPU{i}-GPU{j}": "peer" if torch.cuda.can_device_access_peer(i, j) else "no peer"
             for i in range(count) for j in range(i + 1, count)}
    peer = [code == "peer" for code in links.values()]
    summary = ("peer access (NVLink or PCIe P2P; nvidia-smi would tell which)" if all(peer)
               else "no peer access between some GPUs: their traffic goes through host memory")
    return {"summary": summary, "source": "torch.cuda.can_device_access_peer", "links": links}


UNREAD = {"summary": "not read yet", "source": None, "links": {}}


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 on the CPU is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def cpu_model() -> str:
    """The CPU's name, which benchmark figures name beside them (`/proc/cpuinfo`, else the platform's word)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def recommend_precision(gpus: list[dict[str, Any]], cpu_bf16: bool) -> tuple[str, str]:
    """The precision to pass, and why; mixed GPUs are judged by the weakest."""
    if not gpus:
        if cpu_bf16:
            return "bf16-mixed", ("no CUDA GPU: 16-mixed needs CUDA; this CPU has native bf16 (AVX512-BF16/AMX), "
                                  "which trains LeNet 1.6x faster than fp32, 2.9x with channels_last (docs/results.md)")
        return "32", ("no CUDA GPU: 16-mixed needs CUDA, and this CPU lacks native bf16 (AVX512-BF16/AMX), "
                      "so bf16-mixed would be emulated and slower than fp32")
    if all(g["bf16"] for g in gpus):
        return "bf16-mixed", "bf16 tensor cores (compute capability >= 8.0): fp16 speed, fp32 range, no loss scaling"
    if all(g["fp16_tensor_cores"] for g in gpus):
        return "16-mixed", ("fp16 tensor cores (compute capability >= 7.0) but no bf16 ones; "
                            "the gradients are loss-scaled")
    weakest = min(gpus, key=lambda g: tuple(map(int, g["capability"].split("."))))
    return "32", (f"GPU{weakest['index']} ({weakest['name']}, compute capability {weakest['capability']}) has no "
                  "tensor cores: mixed precision would save memory but rarely time")


def collect(interconnect: bool = True) -> dict[str, Any]:
    """Without `interconnect`, its entry says it is still being read: `nvidia-smi topo -m` can take 20 s."""
    import lightning
    import torch
    import torch.distributed as dist

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [gpu_info(i) for i in range(count)]
    cpu_bf16 = cpu_has_bf16()
    precision, reason = recommend_precision(gpus, cpu_bf16)
    return {
        "gpus": gpus, "fp16_tensor_cores": bool(gpus) and all(g["fp16_tensor_cores"] for g in gpus),
        "bf16": bool(gpus) and all(g["bf16"] for g in gpus) and torch.cuda.is_bf16_supported(including_emulation=False),
        "interconnect": interconnect_of(count) if interconnect else UNREAD, "nccl": dist.is_available() and dist.is_nccl_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "cpu_cores": _cpu_cores(), "threads": torch.get_num_threads(), "cpu_bf16": cpu_bf16,
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__, "cuda": torch.version.cuda,
                     "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None},
        "recommended_precision": precision, "precision_reason": reason,
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def cudnn_version(number: int | None) -> str:
    """torch reports it as one number: 92400 is 9.24.0, 8902 is 8.9.2."""
    if not number:
        return "none"
    scale = 10000 if number >= 10000 else 1000  # cuDNN 9 gave the minor version two digits
    major, rest = divmod(number, scale)
    return f"{major}.{rest // 100}.{rest % 100}"


def format_report(info: dict[str, Any]) -> str:
    def line(label: str, text: str) -> str:
        return f"{label + ':':<14}{text}"

    gpus = info["gpus"]
    lines = [line("GPUs", f"{len(gpus)}" if gpus else "none found by CUDA")]
    lines += [f"  GPU{g['index']}  {g['name']}  {g['memory_gib']} GiB  compute capability {g['capability']}  "
              f"fp16 tensor cores: {_yes(g['fp16_tensor_cores'])}  bf16: {_yes(g['bf16'])}" for g in gpus]
    lines.append(line("Tensor cores", f"fp16 {_yes(info['fp16_tensor_cores'])}, bf16 {_yes(info['bf16'])}"))
    interconnect = info["interconnect"]
    source = f" (from {interconnect['source']})" if interconnect["source"] else ""
    lines.append(line("Interconnect", f"{interconnect['summary']}{source}"))
    lines += [f"  {pair}: " + (f"NVLink ({code[2:]} links)" if code.startswith("NV") else PCIE_LINKS.get(code, code))
              for pair, code in interconnect["links"].items()]
    lines.append(line("Backends", f"NCCL {_yes(info['nccl'])} (needs CUDA GPUs), gloo {_yes(info['gloo'])}"))
    lines.append(line("CPU cores", f"{info['cpu_cores']} usable by this process; "
                                   f"native bf16: {_yes(info['cpu_bf16'])}"))
    lines.append(line("CPU threads", f"{info['threads']} for torch's operators in this process (a DDP worker's: its "
                                     "share of the cores); OMP_NUM_THREADS=<n> sets them"))
    v = info["versions"]
    lines.append(line("Versions", f"torch {v['torch']}, lightning {v['lightning']}, "
                                  f"CUDA {v['cuda'] or 'none (CPU build)'}, cuDNN {cudnn_version(v['cudnn'])}"))
    lines.append(line("Precision", f"precision={info['recommended_precision']}: {info['precision_reason']}"))
    return "\n".join(lines)


def precision_warnings(info: dict[str, Any], precision: str, accelerator: str, processes: int) -> list[str]:
    """One line per way a run's precision or process count fits this hardware badly."""
    precision = str(precision)
    warnings = []
    if accelerator in ("gpu", "cuda"):
        for g in info["gpus"]:
            gpu = f"precision={precision} on GPU{g['index']} ({g['name']}, compute capability {g['capability']})"
            if precision in HALF_PRECISIONS and not g["fp16_tensor_cores"]:
                warnings.append(f"{gpu}: no fp16 tensor cores, so little or no speed-up; use precision=32")
            if precision.startswith("bf16") and not g["bf16"]:
                better = "16-mixed" if g["fp16_tensor_cores"] else "32"
                warnings.append(f"{gpu}: no bf16 support, it is emulated and slow; use precision={better}")
    elif accelerator == "cpu":
        if precision.startswith("bf16") and not info["cpu_bf16"]:
            warnings.append(f"precision={precision} on this CPU: no native bf16 (AVX512-BF16 or AMX), so it is "
                            "emulated and slower than fp32; use precision=32")
        if processes > info["cpu_cores"]:
            warnings.append(f"{processes} DDP processes on {info['cpu_cores']} CPU cores: the processes compete for "
                            f"cores and every step slows down; use devices={info['cpu_cores']} or fewer")
    return warnings


def main(argv: list[str] | None = None) -> None:
    from src.runs import ArgumentParser, usage_errors_exit

    parser = ArgumentParser(prog="python -m src.sysinfo", description=__doc__.splitlines()[0])
    with usage_errors_exit():
        parser.parse_args(argv)
    print(format_report(collect()))


if __name__ == "__main__":
    main()
