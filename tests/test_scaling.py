"""The scaling model (`src.scaling.costmodel`), the gloo probe's fit (`src.scaling.probe`) and `python -m src.scaling`:
formulas against numbers worked out by hand, the byte model against what a real DDP run counted,
the command line on real run folders and on bad input."""

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from src.scaling.costmodel import (
    INTERCONNECTS, Interconnect, collectives, ddp_buckets, encode_s, powersgd_sizes, predict_step, ring_allreduce_s,
)
from src.models.lenet import LeNet
from src.scaling.probe import Probe, fit_ring, measure, save
from src.scaling.predict import COLUMNS, PROCESS_COUNTS, main
from src.strategies.ddp import HOOKS
from tests.helpers import QUICK, call_main, run_cli, scalars, train

LINK = Interconnect("test", bandwidth=1e9, latency=1e-5)
LENET_SHAPES = [tuple(p.shape) for p in LeNet().parameters()]


# ---- the cost model, by hand ----

def test_one_process_sends_nothing_and_keeps_its_compute():
    assert ring_allreduce_s(10**9, 1, LINK) == 0.0
    step = predict_step(0.1, None, 0.5, [10**6, 10**3], encode=0.01, processes=1, link=LINK)
    assert (step.compute, step.comm, step.hidden, step.total) == (0.1, 0.0, 0.0, 0.1)


def test_ring_allreduce_by_hand():
    # N = 4: 2(N-1) = 6 latencies, 2(N-1)/N = 1.5 times the bytes over the link.
    assert ring_allreduce_s(10**6, 4, LINK) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 / 1e9)
    assert ring_allreduce_s(10**6, 2, LINK) == pytest.approx(2 * 1e-5 + 1.0 * 1e6 / 1e9)


def test_doubling_bandwidth_halves_the_bandwidth_term_only():
    fast = Interconnect("fast", bandwidth=2 * LINK.bandwidth, latency=LINK.latency)
    for n in (2, 8, 1024):
        latency_term = 2 * (n - 1) * LINK.latency
        assert ring_allreduce_s(5e7, n, fast) - latency_term == pytest.approx((ring_allreduce_s(5e7, n, LINK) - latency_term) / 2)


def test_step_splits_compute_and_hides_comm_behind_backward():
    link = Interconnect("no latency", bandwidth=1e9, latency=0.0)
    step = predict_step(0.1, 0.06, 0.5, [4 * 10**6], encode=0.002, processes=2, link=link)
    comm = 0.002 + 4e6 / 1e9  # 2(N-1)/N = 1 at N = 2
    assert step.compute == pytest.approx(0.05)
    assert step.comm == pytest.approx(comm)
    assert step.hidden == pytest.approx(0.5 * min(comm, 0.03))  # backward 0.06 s on one process, 0.03 s on two
    assert step.total == pytest.approx(0.05 + comm - 0.5 * min(comm, 0.03))
    # Comm longer than the backward pass: only the backward pass's length can hide.
    slow = predict_step(0.1, 0.06, 1.0, [4 * 10**8], encode=0.0, processes=2, link=link)
    assert slow.hidden == pytest.approx(0.03) and slow.exposed == pytest.approx(0.4 - 0.03)
    # No backward time measured: 2/3 of the step's compute.
    assert predict_step(0.3, None, 1.0, [4 * 10**9], 0.0, 2, link).hidden == pytest.approx(0.1)


def test_processes_beyond_the_cores_share_them():
    shared = Interconnect("here", bandwidth=1e9, latency=0.0, cores=2)
    assert predict_step(0.1, None, 0.0, [], 0.0, 2, shared).compute == pytest.approx(0.05)
    assert predict_step(0.1, None, 0.0, [], 0.0, 4, shared).compute == pytest.approx(0.05)
    assert predict_step(0.1, None, 0.0, [], 0.0, 4, LINK).compute == pytest.approx(0.025)


def test_byte_model_by_hand():
    # 10 x 100 is worth compressing at rank 1 (2 (10 + 100) < 1000); 4 x 4 (16 < 16) and the bias are not.
    shapes = [(10, 100), (4, 4), (10,)]
    assert powersgd_sizes(shapes, 1) == (16 + 10, 10, 100)
    assert powersgd_sizes(shapes, 2) == (16 + 10, 20, 200)
    assert collectives(shapes, "none") == [4 * 1026]
    assert collectives(shapes, "fp16") == collectives(shapes, "bf16") == [2 * 1026]
    assert collectives(shapes, "powersgd") == [4 * 26, 4 * 10, 4 * 100]
    assert collectives(shapes, "powersgd_fp16") == [2 * 26, 2 * 10, 2 * 100]
    with pytest.raises(ValueError, match="int8"):
        collectives(shapes, "int8")


def test_ddp_buckets_first_one_small_then_the_cap():
    assert ddp_buckets([300_000, 10]) == [1_200_040]  # one bucket: never reaches 1 MiB
    big = 7 * 2**20  # 28 MiB of fp32 per tensor
    assert ddp_buckets([big, big, big]) == [4 * big] * 3  # the first closes at 1 MiB, each next at 25 MiB
    assert ddp_buckets([2**16] * 8) == [2**20, 2**20]  # 256 KiB each: exactly 1 MiB closes the first, the rest trails


def test_hook_arithmetic_is_timed_and_grows_with_the_work():
    small, large = [(10, 10)], [(1000, 1000)]
    for hook in HOOKS:
        assert 0 < encode_s(small, hook) < encode_s(large, hook), hook
    assert torch.get_num_threads() >= 1  # restored after the one-thread measurement


# ---- the probe's fit ----

def synthetic_points(latency: float, bandwidth: float, noise: float = 0.0) -> list[tuple[int, int, float]]:
    generator = torch.Generator().manual_seed(0)
    link = Interconnect("truth", bandwidth, latency)
    return [(n, b, ring_allreduce_s(b, n, link) * (1 + noise * float(torch.randn(1, generator=generator))))
            for n in (2, 4) for b in (4, 64, 1024, 16384, 2**18, 2**20, 2**22, 2**25)]


@pytest.mark.parametrize("latency, bandwidth", [(50e-6, 1e9), (2e-6, 3e10), (1e-3, 1e8)])
def test_fit_recovers_latency_and_bandwidth(latency, bandwidth):
    assert fit_ring(synthetic_points(latency, bandwidth)) == (pytest.approx(latency, rel=1e-6), pytest.approx(bandwidth, rel=1e-6))
    noisy = fit_ring(synthetic_points(latency, bandwidth, noise=0.05))
    assert noisy == (pytest.approx(latency, rel=0.15), pytest.approx(bandwidth, rel=0.15))


def test_fit_never_returns_a_negative_latency():
    # Small sizes twice as fast per byte as large ones: the free fit's latency would be below zero.
    points = [(2, b, b / 1e9 * (0.5 if b < 2**20 else 1.0)) for b in (1024, 16384, 2**18, 2**20, 2**22, 2**25)]
    latency, bandwidth = fit_ring(points)
    assert latency == 0.0 and 1e9 < bandwidth < 2e9  # between the two slopes


def test_probe_fits_each_process_count_on_its_own():
    probe = Probe(synthetic_points(5e-5, 1e9)[:8] + synthetic_points(1e-3, 2e8)[8:], cores=2)
    fits = probe.fits()
    assert fits[2] == (pytest.approx(5e-5), pytest.approx(1e9))
    assert fits[4] == (pytest.approx(1e-3), pytest.approx(2e8))


@pytest.mark.slow
def test_probe_times_real_gloo_all_reduces():
    points = measure(2, sizes=[4, 8 * 2**20])
    assert [(n, b) for n, b, _ in points] == [(2, 4), (2, 8 * 2**20)]
    (_, _, small), (_, _, large) = points
    assert 0 < small < large < 10


# ---- real runs: the byte model against the counted bytes; the command line ----

@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_root) -> Path:
    """A one-process LeNet run and a 2-process PowerSGD run (2 plain all-reduce steps, then 2 compressed)."""
    root = tmp_path_factory.mktemp("runs")
    quick = [*QUICK, "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1"]
    result = train(*quick, f"hydra.run.dir={root / 'one'}")
    assert result.returncode == 0, result.stderr[-3000:]
    result = train(*quick, "strategy=ddp_powersgd", "devices=2", "strategy.start_powersgd_iter=2", f"hydra.run.dir={root / 'two'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.slow
def test_byte_model_matches_what_a_real_ddp_run_counted(runs):
    sent = scalars(runs / "two")["comm/bytes_per_step"]
    assert len(sent) >= 3
    assert max(sent) == sum(collectives(LENET_SHAPES, "none"))  # the warm-up steps: plain fp32 all-reduce
    assert min(sent) == sum(collectives(LENET_SHAPES, "powersgd"))  # then P, Q and the uncompressed tensors
    assert max(sent) == 4 * sum(math.prod(s) for s in LENET_SHAPES)


def write_probe(path: Path) -> Path:
    save(Probe(synthetic_points(1e-4, 1e9)[:8], cores=2), path)
    return path


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert rows and list(rows[0]) == list(COLUMNS)
    return rows


@pytest.mark.slow
def test_cli_writes_table_plot_and_checks_for_real_runs(runs, tmp_path):
    out = tmp_path / "out"
    result = run_cli("src.scaling", str(runs), "--out", str(out), "--probe-file", str(write_probe(tmp_path / "probe.json")))
    assert result.returncode == 0, result.stderr
    rows = read_rows(out / "scaling.csv")
    links = {link.name for link in INTERCONNECTS} | {"gloo here, 2 proc. fit"}
    counts = [n for n in PROCESS_COUNTS if 256 % n == 0]  # QUICK keeps the global batch of 256
    assert {(r["interconnect"], r["hook"], int(r["processes"])) for r in rows} == {
        (link, hook, n) for link in links for hook in HOOKS for n in counts}
    assert len(rows) == len(links) * len(HOOKS) * len(counts)

    by_key = {(r["interconnect"], r["hook"], int(r["processes"])): r for r in rows}
    one_step_ms = float(by_key["10 GbE", "none", 1]["compute_ms"])
    for link in links - {"gloo here, 2 proc. fit"}:
        assert float(by_key[link, "none", 1]["speedup"]) == 1.0
        assert float(by_key[link, "fp16", 8]["compute_ms"]) == pytest.approx(one_step_ms / 8)
    # The measured interconnect shares 2 cores: 4 processes compute no faster than 2.
    assert float(by_key["gloo here, 2 proc. fit", "none", 4]["compute_ms"]) == pytest.approx(one_step_ms / 2)
    assert int(by_key["NVLink 4", "none", 2]["bytes_per_step"]) == 4 * sum(math.prod(s) for s in LENET_SHAPES)
    assert int(by_key["NVLink 4", "bf16", 2]["bytes_per_step"]) == 2 * sum(math.prod(s) for s in LENET_SHAPES)
    # The one-process run is the baseline; the DDP run is checked against its prediction.
    logged = scalars(runs / "one")["time/epoch_s"]
    assert float(by_key["NVLink 4", "none", 1]["epoch_s"]) == pytest.approx(logged[0], rel=1e-6)
    markdown = (out / "scaling.md").read_text()
    assert "From `one` (1 process," in markdown
    [check] = [line for line in markdown.splitlines() if line.startswith("| two |")]
    cells = [c.strip() for c in check.strip("|").split("|")]
    assert cells[1:4] == ["powersgd", "2", "gloo here, 2 proc. fit"] and cells[4] == cells[5]  # bytes: predicted = counted
    height, width, _ = imread(out / "scaling_lenet.png").shape
    assert height > 200 and width > 200
    assert not (runs / "scaling.md").exists()


@pytest.mark.slow
def test_report_includes_the_scaling_table(runs, tmp_path):
    result = run_cli("src.report", str(runs), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert "# Predicted scaling" in report and "| NVLink 4 | powersgd |" in report and "](scaling_lenet.png)" in report
    assert (tmp_path / "report" / "scaling_lenet.png").is_file() and (tmp_path / "report" / "scaling.csv").is_file()


# ---- bad input: one line, exit status 2, nothing written ----

def assert_one_error_line(result, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(word in lines[0] for word in words), lines[0]


def test_missing_folder_and_no_argument(tmp_path):
    assert_one_error_line(call_main(main, str(tmp_path / "nowhere")), "nowhere", "no such folder")
    assert_one_error_line(call_main(main), "--probe")
    assert not (tmp_path / "nowhere").exists()


def test_folder_without_runs_writes_nothing(tmp_path):
    (tmp_path / "config_only" / ".hydra").mkdir(parents=True)
    (tmp_path / "config_only" / ".hydra" / "config.yaml").write_text("devices: 1\n")
    assert_one_error_line(call_main(main, str(tmp_path)), "no run folders")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config_only"]


def test_bad_options_name_what_is_allowed(tmp_path):
    assert_one_error_line(call_main(main, str(tmp_path), "--overlap", "2"), "--overlap", "between 0 and 1")
    assert_one_error_line(call_main(main, str(tmp_path), "--probe-file", str(tmp_path / "none.json")), "--probe-file")
    (tmp_path / "bad.json").write_text(json.dumps({"cores": 2}))
    assert_one_error_line(call_main(main, str(tmp_path), "--probe-file", str(tmp_path / "bad.json")), "--probe-file", "not a probe")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]
