"""The README's commands, copied as a user copies them, run in a fresh shell.

Each train and eval command runs verbatim through `bash -c` in the shell of a stock system: PATH
only /usr/local/bin, /usr/bin and /bin (where Debian and Ubuntu have `python3` and often no
`python`), no virtualenv activated (no VIRTUAL_ENV), in a checkout of its own: a folder holding
this checkout's `src/`, `conf/`, `pyproject.toml` and `.venv/` (links), with `../shared/data`
beside it pointing at the offline Fashion-MNIST copy, as on the machine the README describes. Its `data/` folder is
what the first run would have downloaded (a link to the same copy), since these tests have no
network. Its own `outputs/` keeps the runs out of this checkout.

A command that would train one full epoch or more (the README's default is 10) gets
` debug=quick` appended, after its trailing comment is dropped: one epoch of 4 batches, so the
test takes seconds and still runs everything the command does (folders, checkpoints, the result
line, the sweep's report). A command of four processes also gets one batch of each kind, of 8
images a process (`SMALLEST`): ResNet-18 with bf16 emulated on 2 cores would take minutes. Each
command runs once; the tests below read what it left. The setup and test commands are not run
(the setup installs, the test command is this suite); they must be the very lines `.ci/run` runs.
The train commands are those of the sections Train, DDP and Sweep, and View's run that logs to MLflow too, whose
line naming its run's page is checked against the store; the eval commands, those of "Evaluate a checkpoint".
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from src.config import CONF_DIR
from tests.helpers import (DATA_ROOT, REPO, assert_finished_run, cpu_precision, free_port, hparams, once, scalars,
                           user_env)

README = REPO / "README.md"
CHECKOUT_PARTS = ("src", "conf", "pyproject.toml", ".venv")
RESULT = (r"test/acc=\d\.\d{4} val/acc_best=\d\.\d{4} median epoch \d+\.\d\d s, \S+ TFLOP/s a device(, MFU \d+\.\d %)?, "
          r"peak memory \d+ MiB \(.+\) -> \S*/outputs/(runs|multirun)/")
EVAL_RESULT = r"test/acc=\d\.\d{4} test/loss=\d+\.\d{4} \(.+\) of .+ -> \S*/outputs/eval/"


def section_commands(title: str) -> list[str]:
    """The lines of the ```bash blocks under the README's `## <title>` heading, up to the next one."""
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


SLOW = r"devices=[\d,]*4\b"  # four processes (a sweep job or a run): minutes on a 2-core machine
# For four processes on 2 cores, on top of debug=quick: one batch of each kind, of 8 images a process.
SMALLEST = ("trainer.limit_train_batches=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "trainer.num_sanity_val_steps=0", "data.batch_size=32")


def as_run(command: str) -> str:
    """The command as the test runs it: verbatim, or with ` debug=quick` appended (see the module's docstring)."""
    if epochs_trained(command) < 1:
        return command
    return " ".join((without_comment(command), "debug=quick", *(SMALLEST if re.search(SLOW, command) else ())))


def overrides(command: str) -> list[str]:
    args = shlex.split(without_comment(command))
    return [arg for arg in args[args.index("src.train") + 1:] if "=" in arg]


def is_sweep(command: str) -> bool:
    return " -m " in f" {command.split('src.train', 1)[1]} "


def processes(command: str) -> int:
    """The processes a run of the command trains on: its devices under DDP, else one."""
    values = dict(arg.split("=", 1) for arg in overrides(command))
    return int(values.get("devices", 1)) if values.get("strategy", "auto").startswith("ddp") else 1


def sweep_jobs(command: str) -> dict[str, dict[str, str]]:
    """A sweep's job folders (`lenet_ddp_2dev_32-true`: model, strategy, devices, precision used), each
    with the values it sweeps; for sweeps over those keys only, as the README's are."""
    swept = [arg.split("=", 1) for arg in overrides(command) if "," in arg]
    assert {key for key, _ in swept} <= {"model", "strategy", "devices"}, command
    precision = cpu_precision()  # what precision=auto uses here
    jobs = [dict(arg.split("=", 1) for arg in overrides(command) if "," not in arg and "=" in arg)]
    for key, values in swept:
        jobs = [{**job, key: value} for job in jobs for value in values.split(",")]
    return {f"{job.get('model', 'lenet')}_{job['strategy']}_{job['devices']}dev_{precision}": job for job in jobs}


def make_checkout(root: Path) -> Path:
    """A checkout root in `root`, with ../shared/data beside it, and data/ as a first run leaves it."""
    (root / "shared").mkdir()
    (root / "shared" / "data").symlink_to(DATA_ROOT)
    repo = root / "checkout"
    repo.mkdir()
    for part in CHECKOUT_PARTS:
        (repo / part).symlink_to(REPO / part)
    (repo / "data").symlink_to(DATA_ROOT)
    return repo


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return make_checkout(tmp_path_factory.mktemp("fresh"))


STOCK_PATH = "/usr/local/bin:/usr/bin:/bin"  # what a login shell of stock Debian or Ubuntu has: `python3`, and often no `python`


def fresh_shell(command: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`bash -c command` as in a new terminal of a stock system: PATH only the system's folders, no virtualenv
    on it or in the environment.

    The timeout only bounds a hang: ResNet-18 on 4 CPU processes with bf16 emulated took 530 s on
    the 2-core machine under load, before `SMALLEST`."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=stock_env(), capture_output=True, text=True,
                          timeout=timeout)


def stock_env() -> dict[str, str]:
    env = {k: v for k, v in user_env().items() if k not in ("VIRTUAL_ENV", "FASHION_MNIST_ROOT", "PYTHONHOME", "PYTHONPATH")}
    return env | {"PATH": STOCK_PATH}


def test_the_setup_and_test_commands_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for title in ("Install", "Test"):
        commands = section_commands(title)
        assert commands, f"no command under ## {title}"
        for command in commands:
            assert command in ci, f"README's {title} command is not a line of .ci/run: {command}"


@pytest.mark.slow
def test_the_commands_run_in_a_shell_without_the_virtualenv(checkout):
    """The shell the commands run in has no virtualenv, and may have no `python`: each README command names
    `python3` (to make the virtualenv) or the virtualenv's own interpreter."""
    result = fresh_shell('echo "VIRTUAL_ENV=${VIRTUAL_ENV:-}"; command -v python3; command -v python || true', checkout)
    assert result.returncode == 0, result.stderr
    virtual_env, *found = result.stdout.splitlines()
    assert virtual_env == "VIRTUAL_ENV=" and found and found[0].endswith("/python3")
    assert not any(".venv" in path for path in found)
    text = README.read_text()
    commands = [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]
    bare = [line for line in commands if re.search(r"(^|[\s;&|(])python\b(?!3)", without_comment(line))]
    assert commands and not bare, f"README commands that need a `python` on PATH: {bare}"


# The commands that train: the first run, DDP, the sweep, and the run that logs to MLflow too (View).
TRAIN = [*section_commands("Train"), *section_commands("DDP"), *section_commands("Sweep"),
         *(c for c in section_commands("View") if "src.train" in c)]
SWEEPS = [c for c in TRAIN if is_sweep(c)]


@dataclass(frozen=True)
class Ran:
    """A README command's run: its result, its checkout, the folders it added under outputs/, and this checkout's
    outputs/ before and after."""

    result: subprocess.CompletedProcess
    checkout: Path
    new: set[Path]
    ours_before: list[Path]
    ours_after: list[Path]


def snapshot(folder: Path) -> list[Path]:
    return sorted(p.relative_to(folder) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Callable[[str], Ran]:
    """Runs a README command once for the suite, in a fresh checkout of its own (`once`: the tests of a command on
    both test processes read one run); each call returns what that run left."""

    def run(command: str) -> Ran:
        def make(folder: Path) -> None:
            checkout, ours = make_checkout(folder), snapshot(REPO / "outputs")
            result = fresh_shell(as_run(command), checkout)
            (folder / "ran.json").write_text(json.dumps({
                "result": [result.args, result.returncode, result.stdout, result.stderr],
                "new": [str(p) for p in (checkout / "outputs").glob("*/*")],
                "ours": [[str(p) for p in paths] for paths in (ours, snapshot(REPO / "outputs"))]}))

        folder = once(tmp_path_factory, "readme_" + hashlib.sha1(command.encode()).hexdigest()[:12], make)
        said = json.loads((folder / "ran.json").read_text())
        return Ran(subprocess.CompletedProcess(*said["result"]), folder / "checkout", {Path(p) for p in said["new"]},
                   *([Path(p) for p in paths] for paths in said["ours"]))

    return run


def appended(command: str) -> str:
    return as_run(command).removeprefix(without_comment(command))


def sweep_job(command: str) -> tuple[str, str] | None:
    """The README sweep, and its job's folder name, that runs this one-run command exactly: same values, same
    arguments appended. Its ranks are the job's, so the command is checked on that job rather than started again."""
    if is_sweep(command):
        return None
    values = dict(arg.split("=", 1) for arg in overrides(command))
    for sweep in SWEEPS:
        for name, job in sweep_jobs(sweep).items():
            if job == values and appended(sweep) == appended(command):
                return sweep, name
    return None


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in TRAIN if not is_sweep(c) and sweep_job(c) is None])
def test_a_readme_train_command_runs_as_written(ran, command):
    result, new = ran(command).result, ran(command).new
    assert result.returncode == 0, f"{as_run(command)}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if re.search(RESULT, line)]
    assert len(lines) == 1 and len(new) == 1
    run_dir = next(iter(new))
    assert_finished_run(result, run_dir)
    assert hparams(run_dir)["world_size"] == processes(command)


@pytest.mark.slow
@pytest.mark.parametrize("command", SWEEPS)
def test_a_readme_sweep_runs_as_written_each_job_in_its_own_folder(ran, command):
    """Each job in a folder named by its swept values, with its own TensorBoard run, logs and checkpoint; no other
    folder. The README's one-run commands that are jobs of the sweep are checked on those jobs (`sweep_job`)."""
    run = ran(command)
    assert run.result.returncode == 0, f"{as_run(command)}\n{run.result.stderr[-3000:]}"
    [sweep] = run.new
    jobs = sweep_jobs(command)
    # Each job's result line once, in its progress line (`job n/N done: <job>: <result line> ...`); a job's own lines
    # go to its train.log, not to the terminal.
    done = [line for line in run.result.stdout.splitlines() if re.match(rf"job \d+/{len(jobs)} done: ", line)]
    assert len(done) == len(jobs) > 1 and all(re.search(RESULT, line) for line in done)
    assert not [line for line in run.result.stdout.splitlines() if re.search(RESULT, line) and not line.startswith("job ")]
    assert {p.name for p in sweep.iterdir() if p.is_dir() and p.name != "report"} == set(jobs)
    for name, values in jobs.items():
        job = sweep / name
        devices = int(values.get("devices", 1))
        params = hparams(job)
        assert (params["strategy"], params["world_size"]) == (values["strategy"], devices)
        assert {"train/loss", "val/acc", "test/acc", "time/epoch_s"} <= set(scalars(job))
        # One TensorBoard run per job: event files only in the job folder, from one process.
        assert {p.parent for p in sweep.rglob("events.out.tfevents.*") if name in str(p)} == {job}
        assert len({p.name.split(".")[4] for p in job.glob("events.out.tfevents.*")}) == 1
        # Rank 0 logs to train.log; another rank's log exists only if that rank had something to say.
        rank_logs = list(job.glob("train_rank_*.log"))
        assert {p.name for p in rank_logs} <= {f"train_rank_{r}.log" for r in range(1, devices)}
        assert all(p.stat().st_size > 0 for p in rank_logs)
        assert (job / ".hydra" / "config.yaml").is_file() and (job / "checkpoints" / "last.ckpt").is_file()
    # Workers ran their own job only: no stray sweep or run folders anywhere else.
    assert run.ours_after == run.ours_before
    assert not (run.checkout / "lightning_logs").exists() and not (REPO / "lightning_logs").exists()
    assert sum(line.count("test/acc=") for line in done) == len(jobs)
    # The sweep writes its report when it ends: one row per job.
    assert (sweep / "report.md").is_file() and len((sweep / "report.csv").read_text().splitlines()) == len(jobs) + 1
    # A README command of one run that is one of these jobs: the job's result line, folder and world size, as the
    # command's own run has them.
    for one_run, name in [(c, job[1]) for c in TRAIN if (job := sweep_job(c)) and job[0] == command]:
        lines = [line for line in done if f" done: {name}: " in line and re.search(rf"-> \S*/{re.escape(name)}\b", line)]
        assert len(lines) == 1, run.result.stdout[-3000:]
        assert_finished_run(run.result, sweep / name)
        assert hparams(sweep / name)["world_size"] == processes(one_run)


@pytest.mark.slow
def test_the_readme_eval_commands_score_the_newest_run(ran):
    """After the README's first train command, in its checkout, the eval block runs as one script: its lines share
    the shell."""
    first = ran(TRAIN[0])
    assert first.result.returncode == 0
    script = "set -e\n" + "\n".join(section_commands("Evaluate a checkpoint"))
    result = fresh_shell(script, first.checkout)
    assert result.returncode == 0, f"{script}\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if re.search(EVAL_RESULT, line)]
    assert len(lines) == len([c for c in section_commands("Evaluate a checkpoint") if "src.eval" in c]) >= 1


MLFLOW_PAGE = r"MLflow run: \S+ ui --backend-store-uri (\S+), then (http://127\.0\.0\.1:5000/#/experiments/(\w+)/runs/(\w+))$"


@pytest.mark.slow
def test_the_readme_mlflow_run_names_its_page_in_the_store_the_readme_serves(ran):
    """The View section's run with MLflow prints its run's page by the store's own experiment and run ids, in the
    store that the section's `mlflow ui` command serves from the checkout; the run is named as its folder."""
    from mlflow.tracking import MlflowClient

    [command] = [c for c in TRAIN if "logger=mlflow" in c]
    run = ran(command)
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    [(store, _, experiment, run_id)] = re.findall(MLFLOW_PAGE, run.result.stdout + run.result.stderr, flags=re.M)
    [ui] = [c for c in section_commands("View") if re.match(r"\.venv/bin/mlflow ui ", c)]
    served = shlex.split(without_comment(ui))[shlex.split(ui).index("--backend-store-uri") + 1]
    assert Path(store.removeprefix("sqlite:///")) == run.checkout / served.removeprefix("sqlite:///")
    found = MlflowClient(store).get_run(run_id)
    [run_dir] = run.new
    assert found.info.experiment_id == experiment and found.info.run_name == run_dir.name


BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
READY_S = 180  # the MLflow server's start: tens of seconds on a loaded 2-core machine


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium (Debian: apt-get install chromium)")
def test_the_page_the_readme_mlflow_run_names_shows_the_run_in_a_browser(ran, tmp_path):
    """The View section's `mlflow ui` command, on a free port, serves the address the run printed: in headless
    Chromium it is the run's own page, headed by the run's name (not MLflow's start page, which opens on GenAI)."""
    [command] = [c for c in TRAIN if "logger=mlflow" in c]
    run = ran(command)
    assert run.result.returncode == 0, run.result.stderr[-3000:]
    [(_, address, _, run_id)] = re.findall(MLFLOW_PAGE, run.result.stdout + run.result.stderr, flags=re.M)
    [ui] = [c for c in section_commands("View") if re.match(r"\.venv/bin/mlflow ui ", c)]
    port = free_port()
    server = subprocess.Popen(["bash", "-c", f"exec {without_comment(ui)} --port {port}"], cwd=run.checkout,
                              env=stock_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while True:
            assert server.poll() is None, f"mlflow ui exited: {server.stderr.read()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"mlflow ui not serving after {READY_S} s"
            time.sleep(0.5)
        page = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}",
                               "--virtual-time-budget=30000", "--dump-dom",
                               address.replace("127.0.0.1:5000", f"127.0.0.1:{port}")],
                              capture_output=True, text=True, timeout=600).stdout
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and its workers
        server.wait(timeout=60)
    [run_dir] = run.new
    assert f"<title>Run {run_id} - MLflow</title>" in page
    assert re.search(rf">\s*{re.escape(run_dir.name)}\s*<", page), page[-2000:]
