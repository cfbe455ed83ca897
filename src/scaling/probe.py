"""The "measured" interconnect: gloo all-reduces timed between local processes (new interpreters, spawn), the ring
model fitted to them per process count, and the lag of processes meeting on shared cores (docs/scaling.md)."""

import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from src.folders import read_bytes, write_file
from src.records import LIMIT

SIZES = tuple(4 * 16**k for k in range(5)) + (2**20, 4 * 2**20, 16 * 2**20, 32 * 2**20)  # 4 B, 64 B, ... 32 MiB
PROCESSES = (2, 4)
MEETING_WORK_S = 0.05  # the work each process does before a meeting: of the order of a small model's step
MEETINGS = 30


@dataclass(frozen=True)
class Probe:
    points: list[tuple[int, int, float]]  # (processes, bytes, seconds)
    cores: int
    lags: dict[int, float] = field(default_factory=dict)  # processes -> time lost meeting, a share of the work's turns

    def timed(self, processes: int) -> tuple[tuple[int, float], ...]:
        return tuple((b, t) for n, b, t in self.points if n == processes)

    def fits(self) -> dict[int, tuple[float, float]]:
        """(latency s, bandwidth bytes/s) per process count."""
        counts = sorted({n for n, _, _ in self.points})
        return {n: fit_ring([p for p in self.points if p[0] == n]) for n in counts}


def fit_ring(points: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
    """Least squares on t = 2(N-1) latency + 2(N-1)/N bytes / bandwidth, weighted by 1/t so that microsecond points
    count as much as millisecond ones."""
    rows = torch.tensor([[2.0 * (n - 1), 2.0 * (n - 1) / n * b] for n, b, _ in points], dtype=torch.float64)
    times = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    weights = 1 / times
    latency, per_byte = torch.linalg.lstsq(rows * weights[:, None], (times * weights)[:, None]).solution.flatten().tolist()
    if latency < 0:  # noise can push it below zero: then the bandwidth term alone
        latency = 0.0
        column = rows[:, 1] * weights
        per_byte = float(column @ (times * weights) / (column @ column))
    return latency, 1 / per_byte


@contextmanager
def one_thread() -> Iterator[None]:
    """One torch thread, as each of 2 DDP processes gets on 2 cores, and steadier on a busy machine; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def median_s(work: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of `work` on one thread, after a warm-up call (allocation, first-call dispatch)."""
    with one_thread():
        work()
        return statistics.median(timeit.repeat(work, number=1, repeat=repeats))


def _work(count: int) -> None:
    a, b = torch.ones(128, 128), torch.empty(128, 128)
    for _ in range(count):
        torch.mm(a, a, out=b)


def _work_count() -> tuple[int, float]:
    """Matrix products that take about MEETING_WORK_S on one thread here, and the seconds they take alone."""
    count = max(1, round(MEETING_WORK_S / (median_s(lambda: _work(200), repeats=1) / 200)))
    return count, median_s(lambda: _work(count), repeats=5)


def _worker(rank: int, processes: int, sizes: Sequence[int], work: int) -> dict[str, Any]:
    """One probe process: time every size, then the meetings (equal work, then a 4-byte all-reduce: the lag that
    all-reduces started after a barrier do not show)."""
    timings = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        dist.all_reduce(tensor)  # warm-up: connections and buffers
        seconds = []
        for _ in range(20 if nbytes <= 2**18 else 5):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - start)
        timings.append((nbytes, statistics.median(seconds)))
    small, meetings = torch.ones(1), []
    for _ in range(MEETINGS):
        dist.barrier()
        start = time.perf_counter()
        _work(work)
        dist.all_reduce(small)
        meetings.append(time.perf_counter() - start)
    dist.barrier()
    return {"timings": timings, "meeting_s": statistics.median(meetings)}


def start_ranks(work: Callable[..., Any], processes: int, *args: Any, device: str = "cpu") -> Any:
    """`work(rank, processes, *args)` in new local processes (spawn) of one torch thread, in a group of their own
    (cuda: NCCL, else gloo); what rank 0's returns, through JSON. A rank that fails ends them all and raises here."""
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.start_processes(_rank, (work, processes, folder, device, args), processes,
                                              start_method="spawn")
        return json.loads((Path(folder) / "result.json").read_text())


def _rank(rank: int, work: Callable[..., Any], processes: int, folder: str, device: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # as on CPU everywhere here; a GPU's step does not depend on it
    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=processes, device_id=torch.device("cuda", rank) if cuda else None)
    try:
        value = work(rank, processes, *args)
        if rank == 0:
            (Path(folder) / "result.json").write_text(json.dumps(value))
    finally:
        dist.destroy_process_group()
    # Done, and nothing left to save: an exit past the interpreter's shutdown, where a thread of the DDP model's
    # process group could be joined by itself ("Resource deadlock avoided") and abort a rank whose figures are in.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def lag_share(alone: float, together: float, processes: int, cores: int) -> float:
    """Seconds a step of `processes` together takes beyond their turns on `cores` cores, as a share of those turns."""
    turns = processes / min(processes, cores)
    return max(0.0, together / (turns * alone) - 1)


def measure(processes: int, cores: int, sizes: Sequence[int] = SIZES) -> tuple[list[tuple[int, int, float]], float]:
    """(processes, bytes, median seconds) of a gloo all-reduce for each size, and the meeting's lag beyond the
    work's turns and the smallest all-reduce (`lag_share`)."""
    count, alone = _work_count()
    data = start_ranks(_worker, processes, list(sizes), count)
    points = [(processes, int(b), float(t)) for b, t in data["timings"]]
    smallest = min(points, key=lambda p: p[1])[2]
    return points, lag_share(alone, data["meeting_s"] - smallest, processes, cores)


def run_probe(processes: Sequence[int] = PROCESSES, sizes: Sequence[int] = SIZES) -> Probe:
    cores = len(os.sched_getaffinity(0))
    measured = {n: measure(n, cores, sizes) for n in processes}
    return Probe([point for points, _ in measured.values() for point in points], cores,
                 {n: lag for n, (_, lag) in measured.items()})


def save(probe: Probe, path: Path) -> None:
    fits = {n: {"latency_s": lat, "bandwidth_bytes_per_s": bw} for n, (lat, bw) in probe.fits().items()}
    write_file(path, json.dumps({"cores": probe.cores, "fits": fits, "lag_shares": probe.lags, "points": probe.points},
                                indent=1))


def load(path: Path) -> Probe:
    try:
        data = json.loads(read_bytes(path, LIMIT))
        points = [(int(n), int(b), float(t)) for n, b, t in data["points"]]
        lags = {int(n): float(s) for n, s in data.get("lag_shares", {}).items()}  # a probe saved before lags were timed: none
        return Probe(points, int(data["cores"]), lags)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a probe result ({type(error).__name__}: {error})") from error
