"""DDP workers are forked from a forkserver that may have started at an earlier launch in the same
process (an earlier job of a sweep, an earlier run of this test session): each still takes the
environment and the output of its own launch."""

import inspect
import json
import subprocess
import sys

import pytest

from tests.helpers import QUICK, REPO, train, user_env


def test_workers_take_the_environment_and_output_of_their_own_launch(tmp_path, data_root, monkeypatch):
    probe = ["+callbacks.probe._target_=tests.probes.ShowVariable", "+callbacks.probe.name=LAUNCH_PROBE"]
    seen = {}
    for value in ("first", "second"):
        monkeypatch.setenv("LAUNCH_PROBE", value)
        result = train(*QUICK, "strategy=ddp", "devices=2", *probe, f"hydra.run.dir={tmp_path / value}")
        assert result.returncode == 0, result.stderr[-3000:]
        seen[value] = sorted(line for line in result.stdout.splitlines() if line.startswith("LAUNCH_PROBE="))
    assert seen == {value: [f"LAUNCH_PROBE={value} rank 0", f"LAUNCH_PROBE={value} rank 1"] for value in seen}


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
def test_the_agents_variables_stay_over_the_launchers(tmp_path, data_root, monkeypatch, name):
    """A value the launcher has for one of the agent's variables does not hide the agent's per-worker one."""
    monkeypatch.setenv(name, "7")
    probe = ["+callbacks.probe._target_=tests.probes.ShowVariable", f"+callbacks.probe.name={name}"]
    result = train(*QUICK, "strategy=ddp", "devices=2", *probe, f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {"RANK": ["0", "1"], "WORLD_SIZE": ["2", "2"]}[name]
    assert sorted(line for line in result.stdout.splitlines() if line.startswith(f"{name}=")) == [
        f"{name}={value} rank {rank}" for rank, value in enumerate(expected)]


# Every way into CUDA's initialization, recorded: torch's lazy init, and the device count, which starts
# the CUDA driver where NVML cannot answer. Then every module of the project, a superset of what a run's
# launcher has imported (its models and strategies too) and so of what its forkserver preloads.
RECORD_CUDA_INIT = """
import importlib, json, pkgutil, torch
calls = []
def recorded(owner, name):
    real = getattr(owner, name)
    def call(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    setattr(owner, name, call)
for owner, name in [(torch.cuda, "_lazy_init"), (torch.cuda, "init"), (torch.cuda, "is_available"),
                    (torch.cuda, "device_count"), (torch._C, "_cuda_init"), (torch._C, "_cuda_getDeviceCount")]:
    recorded(owner, name)
import src
for module in pkgutil.walk_packages(src.__path__, "src."):
    if not module.name.endswith("__main__"):  # an entry point runs when imported
        importlib.import_module(module.name)
from src.launch import workers
names = workers.preloaded(importlib.import_module("src.runner").run)
print(json.dumps({"preloaded": names, "calls": calls}))
"""


def test_what_the_forkserver_imports_never_initializes_cuda():
    """CUDA cannot run in a process forked from one that initialized it: every DDP worker would fail."""
    result = subprocess.run([sys.executable, "-c", RECORD_CUDA_INIT], cwd=REPO, env=user_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert {"src.launch.workers", "src.train", "src.models.module", "src.strategies.ddp"} <= set(seen["preloaded"])
    assert seen["calls"] == []


def test_the_rendezvous_names_its_events_from_the_frame_without_reading_the_stacks_source(monkeypatch):
    """torch names each rendezvous event after the method that records it, two frames up from the naming function.
    The launcher's replacement names the same method from the frame alone: `inspect.stack()` read the source of
    every frame, about 1 s of each local DDP launch (docs/results.md, start-up)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    import src.launch.workers  # noqa: F401  what replaces it, as a launch imports it

    def read_the_stack(*args: object, **kwargs: object) -> None:
        raise AssertionError("inspect.stack() called")

    monkeypatch.setattr(inspect, "stack", read_the_stack)

    def record() -> str:  # as the handler's `_record` calls it
        return dynamic_rendezvous.get_method_name()

    def next_rendezvous() -> str:
        return record()

    assert next_rendezvous() == "next_rendezvous"
    assert dynamic_rendezvous.get_method_name(depth=100_000) == "no_method_name"
