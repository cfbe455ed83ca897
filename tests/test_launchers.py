"""Hydra's own test kit for launcher plugins (`hydra.test_utils.launcher_common_tests`), run against the project's
launchers as Hydra's joblib and submitit plugins run it against theirs (Hydra's basic launcher passes it in Hydra's
own suite, not here). Passing it, a launcher works in any Hydra app: the kit's apps have none of the project's keys,
return their own values, and expect a failed job to fail the sweep."""

import subprocess
import sys

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import BatchedSweeperTestSuite, IntegrationTestSuite, LauncherTestSuite

from tests.helpers import REPO, user_env

LAUNCHERS = ["sequential", "parallel"]


@pytest.fixture(autouse=True)
def hydras_default_version_base():
    """The kit's apps run at Hydra's default version base (1.1: a job runs in its own folder), which the first
    composition in a process settles for the process: the project's own tests before these set 1.3."""
    from hydra.version import _UNSPECIFIED_, VersionBase

    saved = VersionBase.instance().getbase()
    VersionBase.instance().version_base = _UNSPECIFIED_
    yield
    VersionBase.instance().version_base = saved


def test_hydra_discovers_the_launchers():
    assert {"SequentialLauncher", "ParallelLauncher"} <= {plugin.__name__ for plugin in Plugins.instance().discover(Launcher)}


def launchers(overrides: list[str]) -> list:
    """Each launcher's case, with a list of overrides of its own (the kit extends it); the parallel launcher's case
    starts its jobs' interpreters."""
    return [pytest.param(name, list(overrides), marks=[pytest.mark.slow] if name == "parallel" else [], id=name)
            for name in LAUNCHERS]


@pytest.mark.parametrize(("launcher_name", "overrides"), launchers([]))
class TestLauncher(LauncherTestSuite):
    pass


@pytest.mark.parametrize(("launcher_name", "overrides"), launchers(["hydra.sweeper.max_batch_size=2"]))
class TestBatchedSweeper(BatchedSweeperTestSuite):
    pass


@pytest.mark.slow  # the kit starts each app in an interpreter of its own
@pytest.mark.parametrize(("task_launcher_cfg", "extra_flags"),
                         [({"defaults": [{"override hydra/launcher": name}, "_self_"]}, ["-m"]) for name in LAUNCHERS])
class TestIntegration(IntegrationTestSuite):
    pass


TORCHLESS_APP = '''
import sys
from pathlib import Path

import hydra


@hydra.main(version_base=None, config_path=None)
def main(cfg) -> None:
    Path(cfg.out, f"job{cfg.x}").write_text(str("torch" in sys.modules))


if __name__ == "__main__":
    main()
    print("launching process imported torch:", "torch" in sys.modules)
'''


@pytest.mark.slow  # what a fresh interpreter imports is the point
@pytest.mark.parametrize("name", LAUNCHERS)
def test_a_sweep_of_an_app_without_torch_imports_none(tmp_path, name):
    """Neither the launching process nor a job imports torch for an app that does not: a sweep of any Hydra app took
    the seconds of torch's import in each of its processes."""
    (tmp_path / "app.py").write_text(TORCHLESS_APP)
    result = subprocess.run([sys.executable, "app.py", "-m", f"hydra/launcher={name}", "+x=1,2", f"+out={tmp_path}",
                             f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path,
                            env={**user_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "launching process imported torch: False"
    assert [(tmp_path / f"job{x}").read_text() for x in (1, 2)] == ["False", "False"]
