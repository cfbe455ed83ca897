"""`src.launch.frozen`: an import kept out of the garbage collector's walks, the collector left as it was, and a
training command importing torch and Lightning through it."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import QUICK, REPO, run_cli, user_env

# Two modules of a fresh interpreter's own: one imported through `frozen`, one the usual way after it.
MODULES = {"through_frozen.py": "class Made:\n    pass\n", "usual.py": "class Made:\n    pass\n"}

CHECK = textwrap.dedent("""
    import gc, json, sys
    from src.launch import frozen
    gc.enable() if sys.argv[1] == "on" else gc.disable()
    walked = lambda obj: any(o is obj for o in gc.get_objects())  # the collector's generations, not its frozen one
    frozen_module = frozen.import_module("through_frozen")
    after = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
    import usual
    before_again = gc.get_freeze_count()
    again = frozen.import_module("usual")  # imported already: returned as it is, nothing more frozen
    frozen_by_again = gc.get_freeze_count() - before_again
    walks = {"frozen_walked": walked(frozen_module.Made), "usual_walked": walked(usual.Made)}
    try:
        frozen.import_module("no_such_module")
        missing = None
    except ModuleNotFoundError:
        missing = gc.isenabled()
    print(json.dumps({**after, **walks, "again_same": again is usual, "frozen_by_again": frozen_by_again, "enabled_after_missing": missing}))
""")


@pytest.mark.parametrize("collector", ["on", "off"])
def test_an_import_through_it_leaves_the_walks_and_the_collector_is_as_it_was(tmp_path, collector):
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    env = {**user_env(), "PYTHONPATH": f"{tmp_path}:{REPO}"}
    result = subprocess.run([sys.executable, "-c", CHECK, collector], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["enabled"] is seen["enabled_after_missing"] is (collector == "on")
    assert seen["frozen"] > 0 and not seen["frozen_walked"]
    assert seen["usual_walked"] and seen["again_same"] and seen["frozen_by_again"] == 0


def test_a_training_command_runs_with_torch_and_lightning_frozen(tmp_path, data_root):
    """In a new interpreter, as a user starts it: inside the run, Lightning's Trainer class is out of the collector's
    walks, and the collector still runs for what the run makes."""
    probe = ["+callbacks.probe._target_=tests.probes.ShowCollector"]
    result = run_cli("src.train", *QUICK, *probe, f"hydra.run.dir={tmp_path / 'run'}", interpreter=True)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stdout.splitlines() if line.startswith("collector rank 0:")]
    assert line == "collector rank 0: enabled=True trainer_walked=False"
