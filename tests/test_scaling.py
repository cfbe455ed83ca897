"""The scaling model (`src.scaling.costmodel`), the gloo probe's fit (`src.scaling.probe`) and `python -m src.scaling`:
formulas against numbers worked out by hand, the byte model against what a real DDP run counted,
the command line on real run folders and on bad input."""

import csv
import dataclasses
import json
import math
import shlex
import shutil
import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from matplotlib.image import imread

from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summary

from src.scaling import costmodel
from src.scaling.costmodel import (
    DDP_GPU_MULTI_SHARE, DDP_GPU_SHARE, INTERCONNECTS, NEEDS_GPU_STEP, PRESETS, Interconnect, Terms, bucketed, collectives, ddp_buckets, expected_max_normal,
    between_timed, powersgd_sizes, predict_step, ring_allreduce_s,
)
from src.models.lenet import LeNet
from src.scaling.probe import Probe, fit_ring, lag_share, load, measure, save
from src.scaling.predict import (
    COLUMNS, CPU_LINKS, PROCESS_COUNTS, Baseline, Options, RunFigures, link_for, main, merge_repeats, predictions,
    time_baseline,
)
from src.scaling.timed import Timed, encode_s
from src.report import main as report_main
from src.report import write_report
from src.scaling import probe as probe_module
from src.scaling import stepclock
from src.scaling import timed as timing
from src.scaling.stepclock import overhead_share
from src.strategies import ddp
from src.strategies.ddp import HOOKS
from tests.helpers import QUICK, REPO, call_main, run_cli, scalars, train_here
from tests.probes import HOOK_NOTES, HOOK_SLEEP_S

LINK = Interconnect("test", bandwidth=1e9, latency=1e-5)
LENET_SHAPES = [tuple(p.shape) for p in LeNet().parameters()]


# ---- the cost model, by hand ----

def test_one_process_sends_nothing_and_keeps_its_compute():
    assert ring_allreduce_s(10**9, 1, LINK) == 0.0
    step = predict_step(0.1, [[10**6], [10**3]], 0.01, 1, LINK, Terms(overhead=0.02, skew=0.5, overlap=0.5))
    assert (step.compute, step.overhead, step.comm, step.hidden, step.skew) == (pytest.approx(0.08), 0.02, 0.0, 0.0, 0.0)
    assert step.total == pytest.approx(0.1)


def test_ring_allreduce_by_hand():
    # N = 4: 2(N-1) = 6 latencies, 2(N-1)/N = 1.5 times the bytes over the link.
    assert ring_allreduce_s(10**6, 4, LINK) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 / 1e9)
    assert ring_allreduce_s(10**6, 2, LINK) == pytest.approx(2 * 1e-5 + 1.0 * 1e6 / 1e9)
    # An all-reduce that reaches half the line rate takes twice as long for its bytes.
    half = Interconnect("half", bandwidth=1e9, latency=1e-5, bus_share=0.5)
    assert ring_allreduce_s(10**6, 4, half) == pytest.approx(6 * 1e-5 + 1.5 * 1e6 / 0.5e9)


def test_doubling_bandwidth_halves_the_bandwidth_term_only():
    fast = Interconnect("fast", bandwidth=2 * LINK.bandwidth, latency=LINK.latency)
    for n in (2, 8, 1024):
        latency_term = 2 * (n - 1) * LINK.latency
        assert ring_allreduce_s(5e7, n, fast) - latency_term == pytest.approx((ring_allreduce_s(5e7, n, LINK) - latency_term) / 2)


NO_LATENCY = Interconnect("no latency", bandwidth=1e9, latency=0.0)


def test_every_bucket_but_the_last_hides_behind_backward():
    # Two buckets of 4 MB and 1 MB: at N = 2 each takes bytes / bandwidth; only the first may hide.
    step = predict_step(0.1, [[4 * 10**6], [10**6]], 0.0, 2, NO_LATENCY, Terms(overlap=1.0, backward_share=0.6))
    assert step.compute == pytest.approx(0.05) and step.comm == pytest.approx(0.005)
    assert step.hidden == pytest.approx(0.004) and step.exposed == pytest.approx(0.001)
    # Half the overlap hides half of it; one bucket hides nothing.
    assert predict_step(0.1, [[4 * 10**6], [10**6]], 0.0, 2, NO_LATENCY, Terms(overlap=0.5)).hidden == pytest.approx(0.002)
    assert predict_step(0.1, [[5 * 10**6]], 0.0, 2, NO_LATENCY, Terms(overlap=1.0)).hidden == 0.0
    # Comm longer than the backward pass: only the backward pass's length can hide (0.6 x 0.05 s).
    slow = predict_step(0.1, [[4 * 10**8], [10**6]], 0.0, 2, NO_LATENCY, Terms(overlap=1.0, backward_share=0.6))
    assert slow.hidden == pytest.approx(0.03) and slow.exposed == pytest.approx(0.401 - 0.03)
    # The hook's arithmetic hides in proportion to the bytes of the buckets that may hide.
    coded = predict_step(0.1, [[4 * 10**6], [10**6]], 0.01, 2, NO_LATENCY, Terms(overlap=1.0))
    assert coded.comm == pytest.approx(0.015) and coded.hidden == pytest.approx(0.004 + 0.008)


def test_overhead_does_not_shrink_and_skew_grows_with_the_ranks():
    terms = Terms(overhead=0.02, skew=0.1)
    two, four = (predict_step(0.1, [], 0.0, n, NO_LATENCY, terms) for n in (2, 4))
    assert (two.compute, two.overhead) == (pytest.approx(0.04), pytest.approx(0.02))
    assert (four.compute, four.overhead) == (pytest.approx(0.02), pytest.approx(0.02))
    assert two.skew == pytest.approx(0.1 * 0.06 / math.sqrt(math.pi))  # E[max of 2 normals] = 1/sqrt(pi)
    assert four.skew == pytest.approx(0.1 * 0.04 * expected_max_normal(4))


def test_expected_lag_of_the_slowest_rank_by_hand():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-6)
    lags = [expected_max_normal(2**k) for k in range(1, 11)]
    assert lags == sorted(lags) and 3.0 < lags[-1] < 3.3 < math.sqrt(2 * math.log(1024))


def test_processes_beyond_the_cores_take_turns():
    shared = Interconnect("here", bandwidth=1e9, latency=0.0, cores=2)
    terms = Terms(overhead=0.02)
    assert predict_step(0.1, [], 0.0, 2, shared, terms).compute == pytest.approx(0.04)
    four = predict_step(0.1, [], 0.0, 4, shared, terms)
    assert (four.compute, four.overhead) == (pytest.approx(0.04), pytest.approx(0.04))  # two processes a core, in turn
    assert predict_step(0.1, [], 0.0, 4, LINK, terms).compute == pytest.approx(0.02)


def test_ddps_own_work_is_overhead_of_every_process_and_takes_turns():
    shared = Interconnect("here", bandwidth=1e9, latency=0.0, cores=2)
    terms = Terms(overhead=0.02, overlap=1.0, reducer=0.005)
    assert predict_step(0.1, [[10**6], [10**6]], 0.0, 1, shared, terms).overhead == pytest.approx(0.02)  # no DDP on one process
    two = predict_step(0.1, [[10**6], [10**6]], 0.003, 2, shared, terms)
    assert two.overhead == pytest.approx(0.025)  # not hidden behind the backward pass, unlike the hook's share of early buckets
    assert (two.comm, two.hidden) == (pytest.approx(0.003 + 0.002), pytest.approx(0.001 + 0.0015))
    four = predict_step(0.1, [[10**6], [10**6]], 0.003, 4, shared, terms)
    assert four.overhead == pytest.approx(0.05)  # two processes a core, in turn: their own work too
    assert four.comm == pytest.approx(0.006 + 2 * ring_allreduce_s(10**6, 4, shared))


def test_a_probed_process_count_reads_its_timed_all_reduces_and_others_the_formula():
    timed = ((4, 1e-4), (2**18, 6e-4), (2**20, 4e-3))  # gloo here: a jump between 256 KiB and 1 MiB
    probed = Interconnect("here", bandwidth=1e9, latency=1e-5, cores=2, timed=timed, timed_processes=2)
    assert between_timed(2, timed) == 1e-4  # below the smallest: the smallest's time
    assert between_timed(2**18 + (2**20 - 2**18) / 2, timed) == pytest.approx((6e-4 + 4e-3) / 2)  # halfway: halfway
    assert between_timed(2**21, timed) == pytest.approx(8e-3)  # beyond the largest: its time per byte
    assert ring_allreduce_s(2**20, 2, probed) == pytest.approx(4e-3)
    assert ring_allreduce_s(2**20, 4, probed) == pytest.approx(ring_allreduce_s(2**20, 4, dataclasses.replace(probed, timed=())))
    assert ring_allreduce_s(2**20, 1, probed) == 0.0


def test_the_probes_meeting_lag_is_a_share_of_the_turns():
    lagging = Interconnect("here", bandwidth=1e9, latency=0.0, cores=2, lag=0.05)
    step = predict_step(0.1, [[4]], 0.0, 4, lagging, Terms(overhead=0.02))
    assert step.skew == pytest.approx(0.05 * (step.compute + step.overhead)) and step.compute + step.overhead == pytest.approx(0.08)
    assert predict_step(0.1, [], 0.0, 1, lagging).skew == 0.0  # one process meets nobody


def test_the_models_own_lag_replaces_the_probes_on_the_link_probed_at_that_count():
    buckets = {hook: bucketed(LENET_SHAPES, hook) for hook in HOOKS}
    base = Baseline(lenet_figures(), 0.1, Terms(overhead=0.02), {}, buckets, dict.fromkeys(HOOKS, 0.0), lags={4: 0.2})
    probed = {n: Interconnect(f"here, {n}", bandwidth=1e9, latency=0.0, cores=2, timed_processes=n, lag=0.05) for n in (2, 4)}
    for n, lag in ((4, 0.2), (8, 0.2), (2, 0.05)):  # 8: the fit of 4 processes, the nearest probed below; 2: no lag of its own
        step = base.step("none", n, link_for(n, probed))
        assert step.skew == pytest.approx(lag * (step.compute + step.overhead)), n
    assert base.step("none", 4, PRESETS["ib100"]).skew == 0.0  # a named link: devices of their own, nothing to share


def test_weak_scaling_keeps_each_process_batch():
    terms = Terms(overhead=0.01)
    for n in (1, 4, 64):
        step = predict_step(0.1, [[10**6]], 0.0, n, NO_LATENCY, terms, batch_share=0.5)
        assert (step.compute, step.overhead) == (pytest.approx(0.045), pytest.approx(0.01))


def test_overhead_share_is_the_intercept_of_two_batch_sizes():
    assert overhead_share(1.0, 100, 0.4, 25) == pytest.approx(0.2)  # t(b) = 0.2 + 0.008 b
    assert overhead_share(1.0, 100, 0.25, 25) == 0.0  # proportional: no overhead
    assert overhead_share(1.0, 100, 0.1, 25) == 0.0  # noise below the line: clamped
    assert overhead_share(1.0, 100, 1.0, 25) == 0.99
    assert overhead_share(1.0, 1, 1.0, 1) == 0.0


def test_byte_model_by_hand():
    # 10 x 100 is worth compressing at rank 1 (2 (10 + 100) < 1000); 4 x 4 (16 < 16) and the bias are not.
    shapes = [(10, 100), (4, 4), (10,)]
    assert powersgd_sizes(shapes, 1) == (16 + 10, 10, 100)
    assert powersgd_sizes(shapes, 2) == (16 + 10, 20, 200)
    assert collectives(shapes, "none") == [4 * 1026]
    assert collectives(shapes, "fp16") == collectives(shapes, "bf16") == [2 * 1026]
    assert collectives(shapes, "powersgd") == [4 * 26, 4 * 10, 4 * 100]
    assert collectives(shapes, "powersgd_fp16") == [2 * 26, 2 * 10, 2 * 100]
    assert bucketed(shapes, "powersgd") == [[4 * 26, 4 * 10, 4 * 100]]  # one bucket: all three after the backward pass
    assert bucketed([(2**18,), (2**18,), (10,)], "none") == [[4 * 10 + 2**20], [2**20]]  # gradients in reverse order
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


LENET = OmegaConf.create({"_target_": "src.models.lenet.LeNet"})


@pytest.mark.slow
def test_each_hook_is_timed_as_torch_runs_it_in_a_process_of_its_own(monkeypatch, tmp_path):
    notes = tmp_path / "notes"
    monkeypatch.setenv(HOOK_NOTES, str(notes))  # the timing's process is a new one: it sees this environment
    noted, sleeping = "tests.probes.noted_allreduce_hook", "tests.probes.sleeping_allreduce_hook"
    hooks = (*HOOKS, noted, sleeping)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # a group of the caller's own
    try:
        clock = stepclock.ddp_times(LENET, (1, 28, 28), hooks, repeats=5)  # a median of 5: one preempted step cannot decide it
        assert dist.is_initialized() and dist.get_world_size() == 1  # the caller's group is untouched
    finally:
        dist.destroy_process_group()
    times = clock.hooks
    assert set(times) == set(hooks) and all(t > 0 for t in times.values()) and clock.reducer >= 0
    # The hook's whole call is timed. A lower bound: no load makes a sleep shorter, while two real hooks' times
    # (powersgd's and none's) can swap order on a loaded machine.
    assert times[sleeping] >= HOOK_SLEEP_S
    # The hook named by its import path ran once a step, on one bucket of all of LeNet's gradients: PowerSGD's
    # plain warm-up steps and one more, then the five timed.
    assert notes.read_text().split() == [str(sum(math.prod(s) for s in LENET_SHAPES))] * (2 + 1 + 5)


@pytest.mark.slow
def test_ddps_copies_of_a_large_gradient_are_timed_besides_the_hook():
    # 16 MiB of gradients in one layer: DDP copies them into its bucket and back, work a plain pass of one sample lacks.
    wide = OmegaConf.create({"_target_": "torch.nn.Linear", "in_features": 2048, "out_features": 2048})
    clock = stepclock.ddp_times(wide, (2048,), ("none",), repeats=5)
    assert clock.reducer > 0 and set(clock.hooks) == {"none"}


def test_the_lag_is_what_processes_together_take_beyond_their_turns():
    assert lag_share(0.1, 0.11, 2, cores=2) == pytest.approx(0.1)  # a core each: no turns
    assert lag_share(0.1, 0.23, 4, cores=2) == pytest.approx(0.15)  # two a core: turns of 0.2
    assert lag_share(0.1, 0.19, 4, cores=2) == 0.0  # faster than its turns: noise, not a gain


def test_a_model_that_cannot_be_built_gives_no_lag_and_starts_no_process(caplog):
    """LeNet's own lag, timed on 2 processes, is the command line's test's (`timed.lags`, below); a model whose steps
    fail in the processes, `test_ddps_own_cost_is_...`'s."""
    broken = OmegaConf.create({"_target_": "nowhere.Model"})
    assert stepclock.meeting_lags(broken, (1, 28, 28), {2: 16}, rounds=1) == {}
    assert "the model's steps on 2 processes could not be timed" in caplog.text and "probe's lag" in caplog.text


def test_hooks_of_a_model_that_cannot_be_built_are_estimated(caplog):
    broken = OmegaConf.create({"_target_": "nowhere.Model"})
    assert stepclock.ddp_times(broken, (1, 28, 28), HOOKS, repeats=1) is None
    assert "the DDP hooks could not be timed" in caplog.text


# ---- a run's figures, without training: strong and weak scaling ----

def lenet_figures(processes: int = 1) -> RunFigures:
    return RunFigures(
        run="one", model="lenet", batch_size=256, processes=processes, hook=None, powersgd_rank=1, shapes=LENET_SHAPES,
        net=OmegaConf.create({"_target_": "src.models.lenet.LeNet"}), input_shape=(1, 28, 28), steps_per_epoch=10,
        epoch_s=1.0, step_s=0.1,
    )


def test_repeats_of_a_setting_become_their_medians():
    one = lenet_figures()
    repeats = [dataclasses.replace(one, run=f"r{i}/1proc", epoch_s=e, step_s=e / 10) for i, e in ((2, 1.3), (1, 1.0), (3, 1.1))]
    ddp = [dataclasses.replace(one, run=f"r{i}/ddp2", processes=2, hook="none", epoch_s=e, step_s=e / 10, hook_s=h)
           for i, e, h in ((1, 0.8, 0.004), (2, 0.6, None))]
    other = dataclasses.replace(one, run="bf16", precision="bf16-mixed", epoch_s=0.5, step_s=0.05)
    merged = {r.run: r for r in merge_repeats([*repeats, *ddp, other])}
    assert sorted(merged) == ["bf16", "r1/1proc, median of 3 runs", "r1/ddp2, median of 2 runs"]
    assert merged["r1/1proc, median of 3 runs"].epoch_s == pytest.approx(1.1)
    assert merged["r1/1proc, median of 3 runs"].step_s == pytest.approx(0.11)
    assert merged["r1/ddp2, median of 2 runs"].epoch_s == pytest.approx(0.7)
    assert merged["r1/ddp2, median of 2 runs"].hook_s == pytest.approx(0.004)  # a run that logged none does not count
    assert merged["bf16"] == other  # another precision is another setting


def test_strong_and_weak_scaling_from_one_run():
    stated = Options(overhead_ms=20.0, skew=0.0, bus_share=1.0)
    timed = Timed("cpu", hooks=dict.fromkeys(HOOKS, 0.0), reducer=dict.fromkeys(HOOKS, 0.005))
    base = Baseline.from_run(lenet_figures(), cores=2, options=stated, timed=timed)
    assert base.terms.overhead == pytest.approx(0.02) and "stated" in base.origin["overhead"]
    strong = {r["processes"]: r for r in predictions(base, [NO_LATENCY])if r["hook"] == "none"}
    assert sorted(strong) == [n for n in PROCESS_COUNTS if 256 % n == 0]
    assert {r["global_batch"] for r in strong.values()} == {256} and {r["mode"] for r in strong.values()} == {"strong"}
    ddp_ms = 5.0  # DDP's own work, timed: part of the overhead of more than one process
    assert strong[4]["compute_ms"] == pytest.approx(80 / 4) and strong[4]["overhead_ms"] == pytest.approx(20 + ddp_ms)
    assert strong[1]["overhead_ms"] == pytest.approx(20)
    weak = {r["processes"]: r for r in predictions(base, [NO_LATENCY], per_process_batch=64) if r["hook"] == "none"}
    assert sorted(weak) == list(PROCESS_COUNTS)  # no batch to divide
    assert weak[512]["global_batch"] == 64 * 512 and weak[512]["mode"] == "weak"
    assert {round(r["compute_ms"], 6) for r in weak.values()} == {20.0}  # 64 of the 256 the step was timed at
    # One process's epoch: 2560 samples at 64 a step; 4 processes: 10 steps of 256.
    one_epoch = 40 * 0.04
    assert weak[1]["epoch_s"] == pytest.approx(one_epoch) and weak[1]["efficiency"] == pytest.approx(1.0)
    assert weak[4]["epoch_s"] == pytest.approx(10 * (0.04 + (ddp_ms + weak[4]["exposed_ms"]) / 1e3))
    assert weak[4]["efficiency"] == pytest.approx(one_epoch / weak[4]["epoch_s"] / 4)


@pytest.mark.slow
def test_unstated_terms_are_timed_and_say_so(monkeypatch):
    monkeypatch.setattr(stepclock, "BUDGET_S", 0.01)  # the fewest repeats: 3 steps at each batch size
    run = dataclasses.replace(lenet_figures(), batch_size=16)
    timed = time_baseline(run, cores=2, options=Options(), meet_at=())
    assert timed.device == "cpu" and set(timed.hooks) == set(timed.reducer) == set(HOOKS)
    base = Baseline.from_run(run, cores=2, timed=timed)
    assert 0 <= base.terms.overhead < 0.1 and base.terms.skew >= 0 and base.terms.overlap == 0.0
    assert "timed here" in base.origin["overhead"] and "timed here" in base.origin["skew"]
    assert "timed here" in base.origin["hook"] and base.reducer == timed.reducer
    assert "assumed 0" in base.origin["overlap"]
    untimed = Baseline.from_run(run, cores=2)  # what a report does where nothing was saved: nothing timed, all said
    assert (untimed.terms.overhead, untimed.terms.skew, set(untimed.encode.values()), set(untimed.reducer.values())) == (0, 0, {0}, {0})
    assert all("assumed 0: not timed" in untimed.origin[term] for term in ("overhead", "skew", "hook", "reducer"))


# ---- the what-if: no run, a model, a step time, a link ----

WHATIF = ["--params", "1e6", "--step-ms", "100", "--batch", "64", "--bandwidth", "1", "--latency", "0", "--bus-share", "1"]


def whatif_rows(result) -> dict[int, list[str]]:
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    return {int(cells[0]): cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in rows)}


def test_whatif_by_hand():
    # 10^6 parameters as 1 MiB tensors: buckets of 1,902,848 bytes (the last tensors first), then the 2,097,152 left.
    result = call_main(main, *WHATIF, "--processes", "1", "2")
    assert "Mode: strong scaling" in result.stdout and "1,902,848 / 2,097,152" in result.stdout
    rows = whatif_rows(result)
    # N = 2 at 1 GB/s: each bucket takes bytes / 1e9 s; the first hides behind the backward pass, the last cannot.
    # DDP's own work on a GPU: 2.8 % + 3.1 % of the stated 100 ms step, on more than one process only.
    ddp_ms = (DDP_GPU_SHARE + DDP_GPU_MULTI_SHARE) * 100
    step_ms = 50 + ddp_ms + 2.097152
    assert float(rows[1][4]) == 0.0 and float(rows[2][4]) == pytest.approx(ddp_ms, abs=0.05) == pytest.approx(5.9, abs=0.05)
    assert rows[2][:3] == ["2", "64", "32"] and float(rows[2][8]) == pytest.approx(step_ms, abs=0.05)
    assert float(rows[2][5]) == pytest.approx(4.0, abs=0.05) and float(rows[2][6]) == pytest.approx(2.097, abs=0.05)
    assert float(rows[2][10]) == pytest.approx(100 / step_ms, abs=0.005)  # 860 steps an epoch either way
    assert rows[2][11] == f"{100 / step_ms / 2:.1%}"
    for term in ("overhead", "last bucket", "skew", "bus share 1.00: stated"):
        assert term in result.stdout


def test_whatif_says_what_it_takes_ddps_own_work_on_a_gpu_to_cost():
    assumed = call_main(main, *WHATIF, "--processes", "2")
    assert f"{DDP_GPU_SHARE:.1%} of the step on one GPU under DDP against none, assumed, not measured" in assumed.stdout
    stated = call_main(main, *WHATIF, "--processes", "2", "--ddp-share", "0.1")
    assert "10.0% of the step on one GPU under DDP against none, stated (--ddp-share)" in stated.stdout
    # A share measured on one GPU replaces the assumed one; what more than one GPU adds stays.
    assert float(whatif_rows(stated)[2][4]) == pytest.approx((0.1 + DDP_GPU_MULTI_SHARE) * 100, abs=0.05)


def test_whatif_times_the_step_here_when_not_stated(monkeypatch):
    monkeypatch.setattr(stepclock, "BUDGET_S", 0.01)
    result = call_main(main, "--model", "src.models.lenet.LeNet", "--batch", "16", "--link", "10gbe", "--processes", "2")
    assert result.stdout.count("timed here") == 3  # the step, its overhead and its skew
    assert "0: the step was timed on this CPU, not a GPU" in result.stdout  # no GPU's share of DDP's own work
    assert float(whatif_rows(result)[2][8]) > 0


def test_whatif_bucket_cap_sets_the_last_bucket():
    # 2 MiB buckets after the first: 1,902,848 then the 2,097,152 left fill exactly one more, the last.
    result = call_main(main, *WHATIF, "--bucket-mb", "2", "--processes", "2")
    assert "1,902,848 / 2,097,152" in result.stdout
    result = call_main(main, *WHATIF, "--bucket-mb", "1", "--processes", "2")
    assert "1,902,848 / 1,048,576 / 1,048,576" in result.stdout  # a smaller last bucket: less that cannot overlap
    assert float(whatif_rows(result)[2][6]) == pytest.approx(1.049, abs=0.05)


def test_whatif_weak_scaling_grows_the_global_batch():
    rows = whatif_rows(call_main(main, *WHATIF, "--per-process-batch", "64", "--processes", "1", "3", "8"))
    assert [(n, cells[1], cells[2]) for n, cells in rows.items()] == [(1, "64", "64"), (3, "192", "64"), (8, "512", "64")]
    assert {cells[3] for cells in rows.values()} == {"100.0"}  # each process's compute stays


def test_whatif_names_a_model_and_a_preset_link():
    result = call_main(main, "--model", "src.models.lenet.LeNet", "--step-ms", "50", "--link", "10gbe", "--processes", "4")
    assert f"{sum(math.prod(s) for s in LENET_SHAPES):,} parameters" in result.stdout
    link = PRESETS["10gbe"]
    assert f"{link.bandwidth / 1e9:.4g} GB/s line rate x bus share {link.bus_share:.2f}" in result.stdout
    assert whatif_rows(result)[4][2] == "64"


def published_rows() -> list[tuple[list[str], str]]:
    """(what-if arguments, predicted efficiency) of each predicted row of docs/scaling.md's published table."""
    text = (REPO / "docs" / "scaling.md").read_text()
    table = text.split("## Against published measurements")[1].split("\n\n")[2]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[4].startswith("`--"):
            rows.append((shlex.split(cells[4].strip("`")), cells[5]))
    return rows


def test_whatif_reproduces_the_published_table():
    rows = published_rows()
    assert len(rows) >= 6
    for args, predicted in rows:
        last = max(whatif_rows(call_main(main, *args)).items())[1]
        assert last[11] == predicted, args


def ddp_table_rows() -> list[list[str]]:
    """The cells of each row of docs/scaling.md's table of DDP step times on GPUs."""
    text = (REPO / "docs" / "scaling.md").read_text().split("## DDP on GPUs")[1]
    table = text[text.index("| source | setup | GPUs |"):].split("\n\n")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_whatif_reproduces_the_ddp_table_and_its_errors():
    rows = ddp_table_rows()
    assert {row[0] for row in rows} == {"[P]", "[D]"} and sum("held out" in row[8] for row in rows) == 6
    for source, _, gpus, published, args, predicted, step_error, efficiency_error, _ in rows:
        args = shlex.split(args.strip("`"))
        last = max(whatif_rows(call_main(main, *args)).items())[1]
        assert last[0] == gpus and predicted == f"{float(last[8]):.1f} ms, {last[11]}", args
        one_gpu = float(args[args.index("--step-ms") + 1])
        published_ms = float(published.split(" ms")[0])
        assert published == f"{published_ms:g} ms, {one_gpu / published_ms:.1%}"
        assert step_error == f"{(float(last[8]) - published_ms) / published_ms * 100:+.1f} %"
        assert efficiency_error == f"{float(last[11].rstrip('%')) - one_gpu / published_ms * 100:+.1f}"


@pytest.mark.parametrize("args, words", [
    (["--params", "1e6", "--step-ms", "10", "--link", "5gbe"], ["--link", "10gbe", "nvlink4"]),
    (["--params", "1e6", "--step-ms", "10"], ["--link", "--bandwidth"]),
    (["--params", "1e6", "--link", "10gbe"], ["--step-ms"]),
    (["--params", "0.5", "--step-ms", "10", "--link", "10gbe"], ["--params"]),
    (["--params", "1e6", "--model", "src.models.lenet.LeNet", "--step-ms", "10", "--link", "10gbe"], ["--model", "--params"]),
    (["--model", "nowhere.Model", "--step-ms", "10", "--link", "10gbe"], ["--model", "nowhere.Model", "import path"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--hook", "int8"], ["--hook", "powersgd"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--hook", "powersgd"], ["--hook", "--model"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--processes", "0"], ["--processes"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--processes", "3"], ["--processes", "--per-process-batch"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--per-process-batch", "0"], ["--per-process-batch"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--bus-share", "0"], ["--bus-share"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--bandwidth", "1"], ["--link"]),
    (["--params", "1e6", "--step-ms", "10", "--bandwidth", "-1", "--latency", "1"], ["--bandwidth"]),
    (["--model", "src.models.lenet.LeNet", "--link", "10gbe", "--input", "28"], ["--input", "CxHxW"]),
    (["--model", "src.models.lenet.LeNet", "--link", "nvlink4"], ["--link nvlink4", "GPU's step time", "--step-ms"]),
    (["outputs", "--step-ms", "10"], ["--step-ms", "--model"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--bucket-mb", "0"], ["--bucket-mb"]),
    (["--params", "1e6", "--step-ms", "10", "--link", "10gbe", "--ddp-share", "2"], ["--ddp-share", "from 0 to 1"]),
    (["outputs", "--ddp-share", "0.03"], ["--ddp-share", "--model"]),
])
def test_whatif_bad_input_is_one_line(args, words):
    assert_one_error_line(call_main(main, *args), *words)


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


def test_a_saved_probe_keeps_its_lags_and_an_older_one_has_none(tmp_path):
    probe = Probe(synthetic_points(1e-4, 1e9), cores=2, lags={2: 0.03, 4: 0.07})
    save(probe, tmp_path / "probe.json")
    again = load(tmp_path / "probe.json")
    assert (again.points, again.lags, again.cores) == ([tuple(p) for p in probe.points], {2: 0.03, 4: 0.07}, 2)
    assert again.timed(4) == tuple((b, t) for n, b, t in probe.points if n == 4)
    older = json.loads((tmp_path / "probe.json").read_text())
    del older["lag_shares"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert load(tmp_path / "older.json").lags == {}


@pytest.mark.slow
def test_probe_times_real_gloo_all_reduces():
    points, lag = measure(2, cores=2, sizes=[4, 8 * 2**20])
    assert [(n, b) for n, b, _ in points] == [(2, 4), (2, 8 * 2**20)]
    (_, _, small), (_, _, large) = points
    assert 0 < small < large < 10
    assert 0 <= lag < 10  # a share of the work's turns: meeting costs far less than the work itself


def test_the_step_is_timed_in_the_runs_precision():
    seen = []
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    net.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    stepclock.step_times(net, (2, 2), 8, repeats=2, precision="32-true")
    assert set(seen) == {torch.float32}
    seen.clear()
    stepclock.step_times(net, (2, 2), 8, repeats=2, precision="bf16-mixed")
    assert seen.count(torch.bfloat16) == 3  # the warm-up step and both timed ones (the class count is read in fp32)


# ---- the report's section: nothing timed, only what it can stand behind, table first ----

def write_ddp_run(folder: Path, accelerator: str = "cpu") -> Path:
    """A run folder as a 2-process LeNet DDP run leaves it, with the figures the scaling model reads, and no training."""
    config = {"model_name": "lenet", "strategy_name": "ddp", "devices": 2, "num_nodes": 1, "precision": "32",
              "strategy": {"_target_": "src.strategies.ddp.CommHookDDPStrategy", "hook": "none"},
              "model": {"net": {"_target_": "src.models.lenet.LeNet"}},
              "data": {"batch_size": 256, "in_channels": 1, "num_classes": 10}}
    folder.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config), folder / "config.yaml")
    with SummaryWriter(log_dir=str(folder)) as writer:
        for step, epoch_s in ((9, 1.0), (19, 1.2), (29, 1.1)):
            writer.add_scalar("time/epoch_s", epoch_s, step)
            writer.add_scalar("xfer/bytes_per_step", 516272, step)
        for summary in hparams_summary({"precision_used": "32-true", "accelerator": accelerator}, {}):
            writer.file_writer.add_summary(summary)
    return folder


@pytest.fixture
def nothing_timed(monkeypatch):
    """Every costly timing fails the test if it is called."""
    def refuse(*args, **kwargs):
        raise AssertionError("a report timed something")

    for name in ("measure", "ddp_times", "ddp_step_costs", "meeting_lags", "step_times"):
        monkeypatch.setattr(stepclock, name, refuse)
    monkeypatch.setattr(probe_module, "run_probe", refuse)


def test_a_report_of_cpu_runs_times_nothing_and_without_a_probe_predicts_nothing(tmp_path, nothing_timed):
    write_ddp_run(tmp_path / "ddp2")
    write_report(tmp_path)
    section = (tmp_path / "report.md").read_text().split("# Predicted scaling")[1]
    assert "No predictions here: the run ran on CPU" in section and f"python -m src.scaling {tmp_path} --probe" in section
    assert "| none | 516,272 | 516,272 |" in section  # the bytes, which the byte model counts exactly
    assert "| NVLink" not in section and "| 10 GbE" not in section and "How these are predicted" not in section
    assert read_rows_or_header(tmp_path / "scaling.csv") == []


def test_a_report_with_a_saved_probe_predicts_this_machine_alone_and_says_what_it_assumes(tmp_path, nothing_timed):
    write_ddp_run(tmp_path / "ddp2")
    write_probe(tmp_path / "probe.json")
    write_report(tmp_path)
    section = (tmp_path / "report.md").read_text().split("# Predicted scaling")[1]
    assert "| gloo here, 2 proc. | none |" in section and "| NVLink" not in section
    assert section.count("assumed 0: not timed (`python -m src.scaling <folder>` times it here)") >= 4
    # Table first, formula after.
    assert section.index("| interconnect | hook |") < section.index("Terms of the model") < section.index("## How these are predicted")
    assert {r["interconnect"] for r in read_rows(tmp_path / "scaling.csv")} == {"gloo here, 2 proc."}


def test_terms_timed_by_the_command_are_saved_and_the_report_reads_them(tmp_path, monkeypatch):
    write_ddp_run(tmp_path / "ddp2")
    write_probe(tmp_path / "probe.json")
    timed = Timed("cpu", overhead_share=0.25, skew=0.01, hooks=dict.fromkeys(HOOKS, 0.002),
                  reducer=dict.fromkeys(HOOKS, 0.003), lags={2: 0.07})
    monkeypatch.setattr(timing, "time_run", lambda *args, **kwargs: timed)
    assert call_main(main, str(tmp_path)).returncode == 0  # `python -m src.scaling <folder>`: times, and saves
    [saved] = timing.load(tmp_path / timing.FILE).values()
    assert saved == timed
    monkeypatch.setattr(timing, "time_run", None)  # the report must not time again
    write_report(tmp_path)
    section = (tmp_path / "report.md").read_text().split("# Predicted scaling")[1]
    assert "25% of the step: the model's step timed here" in section and "7.0% at 2 processes" in section
    assert "| none | 516,272 | 516,272 | 2.0 |" in section  # the hook's own time, as timed
    assert "assumed 0: not timed" not in section


def test_a_report_of_gpu_runs_predicts_gpu_links_with_ddps_own_work_assumed_or_measured(tmp_path, nothing_timed):
    write_ddp_run(tmp_path / "ddp2", accelerator="cuda")
    write_report(tmp_path)
    section = (tmp_path / "report.md").read_text().split("# Predicted scaling")[1]
    assert "| NVLink 4 | none |" in section and "gloo here" not in section and "on GPUs" in section
    assert f"assumed {DDP_GPU_SHARE:.1%} + {DDP_GPU_MULTI_SHARE:.1%} of the step" in section
    rows = {(r["interconnect"], r["hook"], int(r["processes"])): r for r in read_rows(tmp_path / "scaling.csv")}
    step_ms = float(rows["NVLink 4", "none", 1]["compute_ms"])  # one GPU: the run's 2 GPUs' step, times 2
    assert float(rows["NVLink 4", "none", 8]["overhead_ms"]) == pytest.approx((DDP_GPU_SHARE + DDP_GPU_MULTI_SHARE) * step_ms)
    # A cost measured on a GPU (`python -m src.scaling <folder>` there) replaces the assumed share.
    measured = Timed("NVIDIA H100 80GB HBM3", reducer=dict.fromkeys(HOOKS, 0.004))
    name = timing.key("lenet", 256, 2, "32-true", None, 25.0, 1)
    timing.save(tmp_path / timing.FILE, {name: measured})
    write_report(tmp_path)
    section = (tmp_path / "report.md").read_text().split("# Predicted scaling")[1]
    assert "measured on NVIDIA H100 80GB HBM3" in section
    rows = {(r["interconnect"], r["hook"], int(r["processes"])): r for r in read_rows(tmp_path / "scaling.csv")}
    assert float(rows["NVLink 4", "none", 8]["overhead_ms"]) == pytest.approx(4 + DDP_GPU_MULTI_SHARE * step_ms)


@pytest.mark.slow
def test_ddps_own_cost_is_a_ddp_step_of_world_size_one_against_the_plain_step(caplog):
    costs = stepclock.ddp_step_costs(LENET, (1, 28, 28), 16, "32-true", ("none", "fp16"), device="cpu", repeats=3)
    assert set(costs) == {"none", "fp16"} and all(cost >= 0 for cost in costs.values())
    # Built here, failing in its process: a Linear of 3 inputs, given images whose rows have 28 pixels.
    broken = OmegaConf.create({"_target_": "torch.nn.Linear", "in_features": 3, "out_features": 10})
    assert stepclock.ddp_step_costs(broken, (1, 28, 28), 16, "32-true", ("none",), device="cpu", repeats=1) is None
    assert "DDP's own cost could not be measured on cpu" in caplog.text and "mat1 and mat2 shapes cannot be multiplied" in caplog.text


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["src.models.lenet.LeNet", "src.models.resnet.resnet18"])
def test_ddps_own_cost_on_a_gpu_is_measured_over_nccl(model):
    """What `python -m src.scaling <GPU run folder>` measures on a GPU; printed, for the GPU check's record."""
    net = OmegaConf.create({"_target_": model})
    plain = statistics.median(stepclock.step_times(instantiate(net).cuda(), (1, 28, 28), 256, repeats=10,
                                                   precision="bf16-mixed", device="cuda"))
    costs = stepclock.ddp_step_costs(net, (1, 28, 28), 256, "bf16-mixed", HOOKS, device="cuda")
    assert costs is not None and set(costs) == set(HOOKS) and all(cost >= 0 for cost in costs.values())
    print(f"{model}, batch 256, bf16-mixed, {torch.cuda.get_device_name(0)}: plain step {plain * 1e3:.2f} ms; DDP of world "
          "size 1 adds " + ", ".join(f"{hook} {cost * 1e3:.2f} ms ({cost / plain:.1%})" for hook, cost in costs.items()))


# ---- real runs: the byte model against the counted bytes; the command line ----

@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_root) -> Path:
    """A one-process LeNet run and a 2-process PowerSGD run (2 plain all-reduce steps, then 2 compressed), started
    from this process: the tests read their folders."""
    root = tmp_path_factory.mktemp("runs")
    quick = [*QUICK, "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1"]
    result = train_here(*quick, f"hydra.run.dir={root / 'one'}")
    assert result.returncode == 0, result.stderr[-3000:]
    result = train_here(*quick, "strategy=ddp_powersgd", "devices=2", "strategy.start_powersgd_iter=2", f"hydra.run.dir={root / 'two'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.slow
def test_byte_model_matches_what_a_real_ddp_run_counted(runs):
    sent = scalars(runs / "two")["xfer/bytes_per_step"]
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


def read_rows_or_header(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        rows = list(reader)
    assert reader.fieldnames == list(COLUMNS)
    return rows


@pytest.mark.slow
def test_cli_writes_table_plot_and_checks_for_real_runs(runs, tmp_path):
    out = tmp_path / "out"
    result = run_cli("src.scaling", str(runs), "--out", str(out), "--probe-file", str(write_probe(tmp_path / "probe.json")))
    assert result.returncode == 0, result.stderr
    rows = read_rows(out / "scaling.csv")
    counts = [n for n in PROCESS_COUNTS if 256 % n == 0]  # QUICK keeps the global batch of 256
    # CPU runs: the measured interconnect alone (a GPU link needs a GPU run's step time)
    assert {(r["interconnect"], r["hook"], int(r["processes"])) for r in rows} == {
        ("gloo here, 2 proc.", hook, n) for hook in HOOKS for n in counts}
    assert len(rows) == len(HOOKS) * len(counts)

    by_key = {(r["interconnect"], r["hook"], int(r["processes"])): r for r in rows}
    one_step_ms = float(by_key["gloo here, 2 proc.", "none", 1]["compute_ms"])
    assert float(by_key["gloo here, 2 proc.", "none", 1]["speedup"]) == 1.0
    # The measured interconnect shares 2 cores: 4 processes compute no faster than 2.
    assert float(by_key["gloo here, 2 proc.", "fp16", 2]["compute_ms"]) == pytest.approx(one_step_ms / 2)
    assert float(by_key["gloo here, 2 proc.", "none", 4]["compute_ms"]) == pytest.approx(one_step_ms / 2)
    assert int(by_key["gloo here, 2 proc.", "none", 2]["bytes_per_step"]) == 4 * sum(math.prod(s) for s in LENET_SHAPES)
    assert int(by_key["gloo here, 2 proc.", "bf16", 2]["bytes_per_step"]) == 2 * sum(math.prod(s) for s in LENET_SHAPES)
    # The one-process run is the baseline; the DDP run is checked against its prediction.
    logged = scalars(runs / "one")["time/epoch_s"]
    assert float(by_key["gloo here, 2 proc.", "none", 1]["epoch_s"]) == pytest.approx(logged[0], rel=1e-6)
    markdown = (out / "scaling.md").read_text()
    assert "From `one` (1 process," in markdown
    assert "at 2 processes; the model's step timed on N processes at once" in markdown  # its own lag, not the probe's
    [check] = [line for line in markdown.splitlines() if line.startswith("| two |")]
    cells = [c.strip() for c in check.strip("|").split("|")]
    assert cells[1:4] == ["powersgd", "2", "gloo here, 2 proc."] and cells[4] == cells[5]  # bytes: predicted = counted
    height, width, _ = imread(out / "scaling_lenet.png").shape
    assert height > 200 and width > 200
    [timed] = timing.load(out / timing.FILE).values()  # what a later report reads instead of timing again
    assert timed.device == "cpu" and set(timed.hooks) == set(HOOKS) and set(timed.lags) == {2}
    assert not (runs / "scaling.md").exists()


@pytest.mark.slow
def test_cli_weak_scaling_from_real_runs(runs, tmp_path, monkeypatch):
    # The hooks' timing in a process of its own is the command line's test's; here they are estimated, as where it fails.
    monkeypatch.setattr(stepclock, "ddp_times", lambda *args, **kwargs: None)
    out = tmp_path / "weak"
    result = call_main(main, str(runs), "--out", str(out), "--per-process-batch", "64", "--overhead-ms", "0",
                       "--skew", "0", "--probe-file", str(write_probe(tmp_path / "probe.json")))
    assert result.returncode == 0, result.stderr
    rows = [r for r in read_rows(out / "scaling.csv")
            if r["interconnect"] == "gloo here, 2 proc." and r["hook"] == "none"]
    assert {r["mode"] for r in rows} == {"weak"} and [int(r["processes"]) for r in rows] == list(PROCESS_COUNTS)
    assert [int(r["global_batch"]) for r in rows] == [64 * n for n in PROCESS_COUNTS]
    one = float(rows[0]["compute_ms"])  # each process computes 64 samples, whatever N; beyond 2 cores, by turns
    assert [float(r["compute_ms"]) for r in rows] == pytest.approx([one * max(1, n / 2) for n in PROCESS_COUNTS])
    assert "Weak scaling (`--per-process-batch 64`)" in (out / "scaling.md").read_text()


@pytest.mark.slow
def test_report_includes_the_scaling_table(runs, tmp_path):
    """src.report's own entry in this process (test_report.py starts the command)."""
    result = call_main(report_main, str(runs), "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "report" / "report.md").read_text()
    assert "# Predicted scaling" in report and "No predictions here" in report  # CPU runs, no probe saved
    assert "| powersgd | 832, 832, 5,748 | 7,412 |" in report and "| NVLink" not in report
    with_probe = Path(shutil.copytree(runs, tmp_path / "runs"))
    write_probe(with_probe / "probe.json")
    result = call_main(report_main, str(with_probe))
    assert result.returncode == 0, result.stderr
    report = (with_probe / "report.md").read_text()
    assert "| gloo here, 2 proc. | powersgd |" in report and "](scaling_lenet.png)" in report
    assert (with_probe / "scaling_lenet.png").is_file() and (with_probe / "scaling.csv").is_file()


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
    (tmp_path / "config_only").mkdir(parents=True)
    (tmp_path / "config_only" / "config.yaml").write_text("devices: 1\n")
    assert_one_error_line(call_main(main, str(tmp_path)), "no run folders")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config_only"]


def test_bad_options_name_what_is_allowed(tmp_path):
    assert_one_error_line(call_main(main, str(tmp_path), "--overlap", "2"), "--overlap", "between 0 and 1")
    assert_one_error_line(call_main(main, str(tmp_path), "--skew", "-0.1"), "--skew", "between 0 and 10")
    assert_one_error_line(call_main(main, str(tmp_path), "--bus-share", "1.5"), "--bus-share", "at most 1")
    assert_one_error_line(call_main(main, str(tmp_path), "--overhead-ms", "-1"), "--overhead-ms", "0 or more")
    assert_one_error_line(call_main(main, str(tmp_path), "--per-process-batch", "0"), "--per-process-batch", "whole number")
    assert_one_error_line(call_main(main, str(tmp_path), "--batch", "64"), "--batch", "what-if")
    assert_one_error_line(call_main(main, str(tmp_path), "--probe-file", str(tmp_path / "none.json")), "--probe-file")
    (tmp_path / "bad.json").write_text(json.dumps({"cores": 2}))
    assert_one_error_line(call_main(main, str(tmp_path), "--probe-file", str(tmp_path / "bad.json")), "--probe-file", "not a probe")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_a_prediction_that_the_run_contradicts_says_which_part_of_the_model_missed():
    from src.scaling.predict import why_missed

    assert why_missed(1.0, 1.1, 5.0, 5.2) == ""  # within 25 %: nothing to explain
    hook = why_missed(1.0, 2.4, 5.0, 40.0)
    assert hook.startswith("the run was slower than predicted, and its all-reduces took 40.0 ms where the probe gives 5.0")
    compute = why_missed(2.0, 1.0, 5.0, 5.5)
    assert compute.startswith("the run was faster than predicted while its all-reduces took what the probe gives")


def test_the_cost_model_prices_the_hooks_ddp_builds():
    """The cost model names its hooks without importing torch; they must be those `strategy.hook` takes."""
    assert costmodel.HOOKS == ddp.HOOKS and costmodel.MIB == ddp.MIB


def test_whatif_writes_what_it_printed_where_out_says(tmp_path):
    """`--out` was ignored by a what-if: it printed and wrote nothing."""
    result = call_main(main, "--model", "src.models.lenet.LeNet", "--step-ms", "50", "--link", "10gbe", "--processes",
                       "4", "--out", str(tmp_path / "whatif"))
    assert result.returncode == 0, result.stderr
    written = (tmp_path / "whatif" / "whatif.md").read_text()
    assert written.strip() and written.strip() in result.stdout
    assert result.stdout.strip().splitlines()[-1] == f"-> {tmp_path / 'whatif' / 'whatif.md'}"


def test_a_cpu_run_is_predicted_on_the_measured_interconnect_alone_by_the_command_as_by_the_report(tmp_path,
                                                                                                  monkeypatch):
    """`src.scaling <a CPU run>` predicted NVLink, PCIe and InfiniBand from the CPU's step, where the report said those
    need a GPU run's step time: one rule now, in both, and the command writes only under `--out`."""
    write_ddp_run(tmp_path / "ddp2")
    timed = Timed("cpu", overhead_share=0.25, skew=0.01, hooks=dict.fromkeys(HOOKS, 0.002),
                  reducer=dict.fromkeys(HOOKS, 0.003), lags={2: 0.07})
    monkeypatch.setattr(timing, "time_run", lambda *args, **kwargs: timed)
    out = tmp_path / "out"
    assert call_main(main, str(tmp_path), "--out", str(out)).returncode == 0  # no probe: nothing it can stand behind
    assert read_rows_or_header(out / "scaling.csv") == []
    markdown = (out / "scaling.md").read_text()
    assert "No predictions here: the run ran on CPU" in markdown and f"{NEEDS_GPU_STEP}, not this CPU's" in markdown
    write_probe(tmp_path / "probe.json")
    assert call_main(main, str(tmp_path), "--out", str(out)).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp2", "out", "probe.json"]  # all it wrote is in --out
    write_report(tmp_path)
    report = (tmp_path / "report.md").read_text().split("# Predicted scaling")[1]
    for markdown in ((out / "scaling.md").read_text(), report):
        assert CPU_LINKS in markdown and "| gloo here, 2 proc. | none |" in markdown
        assert not any(f"| {link.name} |" in markdown for link in INTERCONNECTS)
    assert {r["interconnect"] for r in read_rows(out / "scaling.csv")} == {"gloo here, 2 proc."}
    assert {r["interconnect"] for r in read_rows(tmp_path / "scaling.csv")} == {"gloo here, 2 proc."}
    # A GPU run's step prices the GPU links, and no measured interconnect of this machine's cores.
    gpu = tmp_path / "gpu"
    write_ddp_run(gpu / "ddp2", accelerator="cuda")
    assert call_main(main, str(gpu), "--probe-file", str(tmp_path / "probe.json")).returncode == 0
    assert {r["interconnect"] for r in read_rows(gpu / "scaling.csv")} == {link.name for link in INTERCONNECTS}
    assert CPU_LINKS not in (gpu / "scaling.md").read_text()
