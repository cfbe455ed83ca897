"""How long gradient averaging takes on N processes: bytes per hook, ring all-reduce time, epoch time. Plain
numbers, no torch, so that `--help` answers at once and every formula can be checked by hand (docs/scaling.md)."""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


FP32_BYTES, HALF_BYTES = 4, 2  # bf16 is 2 bytes too
MIB = 2**20
# The DDP hooks the model prices: those `src.strategies.ddp` builds (a test holds the two lists equal).
HOOKS = ("none", "fp16", "bf16", "powersgd", "powersgd_fp16")
BACKWARD_SHARE = 2 / 3  # backward ~ twice the forward pass: the share used when a run did not time its backward pass


@dataclass(frozen=True)
class Interconnect:
    """A link between neighbouring processes of the ring. `timed`: (bytes, seconds) timed at `timed_processes`, read
    there instead of the ring formula, which gloo's change of algorithm with the size breaks."""

    name: str
    bandwidth: float  # bytes/s, one direction, nominal
    latency: float  # s, per ring step
    source: str = ""
    cores: int | None = None  # processes share this many CPU cores; None: one device per process
    bus_share: float = 1.0  # of `bandwidth` an all-reduce reaches (nccl-tests' bus bandwidth); 1 for a measured fit
    timed: tuple[tuple[int, float], ...] = ()
    timed_processes: int = 0
    lag: float = 0.0  # time lost meeting after equal work on shared cores, a share of compute and overhead (the probe)

    @property
    def bus_bandwidth(self) -> float:
        return self.bandwidth * self.bus_share


# Assumed, not measured: nccl-tests' bus bandwidth (algorithm bandwidth x 2(N-1)/N, NVIDIA/nccl-tests
# doc/PERFORMANCE.md) reaches some 70-90 % of the line rate in well-tuned collectives.
PRESET_BUS_SHARE = 0.8
_preset = functools.partial(Interconnect, bus_share=PRESET_BUS_SHARE)  # (name, bandwidth, latency, source)

# Nominal one-direction line rates from the standards, and the order of magnitude of one hop's latency as
# collective libraries see it. `--link` names them by key.
PRESETS = {
    "nvlink4": _preset("NVLink 4", 450e9, 1e-6, "H100 SXM: 18 NVLink 4 links, 900 GB/s both directions; ~1 us"),
    "nvlink3": _preset("NVLink 3", 300e9, 1e-6, "A100 SXM4: 12 NVLink 3 links, 600 GB/s both directions; ~1 us"),
    "nvlink2": _preset("NVLink 2", 150e9, 1e-6, "V100 SXM2: 6 NVLink 2 links, 300 GB/s both directions; ~1 us"),
    "pcie4": _preset("PCIe 4 x16", 31.5e9, 2e-6,
                     "PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b coding; ~2 us through the root complex"),
    "ib400": _preset("400 Gb InfiniBand", 50e9, 1.5e-6,
                     "InfiniBand NDR: 400 Gb/s per port; ~1.5 us through one switch"),
    "ib100": _preset("100 Gb InfiniBand", 12.5e9, 1.5e-6,
                     "InfiniBand EDR: 4 lanes x 25 Gb/s per port; ~1.5 us through one switch"),
    "100gbe": _preset("100 GbE", 12.5e9, 5e-6, "IEEE 802.3 100GBASE: 100 Gb/s; ~5 us with RDMA (RoCE)"),
    "25gbe": _preset("25 GbE", 3.125e9, 10e-6, "IEEE 802.3by 25GBASE: 25 Gb/s; ~10 us with RDMA (RoCE)"),
    "10gbe": _preset("10 GbE", 1.25e9, 20e-6, "IEEE 802.3 10GBASE: 10 Gb/s; ~20 us per TCP hop through the kernel"),
}
INTERCONNECTS = tuple(link for key, link in PRESETS.items() if key not in ("nvlink3", "nvlink2"))  # what a run's predictions show
# Links that join GPUs: a prediction on them prices a GPU's step, which a CPU run's or a step timed here is not.
GPU_LINKS = ("nvlink4", "nvlink3", "nvlink2", "pcie4", "ib400", "ib100")
NEEDS_GPU_STEP = "NVLink, PCIe and InfiniBand predictions need a GPU run's step time"

# DDP's own work on a GPU as a share of one process's step, where not measured: fitted to PyTorch's DDP benchmark
# (V100s, NCCL, four torchvision models at 32 images a GPU; docs/scaling.md, "DDP on GPUs"). DDP_GPU_SHARE: one GPU
# under DDP against none (median of 1.4 to 5.6 %); DDP_GPU_MULTI_SHARE: what two or more GPUs add beyond that and
# beyond the all-reduces (median of 2.7 to 5.9 %), which no measurement on one GPU can show.
DDP_GPU_SHARE = 0.028
DDP_GPU_MULTI_SHARE = 0.031


def ring_allreduce_s(nbytes: float, processes: int, link: Interconnect) -> float:
    """Seconds of one ring all-reduce (Thakur et al., 2005): 2(N-1) steps, each sending 2(N-1)/N of the bytes."""
    if processes <= 1:
        return 0.0
    if link.timed and processes == link.timed_processes:
        return between_timed(nbytes, link.timed)
    steps = 2 * (processes - 1)
    return steps * link.latency + steps / processes * nbytes / link.bus_bandwidth


def between_timed(nbytes: float, timed: Sequence[tuple[int, float]]) -> float:
    """Seconds for `nbytes`, straight between the two timed sizes around it; beyond the largest, scaled by the bytes."""
    points = sorted(timed)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    b, t = points[-1]
    return t * nbytes / b


def ddp_buckets(numels: Sequence[int], first_cap: int = MIB, cap: int = 25 * MIB) -> list[int]:
    """fp32 bytes of each DDP bucket: gradients in reverse order, a bucket closes once it reaches its cap (DDP also
    splits by device and dtype)."""
    buckets, current, limit = [], 0, first_cap
    for numel in reversed(numels):
        current += numel * FP32_BYTES
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return buckets + [current] if current else buckets


def powersgd_sizes(shapes: Sequence[Sequence[int]], rank: int) -> tuple[int, int, int]:
    """Elements PowerSGD all-reduces: (uncompressed, all P, all Q), as torch's `powerSGD_hook` splits them. An n x m
    gradient is compressed into P (n x r) and Q (m x r), r = min(n, m, rank), only when 2 (n + m) r < n m."""
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


def bucketed(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1, cap: int = 25 * MIB) -> list[list[int]]:
    """Bytes of each all-reduce one process issues per step under `hook`, bucket by bucket in DDP's launch order.
    PowerSGD: three all-reduces (uncompressed, P, Q) of one bucket, as this project's gloo runs have it."""
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; one of {', '.join(HOOKS)}")
    size = FP32_BYTES if hook in ("none", "powersgd") else HALF_BYTES
    if hook.startswith("powersgd"):
        return [[elements * size for elements in powersgd_sizes(shapes, rank)]]
    return [[b * size // FP32_BYTES] for b in ddp_buckets([math.prod(shape) for shape in shapes], cap=cap)]


def collectives(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1) -> list[int]:
    return [b for bucket in bucketed(shapes, hook, rank) for b in bucket]


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of n standard normal draws]: how far the slowest of n ranks lags the mean, in standard deviations (0.56 for
    2, 3.04 for 512), by numerical integration of n x phi(x) Phi(x)^(n-1)."""
    if n <= 1:
        return 0.0
    step = 20 / 20000
    xs = [-10 + i * step for i in range(20001)]
    ys = [x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) for x in xs]
    return step * (sum(ys) - (ys[0] + ys[-1]) / 2)


@dataclass(frozen=True)
class Terms:
    """What a step costs beyond its share of the compute and the ring's bytes (docs/scaling.md)."""

    overhead: float = 0.0  # s per step that no split of the batch shrinks (loop, optimizer, launches)
    skew: float = 0.0  # standard deviation / mean of one process's step: all-reduces wait for the slowest rank
    overlap: float = 0.0  # share of every bucket's comm but the last (full only when backward ends) hidden by backward
    backward_share: float = BACKWARD_SHARE
    reducer: float = 0.0  # s per step DDP adds besides its hook on N > 1 processes: neither hidden nor shrinking


@dataclass(frozen=True)
class Step:
    """One optimizer step on N processes, in seconds of wall time."""

    compute: float  # the part that shrinks with the per-process batch
    comm: float  # the hook itself plus its all-reduces' transfer
    hidden: float  # the part of comm that runs while the backward pass still computes
    overhead: float = 0.0  # per step, whatever the batch: the loop's and DDP's own work
    skew: float = 0.0  # waiting for the slowest rank: the step's spread and the link's lag

    @property
    def exposed(self) -> float:
        return self.comm - self.hidden

    @property
    def total(self) -> float:
        return self.compute + self.overhead + self.exposed + self.skew


def predict_step(
    compute_1: float, buckets: Sequence[Sequence[int]], encode: float, processes: int, link: Interconnect,
    terms: Terms = Terms(), batch_share: float | None = None,
) -> Step:
    """One step on N processes from one process's step `compute_1` (overhead included), the hook's buckets (bytes) and
    own work `encode`. `batch_share`: each process's batch over the timed one; None: 1/N (strong scaling)."""
    share = 1 / processes if batch_share is None else batch_share
    turns = processes / (processes if link.cores is None else min(processes, link.cores))
    compute = (compute_1 - terms.overhead) * share * turns
    if processes <= 1:
        return Step(compute, 0.0, 0.0, terms.overhead * turns)
    overhead = (terms.overhead + terms.reducer) * turns
    ring = [sum(ring_allreduce_s(b, processes, link) for b in bucket) for bucket in buckets]
    total_bytes = sum(sum(bucket) for bucket in buckets) or 1
    early_bytes = total_bytes - sum(buckets[-1]) if buckets else 0
    encode *= turns
    comm = encode + sum(ring)
    early = sum(ring[:-1]) + encode * early_bytes / total_bytes  # what may overlap: every bucket but the last
    hidden = terms.overlap * min(early, terms.backward_share * compute)
    skew = (terms.skew * expected_max_normal(processes) + link.lag) * (compute + overhead)
    return Step(compute, comm, hidden, overhead, skew)


def epoch_steps(samples: int, global_batch: int) -> int:
    return -(-samples // global_batch)
