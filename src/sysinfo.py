"""`python -m src.sysinfo`: what this machine offers for data-parallel training, and which precision suits it."""

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


def gpu_info(index: int) -> dict[str, Any]:
    import torch  # imported where used: `--help` answers without it

    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    return {"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "fp16_tensor_cores": capability >= (7, 0),  # Volta
            "bf16": capability >= (8, 0)}  # Ampere


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


def _interconnect(count: int) -> dict[str, Any]:
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


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 on the CPU is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


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


def collect() -> dict[str, Any]:
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
        "interconnect": _interconnect(count), "nccl": dist.is_available() and dist.is_nccl_available(),
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
