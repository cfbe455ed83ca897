"""A real TensorBoard server on two real runs: every run, scalar and text the project logs is served."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.runs import find_run_dirs
from tests.helpers import free_port, hparams

TENSORBOARD = Path(sys.executable).parent / "tensorboard"
SCALARS = ("train/loss", "train/acc", "val/acc", "test/acc", "time/epoch_s", "time/samples_per_s")
DDP_SCALARS = ("xfer/bytes_per_step", "xfer/compression_ratio", "xfer/hook_ms")
READY_S = 90


def get(base: str, path: str, **query: str):
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def logdir(ddp_sweep) -> Path:
    """A sweep of two runs, LeNet under DDP on 2 processes and on 1 (conftest's `ddp_sweep`)."""
    return ddp_sweep.dir


@pytest.fixture(scope="module")
def server(logdir):
    """Base URL of a TensorBoard bound to 127.0.0.1 that has loaded every run; killed afterwards."""
    port = free_port()
    process = subprocess.Popen(
        [str(TENSORBOARD), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    expected = {d.relative_to(logdir).as_posix() for d in find_run_dirs(logdir)} | {"report"}
    try:
        deadline = time.monotonic() + READY_S
        while True:
            assert process.poll() is None, f"tensorboard exited: {process.stderr.read()[-2000:]}"
            try:
                if expected <= set(get(base, "/data/runs")):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"tensorboard not ready with {sorted(expected)} after {READY_S} s"
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its own session: the server and any data server it started
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.slow
def test_every_run_and_scalar_is_served(server, logdir):
    run_dirs = find_run_dirs(logdir)
    assert len(run_dirs) == 2
    served_runs = set(get(server, "/data/runs"))
    tags = get(server, "/data/plugin/scalars/tags")
    for run_dir in run_dirs:
        run = run_dir.relative_to(logdir).as_posix()
        assert run in served_runs
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        logged = set(events.Tags()["scalars"])
        # One process sends nothing: its hook is timed, but no bytes are counted.
        expected = SCALARS + (DDP_SCALARS if hparams(run_dir)["world_size"] > 1 else ("xfer/hook_ms",))
        assert set(expected) <= logged, sorted(set(expected) - logged)
        assert set(tags[run]) == logged
        for tag in expected:
            served = get(server, "/data/plugin/scalars/scalars", run=run, tag=tag)
            assert [(step, value) for _, step, value in served] == [
                (e.step, pytest.approx(e.value)) for e in events.Scalars(tag)
            ]


@pytest.mark.slow
def test_system_report_and_sweep_table_are_served_as_text(server, logdir):
    tags = get(server, "/data/plugin/text/tags")
    assert tags["report"] == ["report/text_summary"]  # torch's SummaryWriter.add_text names it so
    for run_dir in find_run_dirs(logdir):
        assert "system/text_summary" in tags[run_dir.relative_to(logdir).as_posix()]


@pytest.mark.slow
def test_time_series_shows_the_answer_before_the_transfer_scalars(server):
    """Time Series files a tag under its first path part and sorts those groups by name (TensorBoard
    2.21's dashboard compares names character by character, digits and `/` aside): `xfer` after
    the accuracy, loss and time groups, in a DDP run that logs all of them."""
    tags = get(server, "/data/plugin/scalars/tags")
    groups = sorted({tag.split("/", 1)[0] for run_tags in tags.values() for tag in run_tags})
    assert {"test", "time", "train", "val", "xfer"} <= set(groups)
    assert groups[:2] == ["test", "time"] and groups[-1] == "xfer"
