"""Local DDP workers take the environment and output of their own launch, with the agent's variables over the
launcher's."""

import pytest

from tests.helpers import QUICK, train


@pytest.mark.slow
def test_workers_take_the_environment_and_output_of_their_own_launch(tmp_path, data_root, monkeypatch):
    probe = ["+callbacks.probe._target_=tests.probes.ShowVariable", "+callbacks.probe.name=LAUNCH_PROBE"]
    seen = {}
    for value in ("first", "second"):
        monkeypatch.setenv("LAUNCH_PROBE", value)
        result = train(*QUICK, "strategy=ddp", "devices=2", *probe, f"hydra.run.dir={tmp_path / value}")
        assert result.returncode == 0, result.stderr[-3000:]
        seen[value] = sorted(line for line in result.stdout.splitlines() if line.startswith("LAUNCH_PROBE="))
    assert seen == {value: [f"LAUNCH_PROBE={value} rank 0", f"LAUNCH_PROBE={value} rank 1"] for value in seen}


@pytest.mark.slow
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
