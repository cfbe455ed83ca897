"""The "measured" interconnect: time gloo all-reduces between local processes and fit the ring model to them.

    python -m src.scaling --probe            # 2 and 4 processes, 4 B to 32 MiB, about 20 s on 2 cores

Each size is all-reduced a few times back to back after a barrier, and rank 0 keeps the median.
The fit is least squares on t = 2(N-1) latency + 2(N-1)/N bytes / bandwidth (`costmodel.ring_allreduce_s`),
weighted by 1/t so that the microsecond points count as much as the millisecond ones. Each process
count gets a fit of its own: with more processes than cores, a ring step waits for a process the
scheduler has put aside, which no latency fitted on fewer processes foresees.
Only torch is imported here: every probe process imports this module again.
"""

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = tuple(4 * 16**k for k in range(5)) + (2**20, 4 * 2**20, 16 * 2**20, 32 * 2**20)  # 4 B, 64 B, ... 32 MiB
PROCESSES = (2, 4)


@dataclass(frozen=True)
class Probe:
    """The timed all-reduces, (processes, bytes, seconds), on a machine with `cores` cores."""

    points: list[tuple[int, int, float]]
    cores: int

    def fits(self) -> dict[int, tuple[float, float]]:
        """(latency s, bandwidth bytes/s) fitted to each process count's points."""
        counts = sorted({n for n, _, _ in self.points})
        return {n: fit_ring([p for p in self.points if p[0] == n]) for n in counts}


def fit_ring(points: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the ring model that best fits the points, in relative error."""
    rows = torch.tensor([[2.0 * (n - 1), 2.0 * (n - 1) / n * b] for n, b, _ in points], dtype=torch.float64)
    times = torch.tensor([t for _, _, t in points], dtype=torch.float64)
    weights = 1 / times
    latency, per_byte = torch.linalg.lstsq(rows * weights[:, None], (times * weights)[:, None]).solution.flatten().tolist()
    if latency < 0:  # noise can push it below zero: then the bandwidth term alone
        latency = 0.0
        column = rows[:, 1] * weights
        per_byte = float(column @ (times * weights) / (column @ column))
    return latency, 1 / per_byte


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _repeats(nbytes: int) -> int:
    return 20 if nbytes <= 2**18 else 5


def _worker(rank: int, processes: int, port: int, sizes: Sequence[int], result: str) -> None:
    """One probe process: time every size, rank 0 writes (bytes, median seconds) to `result`."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=processes)
    timings = []
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        dist.all_reduce(tensor)  # warm-up: connections and buffers
        seconds = []
        for _ in range(_repeats(nbytes)):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            seconds.append(time.perf_counter() - start)
        timings.append((nbytes, statistics.median(seconds)))
    dist.barrier()
    if rank == 0:
        Path(result).write_text(json.dumps(timings))
    dist.destroy_process_group()


def measure(processes: int, sizes: Sequence[int] = SIZES) -> list[tuple[int, int, float]]:
    """(processes, bytes, median seconds) of a gloo all-reduce for each size, between local processes."""
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "timings.json")
        mp.spawn(_worker, args=(processes, _free_port(), list(sizes), result), nprocs=processes)
        return [(processes, int(b), float(t)) for b, t in json.loads(Path(result).read_text())]


def run_probe(processes: Sequence[int] = PROCESSES, sizes: Sequence[int] = SIZES) -> Probe:
    return Probe([point for n in processes for point in measure(n, sizes)], len(os.sched_getaffinity(0)))


def save(probe: Probe, path: Path) -> None:
    fits = {n: {"latency_s": lat, "bandwidth_bytes_per_s": bw} for n, (lat, bw) in probe.fits().items()}
    path.write_text(json.dumps({"cores": probe.cores, "fits": fits, "points": probe.points}, indent=1))


def load(path: Path) -> Probe:
    """A probe saved by `save`; ValueError when the file is not one."""
    try:
        data = json.loads(path.read_text())
        points = [(int(n), int(b), float(t)) for n, b, t in data["points"]]
        return Probe(points, int(data["cores"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a probe result ({type(error).__name__}: {error})") from error
