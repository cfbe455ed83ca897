"""Local DDP workers take the environment of their own launch, with the agent's variables over the launcher's."""

import re

import pytest

from tests.helpers import QUICK, train_here

SHOWN = ("LAUNCH_PROBE", "RANK", "WORLD_SIZE")


@pytest.mark.slow
def test_workers_take_the_environment_of_their_own_launch_and_the_agents_variables_over_the_launchers(
        tmp_path, data_root, monkeypatch, capfd):
    """Two launches from this process, one after the other (of 2 workers, then of 1), each with its own value of a
    variable: each launch's workers see its value. RANK and WORLD_SIZE, which the launcher has too (7), are the agent's
    own in each worker. The workers' lines reach this process's standard output, which they share."""
    probes = [arg for i, name in enumerate(SHOWN)
              for arg in (f"+callbacks.probe{i}._target_=tests.probes.ShowVariable", f"+callbacks.probe{i}.name={name}")]
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "7")
    for value, workers in (("first", 2), ("second", 1)):
        monkeypatch.setenv("LAUNCH_PROBE", value)
        capfd.readouterr()
        result = train_here(*QUICK, "strategy=ddp", f"devices={workers}", *probes, f"hydra.run.dir={tmp_path / value}")
        assert result.returncode == 0, result.stderr[-3000:]
        seen = sorted(line for line in capfd.readouterr().out.splitlines() if re.match(rf"({'|'.join(SHOWN)})=", line))
        assert seen == sorted(f"{name}={shown} rank {rank}" for rank in range(workers)
                              for name, shown in (("LAUNCH_PROBE", value), ("RANK", rank), ("WORLD_SIZE", workers)))
