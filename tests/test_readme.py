"""The README's commands, copied as a user copies them, run in a fresh shell.

Each train and eval command runs verbatim through `bash -c`, with no virtualenv activated (no
`.venv/bin` on PATH, no VIRTUAL_ENV), in a checkout of its own: a folder holding this checkout's
`src/`, `conf/`, `pyproject.toml` and `.venv/` (links), with `../shared/data` beside it pointing at
the offline Fashion-MNIST copy, as on the machine the README describes. Its `data/` folder is
what the first run would have downloaded (a link to the same copy), since these tests have no
network. Its own `outputs/` keeps the runs out of this checkout.

A command that would train more than one full epoch (the README's default is 10) gets
` debug=quick` appended, after its trailing comment is dropped: one epoch of 4 batches, so the
test takes seconds and still runs everything the command does (folders, checkpoints, the result
line, the sweep's report). The setup and test commands are not run (the setup installs, the test
command is this suite); they must be the very lines `.ci/run` runs.
"""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from src.checks import CONF_DIR
from tests.helpers import DATA_ROOT, REPO, user_env

README = REPO / "README.md"
CHECKOUT_PARTS = ("src", "conf", "pyproject.toml", ".venv")
RESULT = r"test/acc=\d\.\d{4} val/acc_best=\d\.\d{4} median epoch \d+\.\d\d s \(.+\) -> \S*/outputs/(runs|multirun)/"
EVAL_RESULT = r"test/acc=\d\.\d{4} test/loss=\d+\.\d{4} \(.+\) of .+ -> \S*/outputs/eval/"


def section_commands(title: str) -> list[str]:
    """The lines of the ```bash blocks under the README's `## <title>` heading."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end if end > 0 else None], flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def without_comment(command: str) -> str:
    return re.sub(r"\s+#\s.*$", "", command)


def epochs_trained(command: str) -> int:
    """Full training epochs the command would run: max_epochs unless batches are limited (a sweep's first values)."""
    args = shlex.split(without_comment(command))
    overrides = [arg if "," not in arg or "[" in arg else arg.split(",")[0] for arg in args[args.index("src.train") + 1:]
                 if "=" in arg and not arg.startswith("-")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return cfg.max_epochs if cfg.trainer.limit_train_batches is None else 0


def as_run(command: str) -> str:
    """The command as the test runs it: verbatim, or with ` debug=quick` appended (see the module's docstring)."""
    return f"{without_comment(command)} debug=quick" if epochs_trained(command) > 1 else command


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A checkout root with ../shared/data beside it, and data/ as a first run leaves it."""
    root = tmp_path_factory.mktemp("fresh")
    (root / "shared").mkdir()
    (root / "shared" / "data").symlink_to(DATA_ROOT)
    repo = root / "checkout"
    repo.mkdir()
    for part in CHECKOUT_PARTS:
        (repo / part).symlink_to(REPO / part)
    (repo / "data").symlink_to(DATA_ROOT)
    return repo


def fresh_shell(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`bash -c command` as in a new terminal: no virtualenv on PATH or in the environment."""
    env = {k: v for k, v in user_env().items() if k not in ("VIRTUAL_ENV", "FASHION_MNIST_ROOT", "PYTHONHOME")}
    venv_bin = str(REPO / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(venv_bin).resolve())
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_setup_and_test_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for title in ("Install", "Test"):
        commands = section_commands(title)
        assert commands, f"no command under ## {title}"
        for command in commands:
            assert command in ci, f"README's {title} command is not a line of .ci/run: {command}"


def test_the_commands_run_in_a_shell_without_the_virtualenv(checkout):
    result = fresh_shell("command -v python; echo ${VIRTUAL_ENV:-none}", checkout)
    found, virtual_env = result.stdout.split("\n")[:2]
    assert ".venv" not in found and virtual_env == "none"


TRAIN = section_commands("Train")
SLOW = r"devices=[\d,]*4\b"  # four processes (a sweep job or a run): minutes on a 2-core machine


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if re.search(SLOW, c) else c for c in TRAIN])
def test_a_readme_train_command_runs_as_written(checkout, command):
    before = set((checkout / "outputs").glob("*/*"))
    result = fresh_shell(as_run(command), checkout)
    assert result.returncode == 0, f"{as_run(command)}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if re.search(RESULT, line)]
    new = set((checkout / "outputs").glob("*/*")) - before
    if " -m " in f" {command.split('src.train', 1)[1]} ":  # a sweep: one result line per job, then its report
        jobs = [p for sweep in new for p in sweep.iterdir() if (p / "config.yaml").is_file()]
        assert len(lines) == len(jobs) > 1 and all((sweep / "report.md").is_file() for sweep in new)
    else:
        assert len(lines) == 1 and len(new) == 1
        assert (next(iter(new)) / "checkpoints" / "last.ckpt").is_file()


def test_the_readme_eval_commands_score_the_newest_run(checkout):
    """After a README train command, the eval block runs as one script: its lines share the shell."""
    if not any((checkout / "outputs" / "runs").glob("*")):
        assert fresh_shell(as_run(TRAIN[0]), checkout).returncode == 0
    script = "set -e\n" + "\n".join(section_commands("Evaluate a checkpoint"))
    result = fresh_shell(script, checkout)
    assert result.returncode == 0, f"{script}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if re.search(EVAL_RESULT, line)]
    assert len(lines) == len([c for c in section_commands("Evaluate a checkpoint") if "src.eval" in c]) >= 1
