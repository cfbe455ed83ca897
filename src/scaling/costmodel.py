"""How long gradient averaging takes on N processes: bytes per hook, ring all-reduce time, epoch time.

The model behind `python -m src.scaling` (docs/scaling.md), kept free of file reading so that
every formula can be checked by hand:

- bytes: what one process hands to all-reduce per optimizer step under each DDP hook, the same
  payload `comm/bytes_per_step` counts (`collectives`);
- time of one ring all-reduce of b bytes over N processes (Thakur et al., 2005): 2(N-1) steps of
  latency plus 2(N-1)/N x b / bandwidth (`ring_allreduce_s`);
- a step: compute shrinks as 1/N because `data.batch_size` is the GLOBAL batch (strong scaling:
  the steps per epoch stay fixed); communication hides behind the backward pass for the share
  overlap_frac of min(comm, backward compute) (`predict_step`).
"""

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from src.strategies.comm import FP32_BYTES
from src.strategies.ddp import HOOKS, MIB

HALF_BYTES = torch.float16.itemsize  # bf16 too
BACKWARD_SHARE = 2 / 3  # backward ~ twice the forward pass: the share used when a run did not time its backward pass


@dataclass(frozen=True)
class Interconnect:
    """A link between neighbouring processes of the ring.

    `cores`: the processes share this many CPU cores (the machine the runs were measured on), so
    compute per step stops shrinking beyond that many processes; None: one device per process.
    """

    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # s, per ring step
    source: str = ""
    cores: int | None = None


# Nominal one-direction line rates from the standards, and the order of magnitude of one hop's
# latency as collective libraries see it. Real all-reduces reach some 70-90 % of the line rate
# (nccl-tests' "bus bandwidth"), so these figures are the best case.
INTERCONNECTS = (
    Interconnect("PCIe 4 x16", 31.5e9, 2e-6, "PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b coding; ~2 us through the root complex"),
    Interconnect("NVLink 4", 450e9, 1e-6, "H100 SXM: 18 NVLink 4 links, 900 GB/s both directions; ~1 us"),
    Interconnect("10 GbE", 1.25e9, 20e-6, "IEEE 802.3 10GBASE: 10 Gb/s; ~20 us per TCP hop through the kernel"),
    Interconnect("100 GbE", 12.5e9, 5e-6, "IEEE 802.3 100GBASE: 100 Gb/s; ~5 us with RDMA (RoCE)"),
    Interconnect("400 Gb InfiniBand", 50e9, 1.5e-6, "InfiniBand NDR: 400 Gb/s per port; ~1.5 us through one switch"),
)


def ring_allreduce_s(nbytes: float, processes: int, link: Interconnect) -> float:
    """Seconds of one ring all-reduce: reduce-scatter then all-gather, 2(N-1) steps of b/N bytes each."""
    if processes <= 1:
        return 0.0
    steps = 2 * (processes - 1)
    return steps * link.latency + steps / processes * nbytes / link.bandwidth


def ddp_buckets(numels: Sequence[int], first_cap: int = MIB, cap: int = 25 * MIB) -> list[int]:
    """fp32 bytes of each DDP bucket: gradients in reverse order, a bucket closes once it reaches its cap.

    DDP's defaults: the first bucket 1 MiB, the others 25 MiB. Approximate (DDP also splits by
    device and dtype), and only the count matters here: one all-reduce, one latency, per bucket.
    """
    buckets, current, limit = [], 0, first_cap
    for numel in reversed(numels):
        current += numel * FP32_BYTES
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return buckets + [current] if current else buckets


def powersgd_sizes(shapes: Sequence[Sequence[int]], rank: int) -> tuple[int, int, int]:
    """Elements PowerSGD all-reduces: (uncompressed, all P, all Q), as torch's `powerSGD_hook` splits them.

    Each gradient is an n x m matrix (first dimension x the rest); with r = min(n, m, rank) it is
    compressed into P (n x r) and Q (m x r) only when 2 (n + m) r < n m; the rest travels whole.
    """
    uncompressed = ps = qs = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = math.prod(shape) // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * 2 < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            uncompressed += n * m
    return uncompressed, ps, qs


def collectives(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1) -> list[int]:
    """Bytes of each all-reduce one process issues per optimizer step under `hook`.

    none: every bucket as fp32; fp16/bf16: the same buckets at 2 bytes per element; powersgd:
    three all-reduces (uncompressed tensors, all P, all Q) of one bucket, as this project's gloo
    runs have it (PowerSGD's warm-up steps send what `none` sends); powersgd_fp16: the same at 2 bytes.
    """
    numels = [math.prod(shape) for shape in shapes]
    if hook == "none":
        return ddp_buckets(numels)
    if hook in ("fp16", "bf16"):
        return [b * HALF_BYTES // FP32_BYTES for b in ddp_buckets(numels)]
    if hook in ("powersgd", "powersgd_fp16"):
        size = FP32_BYTES if hook == "powersgd" else HALF_BYTES
        return [elements * size for elements in powersgd_sizes(shapes, rank)]
    raise ValueError(f"unknown hook {hook!r}; one of {', '.join(HOOKS)}")


def _median_s(work: Callable[[], object], repeats: int = 3) -> float:
    work()  # warm-up: allocation, first-call dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def encode_s(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1) -> float:
    """Seconds one CPU thread spends per step on the hook's own arithmetic, on tensors of the model's shapes.

    none divides the gradients by N; fp16/bf16 cast them there and back; PowerSGD adds the error
    feedback, computes P = M Q, orthonormalises P, computes Q = M^T P and rebuilds M = P Q^T.
    One thread, as each of 2 DDP processes gets on 2 cores; it also keeps the figure steady on a
    busy machine, where several threads mostly wait for each other.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _encode_s(shapes, hook, rank)
    finally:
        torch.set_num_threads(threads)


def _encode_s(shapes: Sequence[Sequence[int]], hook: str, rank: int) -> float:
    numel = sum(math.prod(shape) for shape in shapes)
    flat = torch.randn(numel)
    if hook == "none":
        return _median_s(lambda: flat.div_(2))
    if hook in ("fp16", "bf16"):
        dtype = torch.float16 if hook == "fp16" else torch.bfloat16
        return _median_s(lambda: flat.copy_(flat.to(dtype).div_(2)))
    matrices = [torch.randn(s[0], math.prod(s) // s[0]) for s in shapes if len(s) > 1]
    matrices = [m for m in matrices if 2 * (m.shape[0] + m.shape[1]) * min(rank, *m.shape) < m.numel()]
    error = torch.zeros(numel)

    def powersgd() -> None:
        if hook == "powersgd_fp16":
            flat.copy_(flat.half().float())
        flat.add_(error)
        kept = flat.clone()
        for m in matrices:
            r = min(rank, *m.shape)
            p = torch.linalg.qr(m @ torch.randn(m.shape[1], r)).Q
            q = m.T @ p
            m.copy_(p @ q.T)
        error.copy_(kept).sub_(flat)

    return _median_s(powersgd)


@dataclass(frozen=True)
class Step:
    """One optimizer step on N processes, in seconds."""

    compute: float
    comm: float  # the hook's arithmetic plus its all-reduces
    hidden: float  # the part of comm that runs while the backward pass still computes

    @property
    def exposed(self) -> float:
        return self.comm - self.hidden

    @property
    def total(self) -> float:
        return self.compute + self.exposed


def parallel_share(processes: int, link: Interconnect) -> int:
    """By how much N processes divide the compute: N devices, or no more than the shared cores."""
    return processes if link.cores is None else min(processes, link.cores)


def predict_step(
    compute_1: float, backward_1: float | None, overlap_frac: float, sizes: Sequence[int], encode: float,
    processes: int, link: Interconnect,
) -> Step:
    """One step on N processes from one process's step compute (s) and the hook's all-reduce sizes (bytes).

    Strong scaling: the global batch is split over the processes, so each computes 1/N of it.
    `backward_1`: one process's backward pass (s); None: BACKWARD_SHARE of its step compute.
    """
    share = parallel_share(processes, link)
    compute = compute_1 / share
    if processes <= 1:
        return Step(compute, 0.0, 0.0)
    comm = encode + sum(ring_allreduce_s(b, processes, link) for b in sizes)
    backward = (BACKWARD_SHARE * compute_1 if backward_1 is None else backward_1) / share
    return Step(compute, comm, overlap_frac * min(comm, backward))
