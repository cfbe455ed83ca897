"""How long gradient averaging takes on N processes: bytes per hook, ring all-reduce time, epoch time.

The model behind `python -m src.scaling` (docs/scaling.md), kept free of file reading so that
every formula can be checked by hand:

- bytes: what one process hands to all-reduce per optimizer step under each DDP hook, the same
  payload `xfer/bytes_per_step` counts (`collectives`), bucket by bucket (`bucketed`);
- time of one ring all-reduce of b bytes over N processes (Thakur et al., 2005): 2(N-1) steps of
  latency plus 2(N-1)/N x b / (bus share x bandwidth) (`ring_allreduce_s`);
- a step (`predict_step`): each process computes its share of the batch (strong scaling: the
  global batch is split; weak scaling: each process keeps its own batch), plus the terms of
  `Terms`: a per-step overhead that does not shrink with N, the last bucket's all-reduce, which
  cannot overlap with the backward pass, and the wait for the slowest rank (skew).
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


# Plain numbers, no torch: `python -m src.scaling --help` and its mistakes are answered without importing it.
FP32_BYTES, HALF_BYTES = 4, 2  # bf16 is 2 bytes too
MIB = 2**20
# The DDP hooks the model prices: those `src.strategies.ddp` builds (a test holds the two lists equal).
HOOKS = ("none", "fp16", "bf16", "powersgd", "powersgd_fp16")
BACKWARD_SHARE = 2 / 3  # backward ~ twice the forward pass: the share used when a run did not time its backward pass


@dataclass(frozen=True)
class Interconnect:
    """A link between neighbouring processes of the ring.

    `bus_share`: the share of `bandwidth` a ring all-reduce really reaches (nccl-tests' bus
    bandwidth over the line rate); 1 for a fit to measured all-reduces, which already holds it.
    `cores`: the processes share this many CPU cores (the machine the runs were measured on), so
    compute per step stops shrinking beyond that many processes; None: one device per process.
    `timed`: all-reduces timed on this link at `timed_processes` processes, (bytes, seconds); at that
    count they are read between the timed sizes instead of the ring formula, which a transport that
    changes its algorithm with the size (gloo: 0.6 ms at 256 KiB, 3.9 ms at 1 MiB) does not follow.
    `lag`: the time processes lose meeting at the all-reduce after equal work on shared cores (one is
    descheduled while the others wait), as a share of their compute and overhead; measured by the probe.
    """

    name: str
    bandwidth: float  # bytes/s, one direction, nominal
    latency: float  # s, per ring step
    source: str = ""
    cores: int | None = None
    bus_share: float = 1.0
    timed: tuple[tuple[int, float], ...] = ()
    timed_processes: int = 0
    lag: float = 0.0

    @property
    def bus_bandwidth(self) -> float:
        """Bytes/s an all-reduce's ring steps really move: the line rate times `bus_share`."""
        return self.bandwidth * self.bus_share


# Assumed, not measured: what an all-reduce reaches of a named link's line rate. nccl-tests
# defines bus bandwidth as algorithm bandwidth x 2(N-1)/N, comparable with the line rate
# (NVIDIA/nccl-tests, doc/PERFORMANCE.md); well-tuned collectives reach some 70-90 % of it.
PRESET_BUS_SHARE = 0.8

# Nominal one-direction line rates from the standards, and the order of magnitude of one hop's
# latency as collective libraries see it. `--link` names them by key.
PRESETS = {
    "nvlink4": Interconnect("NVLink 4", 450e9, 1e-6, "H100 SXM: 18 NVLink 4 links, 900 GB/s both directions; ~1 us",
                            bus_share=PRESET_BUS_SHARE),
    "nvlink3": Interconnect("NVLink 3", 300e9, 1e-6, "A100 SXM4: 12 NVLink 3 links, 600 GB/s both directions; ~1 us",
                            bus_share=PRESET_BUS_SHARE),
    "nvlink2": Interconnect("NVLink 2", 150e9, 1e-6, "V100 SXM2: 6 NVLink 2 links, 300 GB/s both directions; ~1 us",
                            bus_share=PRESET_BUS_SHARE),
    "pcie4": Interconnect("PCIe 4 x16", 31.5e9, 2e-6, "PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b coding; ~2 us through the root complex",
                          bus_share=PRESET_BUS_SHARE),
    "ib400": Interconnect("400 Gb InfiniBand", 50e9, 1.5e-6, "InfiniBand NDR: 400 Gb/s per port; ~1.5 us through one switch",
                          bus_share=PRESET_BUS_SHARE),
    "ib100": Interconnect("100 Gb InfiniBand", 12.5e9, 1.5e-6, "InfiniBand EDR: 4 lanes x 25 Gb/s per port; ~1.5 us through one switch",
                          bus_share=PRESET_BUS_SHARE),
    "100gbe": Interconnect("100 GbE", 12.5e9, 5e-6, "IEEE 802.3 100GBASE: 100 Gb/s; ~5 us with RDMA (RoCE)", bus_share=PRESET_BUS_SHARE),
    "25gbe": Interconnect("25 GbE", 3.125e9, 10e-6, "IEEE 802.3by 25GBASE: 25 Gb/s; ~10 us with RDMA (RoCE)", bus_share=PRESET_BUS_SHARE),
    "10gbe": Interconnect("10 GbE", 1.25e9, 20e-6, "IEEE 802.3 10GBASE: 10 Gb/s; ~20 us per TCP hop through the kernel",
                          bus_share=PRESET_BUS_SHARE),
}
INTERCONNECTS = tuple(link for key, link in PRESETS.items() if key not in ("nvlink3", "nvlink2"))  # what a run's predictions show

# DDP's own work on a GPU, as a share of one process's step, where it was not measured: fitted to PyTorch's
# DDP benchmark (benchmarks/distributed/ddp/README.md in pytorch/pytorch: V100s, NCCL, four torchvision models
# at 32 images a GPU; docs/scaling.md, "DDP on GPUs"). DDP_GPU_SHARE: one GPU under DDP against the same GPU
# without it (the median over the models of 1.4 to 5.6 %): the copies into buckets and back, the hook, the
# reducer's bookkeeping and the all-reduce call, what a DDP model of world size 1 shows against the plain one.
# DDP_GPU_MULTI_SHARE: what two or more GPUs add beyond that and beyond the all-reduces' own time (the
# median of 2.7 to 5.9 %), which no measurement on one GPU can show.
DDP_GPU_SHARE = 0.028
DDP_GPU_MULTI_SHARE = 0.031


def ring_allreduce_s(nbytes: float, processes: int, link: Interconnect) -> float:
    """Seconds of one ring all-reduce: reduce-scatter then all-gather, 2(N-1) steps of b/N bytes each.

    Each process sends 2(N-1)/N of the bytes, at the link's bus bandwidth.
    """
    if processes <= 1:
        return 0.0
    if link.timed and processes == link.timed_processes:
        return between_timed(nbytes, link.timed)
    steps = 2 * (processes - 1)
    return steps * link.latency + steps / processes * nbytes / link.bus_bandwidth


def between_timed(nbytes: float, timed: Sequence[tuple[int, float]]) -> float:
    """Seconds for `nbytes`, straight between the two timed sizes around it; beyond the largest, that
    size's time scaled by the bytes; below the smallest, the smallest's time."""
    points = sorted(timed)
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1:
            return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    b, t = points[-1]
    return t * nbytes / b


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


def bucketed(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1, cap: int = 25 * MIB) -> list[list[int]]:
    """Bytes of each all-reduce one process issues per optimizer step under `hook`, bucket by bucket,
    in the order DDP launches them: the last bucket holds the first layers, ready only when the
    backward pass ends. `cap`: DDP's `bucket_cap_mb` in bytes (the first bucket stays 1 MiB).

    none: every bucket as fp32; fp16/bf16: the same buckets at 2 bytes per element; powersgd:
    three all-reduces (uncompressed tensors, all P, all Q) of one bucket, as this project's gloo
    runs have it (PowerSGD's warm-up steps send what `none` sends); powersgd_fp16: the same at 2 bytes.
    """
    numels = [math.prod(shape) for shape in shapes]
    if hook == "none":
        return [[b] for b in ddp_buckets(numels, cap=cap)]
    if hook in ("fp16", "bf16"):
        return [[b * HALF_BYTES // FP32_BYTES] for b in ddp_buckets(numels, cap=cap)]
    if hook in ("powersgd", "powersgd_fp16"):
        size = FP32_BYTES if hook == "powersgd" else HALF_BYTES
        return [[elements * size for elements in powersgd_sizes(shapes, rank)]]
    raise ValueError(f"unknown hook {hook!r}; one of {', '.join(HOOKS)}")


def collectives(shapes: Sequence[Sequence[int]], hook: str, rank: int = 1) -> list[int]:
    """Bytes of each all-reduce one process issues per optimizer step under `hook` (`bucketed`, flat)."""
    return [b for bucket in bucketed(shapes, hook, rank) for b in bucket]


@functools.cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal draws]: how far the slowest of n ranks lags the mean, in standard deviations.

    0 for one rank, 0.56 for 2, 1.03 for 4, 3.04 for 512; by numerical integration of n x phi(x) Phi(x)^(n-1).
    """
    if n <= 1:
        return 0.0
    step = 20 / 20000
    xs = [-10 + i * step for i in range(20001)]
    ys = [x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) for x in xs]
    return step * (sum(ys) - (ys[0] + ys[-1]) / 2)


@dataclass(frozen=True)
class Terms:
    """What a step costs beyond its share of the compute and the ring's bytes; docs/scaling.md says where each comes from.

    overhead: seconds per step that do not shrink with more processes (the training loop, the
    optimizer's per-tensor work, kernel launches), part of one process's measured step;
    skew: spread of one process's step time (standard deviation / mean); every all-reduce waits
    for the slowest of N ranks, expected_max_normal(N) standard deviations behind the mean;
    overlap: the share of the communication of every bucket but the last that runs while the
    backward pass still computes (DDP launches a bucket's all-reduce as soon as it is full; the
    last bucket is full only when the backward pass ends, so it never overlaps);
    backward_share: the backward pass's share of the step's compute;
    reducer: seconds per step DDP adds to each of N > 1 processes besides its hook (copying the
    gradients into its buckets and the averaged ones back): the process's own work, so it neither
    hides behind the backward pass nor shrinks with the batch.
    """

    overhead: float = 0.0
    skew: float = 0.0
    overlap: float = 0.0
    backward_share: float = BACKWARD_SHARE
    reducer: float = 0.0


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


def parallel_share(processes: int, link: Interconnect) -> int:
    """By how much N processes divide the compute: N devices, or no more than the shared cores."""
    return processes if link.cores is None else min(processes, link.cores)


def predict_step(
    compute_1: float, buckets: Sequence[Sequence[int]], encode: float, processes: int, link: Interconnect,
    terms: Terms = Terms(), batch_share: float | None = None,
) -> Step:
    """One step on N processes from one process's step time `compute_1` (s, overhead included) and the hook's buckets (bytes).

    `batch_share`: each process's batch over the batch `compute_1` was timed at; None: 1/N, strong
    scaling (the global batch split over the processes); weak scaling keeps it fixed. Processes
    beyond the cores they share take turns: each core runs N / min(N, cores) of them one after the other.
    `encode`: seconds per step of the hook's own work on one process, its all-reduces' transfer aside.
    """
    share = 1 / processes if batch_share is None else batch_share
    turns = processes / parallel_share(processes, link)
    compute = (compute_1 - terms.overhead) * share * turns
    if processes <= 1:
        return Step(compute, 0.0, 0.0, terms.overhead * turns)
    overhead = (terms.overhead + terms.reducer) * turns
    ring = [sum(ring_allreduce_s(b, processes, link) for b in bucket) for bucket in buckets]
    total_bytes = sum(sum(bucket) for bucket in buckets) or 1
    early_bytes = total_bytes - sum(buckets[-1]) if buckets else 0
    encode *= turns  # the hook's own work, like the compute, takes turns on shared cores
    comm = encode + sum(ring)
    early = sum(ring[:-1]) + encode * early_bytes / total_bytes  # what may overlap: every bucket but the last
    hidden = terms.overlap * min(early, terms.backward_share * compute)
    skew = (terms.skew * expected_max_normal(processes) + link.lag) * (compute + overhead)
    return Step(compute, comm, hidden, overhead, skew)


def epoch_steps(samples: int, global_batch: int) -> int:
    """Optimizer steps in an epoch of `samples` at `global_batch` (the last, partial batch counts)."""
    return -(-samples // global_batch)
