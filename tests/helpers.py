"""Shared test helpers: run the real command line, read TensorBoard scalars, write tiny IDX files."""

import contextlib
import copy
import fcntl
import gzip
import io
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader


# Set by torchrun, torch's elastic agent or Lightning for the processes they start; a user's shell has none.
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
REPO = Path(__file__).resolve().parent.parent
# The offline copy beside the checkout (see the README); FASHION_MNIST_ROOT points elsewhere.
DATA_ROOT = Path(os.environ.get("FASHION_MNIST_ROOT", REPO.parent / "shared" / "data")).resolve()
# Keeps command-line tests small (conf/debug/quick.yaml: one short epoch, few batches, no progress
# bar) on the offline data, which is machine-specific and so not part of that file.
QUICK = [f"data.root={DATA_ROOT}", "debug=quick"]
# The interpreter as a command started in the checkout names it, to be run from there (src.errors.interpreter).
INTERPRETER = str(Path(sys.executable).relative_to(REPO)) if Path(sys.executable).is_relative_to(REPO) else sys.executable


def cpu_precision() -> str:
    """The precision `precision=auto` runs at on this machine's CPU, as Lightning names it (and run folders show it)."""
    from src.fast_path import auto_precision

    return {"bf16-mixed": "bf16-mixed", "32": "32-true"}[auto_precision("cpu")]


# The global batch and learning rate of the session's shared DDP run (conftest.py's `ddp_run`): linear
# scaling from a base batch of 32, so that one run also shows the rate that scaling gives.
LINEAR_LR = ["data.batch_size=128", "optim.lr=0.05", "optim.lr_scaling=linear", "optim.base_batch_size=32"]
EVENTS = "events.out.tfevents.*"
# A warning as Python prints it (`warnings.formatwarning`): `<file>:<line>: <Category>: <message>`, or as Lightning's
# formatter prints its own, `<file>:<line>: <message>`.
WARNING_LINE = re.compile(r"^.+\.py:\d+: .*$", re.M)
INTERFACE_SCALARS = {"train/loss", "train/acc", "val/acc", "test/acc", "time/epoch_s", "time/samples_per_s"}


@dataclass(frozen=True)
class Run:
    """A finished command: its result (exit status, output) and its run folder."""

    result: subprocess.CompletedProcess
    dir: Path

    def copy(self, folder: Path) -> Path:
        """The run folder copied to `folder/run`, for a test that goes on in it (resumes, or starts there again)."""
        return Path(shutil.copytree(self.dir, folder / "run"))


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's temporary folder that every test process (`-n`) sees: the one above each test process's own."""
    folder = tmp_path_factory.getbasetemp()
    return folder.parent if os.environ.get("PYTEST_XDIST_WORKER") else folder


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """`make(folder)` once for the suite, by the first test process that asks (`-n`): the others wait for it, then read
    the folder. A `make` that fails is tried again by the next test that asks."""
    shared = shared_folder(tmp_path_factory)
    folder, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed `make` left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def trained_once(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str, here: bool = False) -> Run:
    """A run (or a sweep: `-m` in `args`) trained `once` for the tests that read it, in this process where one process
    trains it: its folder, and its output as the command printed it."""

    def make(folder: Path) -> None:
        where = f"hydra.{'sweep' if '-m' in args else 'run'}.dir={folder / 'run'}"
        result = command_here("src.train", *args, where) if here else train(*args, where)
        said.write_text(json.dumps([result.args, result.returncode, result.stdout, result.stderr]))

    said = shared_folder(tmp_path_factory) / f"{name}.json"  # beside `once`'s folder: the run's folder is alone in it
    folder = once(tmp_path_factory, name, make)
    result = subprocess.CompletedProcess(*json.loads(said.read_text()))
    assert result.returncode == 0, result.stderr[-3000:]
    return Run(result, folder / "run")


def assert_finished_run(result: subprocess.CompletedProcess, run_dir: Path) -> dict[str, list[float]]:
    """A run that ended well: its result line, every interface scalar, its configs and checkpoints."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc=" in result.stdout
    series = scalars(run_dir)
    assert INTERFACE_SCALARS <= set(series), sorted(series)
    assert all(v > 0 for v in series["time/epoch_s"] + series["time/samples_per_s"])
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    resolved = OmegaConf.load(run_dir / "config.yaml")
    assert "${" not in OmegaConf.to_yaml(resolved) and resolved.output_dir == str(run_dir)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert any(p.name.startswith("best-") for p in (run_dir / "checkpoints").iterdir())
    # No leftovers: Lightning's hparams.yaml holding {}, an empty rank log. One event file, the points, the
    # HParams record after them: TensorBoard reads a run's files in the order of their names, which need not
    # be the order they were written in (`.10` before `.9`).
    assert not (run_dir / "hparams.yaml").exists()
    [events] = run_dir.glob(EVENTS)
    assert any(e.summary.value and e.summary.value[0].metadata.plugin_data.plugin_name == "hparams"
               for e in EventFileLoader(str(events)).Load())
    assert all(log.stat().st_size > 0 for log in run_dir.glob("train*.log"))
    return series


def user_env() -> dict[str, str]:
    """This environment without the rank variables a launcher sets, as in a user's fresh shell."""
    env = {name: value for name, value in os.environ.items() if name not in RANK_ENV}
    return {**env, "PYTHONUNBUFFERED": "1"}


def start_ranks(worker: Callable[..., None], *args: object, nprocs: int) -> None:
    """`worker(rank, *args)` in `nprocs` new processes (torch's spawn), waited for."""
    import torch.multiprocessing

    torch.multiprocessing.start_processes(worker, args, nprocs=nprocs, start_method="spawn")


def _torchrun_rank(rank: int, world: int, runs: list[list[str]], ports: list[int], also: list[Callable[[int], None]],
                   results: str) -> None:
    import torch.distributed as dist

    said = []
    for args, port in zip(runs, ports):
        os.environ.update(RANK=str(rank), GROUP_RANK="0", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        result = command_here("src.train", *args)
        if dist.is_initialized():  # torchrun's rank would end here; this one goes on to the next run
            dist.destroy_process_group()
        said.append([result.args, result.returncode, result.stdout, result.stderr])
    Path(f"{results}.{rank}").write_text(json.dumps(said))
    for work in also:
        work(rank)


def train_as_torchrun(runs: list[list[str]], folder: Path, nprocs: int = 2, also: Sequence[Callable[[int], None]] = ()
                      ) -> list[subprocess.CompletedProcess]:
    """`python -m src.train <args>` for each run in turn, on `nprocs` ranks that each run the command line, as torchrun
    starts a run's ranks, but started once for all the runs: for tests of what DDP runs compute and log, not of how
    their processes start. Every run ends well on every rank; rank 0's output of each run. Then each rank calls each of
    `also` (importable: the ranks are spawned) with its rank: a test's own collectives, in a process group of their own,
    on the same start."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several processes a node, in theirs
    try:
        start_ranks(_torchrun_rank, nprocs, runs, [free_port() for _ in runs], list(also), str(folder / "said"),
                    nprocs=nprocs)
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
    ranks = [[subprocess.CompletedProcess(*said) for said in json.loads((folder / f"said.{rank}").read_text())]
             for rank in range(nprocs)]
    for rank, results in enumerate(ranks):
        for result in results:
            assert result.returncode == 0, f"rank {rank}: {result.args}\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return ranks[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(module: str, *args: str, timeout: float = 300, cwd: Path = REPO, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` as a user runs it: a new process, its output captured."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env or user_env(), capture_output=True,
                          text=True, timeout=timeout)


def start_cli(module: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, new_session: bool = False,
              merged: bool = False) -> subprocess.Popen:
    """`python -m <module> <args>` started, not waited for: in a session of its own with `new_session` (a test can
    then signal all of its processes at once), stderr into stdout with `merged` (as a terminal shows both)."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env or user_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                            start_new_session=new_session)


def train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m src.train <args>`."""
    return run_cli("src.train", *args, timeout=timeout)


def call_main(main: Callable[[list[str]], object], *args: str) -> subprocess.CompletedProcess:
    """`main(args)` of a command that takes its argument list (src.report, src.scaling) in this process, with its exit
    status and output as `run_cli` returns them."""
    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(list(args))
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(list(args), status, stdout.getvalue(), stderr.getvalue())


# Warning filters that modules installed as this process imported them, where the filters were put back afterwards
# (pytest puts them back once it has loaded conftest.py, once it has collected, and after each test): a new process of
# a command has them from its own imports. conftest.py notes them (`note_import_filters`).
IMPORT_FILTERS: list[tuple] = []
# The project's own modules, whose globals a command may rebind or fill (naming's claimed folders, cli's `_prepare`).
PROJECT_MODULES = ("src", "hydra_plugins.project_launchers")
LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities")


def note_import_filters(before: Sequence[tuple]) -> None:
    """Keep the warning filters installed since `before` was read, by the imports in between, for `command_here`."""
    IMPORT_FILTERS[:0] = [f for f in warnings.filters if f not in before and f not in IMPORT_FILTERS]


def new_process_filters() -> list[tuple]:
    """The warning filters of a new process of a command once it has imported its modules: those `IMPORT_FILTERS`
    keeps, over the ones this process started with (Python's own, its -W options, and those of imports outside any
    `catch_warnings`: `_warnings.filters` is the list that `catch_warnings` puts back last)."""
    import _warnings

    return [*IMPORT_FILTERS, *(f for f in _warnings.filters if f not in IMPORT_FILTERS)]


def _show_as_python_does(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                         file: Any = None, line: str | None = None) -> None:
    """`warnings.showwarning`'s text, on the standard error as it is now (the command's), where pytest records it."""
    (sys.stderr if file is None else file).write(warnings.formatwarning(message, category, filename, lineno, line))


class Bound:
    """An object, compared by identity, and what it held when it was read (a copy), compared by value."""

    def __init__(self, value: object, held: object = None) -> None:
        self.value, self.held = value, held

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Bound) and self.value is other.value and self.held == other.held

    def __repr__(self) -> str:
        return f"Bound({type(self.value).__name__} at {id(self.value):#x}, {self.held!r})"


def _modules(packages: Sequence[str]) -> dict[str, Any]:
    return {name: module for name, module in list(sys.modules.items())
            if module is not None and any(name == p or name.startswith(f"{p}.") for p in packages)}


def _project_globals() -> dict[str, dict[str, Bound]]:
    """Each global of the project's modules: what it is bound to and, for a dict, list or set, what that holds."""
    return {name: {key: Bound(value, copy.copy(value) if type(value) in (dict, list, set) else None)
                   for key, value in list(vars(module).items()) if not key.startswith("__")}
            for name, module in _modules(PROJECT_MODULES).items()}


def _warned_once() -> list[set]:
    """Lightning's sets of the messages it warns of once a process (`WarningCache`): a new process starts them empty."""
    kind = getattr(sys.modules.get("lightning_utilities.core.rank_zero"), "WarningCache", None)
    if kind is None:
        return []
    found = {id(value): value for module in _modules(LIGHTNING_PACKAGES).values()
             for value in list(vars(module).values()) if isinstance(value, kind)}
    return list(found.values())


def _rank_zero_only() -> list[Callable]:
    """Lightning's `rank_zero_only` (one function, or one a package), whose `rank` says which rank this process logs as."""
    found = {}
    for name in ("lightning_utilities.core.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning_fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero",
                 "pytorch_lightning.utilities.rank_zero"):
        function = getattr(sys.modules.get(name), "rank_zero_only", None)
        if function is not None:
            found[id(function)] = function
    return list(found.values())


def _loggers() -> dict[str, logging.Logger]:
    return {"": logging.root, **{name: logger for name, logger in list(logging.Logger.manager.loggerDict.items())
                                 if isinstance(logger, logging.Logger)}}


def _random_states() -> dict[str, object]:
    """Python's, numpy's and torch's global random states, as `seed_everything` sets them (torch's where imported)."""
    name, key, position, has_gauss, gauss = np.random.get_state()
    states = {"random": random.getstate(), "numpy": (name, key.tobytes(), position, has_gauss, gauss)}
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = torch.random.get_rng_state().numpy().tobytes()
        if torch.cuda.is_initialized():
            states["cuda"] = tuple(state.numpy().tobytes() for state in torch.cuda.get_rng_state_all())
    return states


def _signal_handlers() -> dict[int, object]:
    handlers = {}
    for signum in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            handlers[signum] = signal.getsignal(signum)
    return handlers


def process_state() -> dict[str, object]:
    """What a command run in this process may change of it, each part comparable with ==: `command_here` puts it back,
    and a test compares it before and after."""
    return {
        "argv": list(sys.argv), "cwd": os.getcwd(), "environ": dict(os.environ), "signals": _signal_handlers(),
        "loggers": {name: (logger.level, logger.propagate, logger.disabled, tuple(logger.handlers), tuple(logger.filters))
                    for name, logger in _loggers().items()},
        "logging_disabled": logging.root.manager.disable,
        "warnings": (list(warnings.filters), dict(warnings.onceregistry), warnings.showwarning),
        "warned_once": [Bound(cache, set(cache)) for cache in _warned_once()],
        "random": _random_states(),
        "rank_zero_only": [Bound(function, getattr(function, "rank", None)) for function in _rank_zero_only()],
        "modules": _project_globals(),
    }


def put_back(state: dict[str, Any]) -> None:
    """`state` (`process_state`) again; a handler a logger got since is closed. Modules and loggers new since are left
    as their imports made them."""
    sys.argv = list(state["argv"])
    os.chdir(state["cwd"])
    if dict(os.environ) != state["environ"]:
        os.environ.clear()
        os.environ.update(state["environ"])
    for signum, handler in state["signals"].items():
        if handler is not None and signal.getsignal(signum) != handler:
            signal.signal(signum, handler)
    loggers, kept = _loggers(), {handler for *_, handlers, _ in state["loggers"].values() for handler in handlers}
    for name, (level, propagate, disabled, handlers, filters) in state["loggers"].items():
        logger = loggers[name]
        for handler in logger.handlers:
            if handler not in kept:
                handler.close()
        logger.handlers[:], logger.filters[:], logger.propagate, logger.disabled = handlers, filters, propagate, disabled
        if logger.level != level:
            logger.setLevel(level)
    logging.disable(state["logging_disabled"])
    filters, once, show = state["warnings"]
    if warnings.filters != filters:
        warnings.filters[:] = filters
    if warnings.onceregistry != once:
        warnings.onceregistry.clear()
        warnings.onceregistry.update(once)
    warnings.showwarning = show
    for cache in state["warned_once"]:
        cache.value.clear()
        cache.value.update(cache.held)
    _put_back_random(state["random"])
    for function in state["rank_zero_only"]:
        if function.held is None:
            vars(function.value).pop("rank", None)
        else:
            function.value.rank = function.held
    for name, bound in state["modules"].items():
        names = vars(sys.modules[name]) if name in sys.modules else {}
        for key, saved in bound.items():
            if names.get(key) is not saved.value:
                names[key] = saved.value
            if saved.held is not None and saved.value != saved.held:
                if isinstance(saved.value, list):
                    saved.value[:] = saved.held
                else:
                    saved.value.clear()
                    saved.value.update(saved.held)


def _put_back_random(states: dict[str, Any]) -> None:
    random.setstate(states["random"])
    name, key, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((name, np.frombuffer(key, dtype=np.uint32), position, has_gauss, gauss))
    torch = sys.modules.get("torch")
    if "torch" in states:
        torch.random.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))
    if "cuda" in states:
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(state), dtype=torch.uint8) for state in states["cuda"]])


def command_here(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` (src.train, src.eval) through its own entry in this process, for what a command says
    and leaves rather than what only a process shows (signals, ranks, a new interpreter's environment): its exit
    status and output as `run_cli` returns them, run from `cwd` where one is given. It starts as a new process of it
    would: its modules' warning filters in force (`new_process_filters`), nothing warned of once yet, and the warnings
    it gives printed on its standard error as Python prints them. What it changed of this process is put back
    (`process_state`), and Hydra's current config is cleared."""
    import importlib

    from hydra.core.global_hydra import GlobalHydra

    entry = importlib.import_module(module)
    HydraConfig.instance().cfg = None  # a config a test composed before would be resolved again, and claim its folders
    GlobalHydra.instance().clear()
    saved = process_state()
    stdout, stderr, status = io.StringIO(), io.StringIO(), 0
    sys.argv = [f"{module.replace('.', '/')}.py", *args]
    os.environ["HYDRA_MAIN_MODULE"] = "__main__"  # Hydra then finds conf/ beside the entry's file, as `python -m` does
    try:
        with warnings.catch_warnings():
            warnings.filters[:] = new_process_filters()
            warnings.showwarning = _show_as_python_does
            warnings.onceregistry.clear()
            for cache in _warned_once():
                cache.clear()
            if cwd is not None:
                os.chdir(cwd)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                entry.command()
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        put_back(saved)
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
    return subprocess.CompletedProcess([module, *args], status, stdout.getvalue(), stderr.getvalue())


def train_here(*args: str) -> subprocess.CompletedProcess:
    """`python -m src.train <args>` in this process (`command_here`)."""
    return command_here("src.train", *args)


def train_with_ranks(capfd: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """`train_here` with what its DDP ranks wrote, as a terminal shows a run: the ranks share this process's standard
    output and error (pytest's `capfd` reads them), and their lines come before the launcher's last ones."""
    capfd.readouterr()
    result = train_here(*args)
    ranks = capfd.readouterr()
    return subprocess.CompletedProcess(result.args, result.returncode, ranks.out + result.stdout, ranks.err + result.stderr)


def on_a_trainer(module):
    """`module` attached to a CPU Trainer, as Lightning attaches it before it asks for the optimizers."""
    from lightning.pytorch import Trainer

    module.trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
    return module


def composed(*overrides: str, run_dir: Path | str = "/tmp/run", config_name: str = "train") -> DictConfig:
    """The config `python -m src.train <overrides>` composes, with its folder `run_dir`, for a run in this process (the
    Lightning + Hydra template's way): Hydra's own settings are set for it, as a command's job has them."""
    from src.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.run.dir = cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.job.name = config_name
    HydraConfig.instance().set_config(cfg)
    return cfg


def job_config(*overrides: str, run_dir: Path) -> DictConfig:
    """The config a job of `python -m src.train <overrides>` is given: `composed`, less the `hydra` node, which Hydra
    keeps apart (HydraConfig) and which holds values only a sweep fills."""
    cfg = composed(*overrides, run_dir=run_dir)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def children(pid: int) -> list[int]:
    """A process's children, oldest first ([] for a process that is gone)."""
    pids: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(child) for child in listing.read_text().split()]
    return sorted(pids)


def worker_pids(launcher: int) -> list[int]:
    """A launcher's DDP workers, in the order started: its children that multiprocessing spawned."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    return [child for child in children(launcher) if b"spawn_main" in cmdline(child)]


class TorchrunNodes:
    """`python -m src.train <args>` under `nodes` torchrun launchers on this machine, meeting at a c10d
    rendezvous on 127.0.0.1 as the nodes of a cluster do; `node_env(i)` adds to launcher i's environment.
    Each launcher runs in a session of its own, which leaving the `with` block kills if it still runs."""

    def __init__(self, nodes: int, *args: str, nproc_per_node: int = 1, rdzv_id: str = "twonodes",
                 node_env: Callable[[int], dict[str, str]] = lambda node: {}) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={nproc_per_node}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={rdzv_id}",
                   "-m", "src.train", *args]
        self.launchers = [
            subprocess.Popen(command, cwd=REPO, env={**user_env(), **node_env(node)}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for node in range(nodes)
        ]
        self.logs: list[str] = []

    def __enter__(self) -> "TorchrunNodes":
        return self

    def __exit__(self, *exc: object) -> None:
        for launcher in self.launchers:
            with contextlib.suppress(OSError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()

    def wait(self, timeout: float = 600) -> list[int]:
        """Each launcher's exit status once all have ended; their output in `logs`."""
        deadline = time.monotonic() + timeout
        self.logs = [launcher.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for launcher in self.launchers]
        return [launcher.returncode for launcher in self.launchers]

    def workers(self) -> dict[int, int]:
        """The running workers by their global rank: {RANK: pid}."""
        ranks = {}
        for launcher in self.launchers:
            for pid in children(launcher.pid):
                with contextlib.suppress(OSError):
                    env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
                    if b"RANK" in env:
                        ranks[int(env[b"RANK"])] = pid
        return ranks


def epoch_lines(log: str) -> list[tuple[int, int]]:
    """(epoch, step) of every epoch line in a train.log: `epoch 3/1000 step 6: ...`."""
    return [(int(e), int(s)) for e, s in re.findall(r"epoch (\d+)/\d+ step (\d+):", log)]


def steps_going_back(run: Path) -> list[tuple[str, int, int]]:
    """(event file, step, the step before it) wherever a point goes back in TensorBoard's reading order, which
    TensorBoard takes for a restart and purges by; a resumed attempt's purge step (a SessionLog START) may."""
    back, latest = [], -1
    for path in sorted(run.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                latest = event.step
            elif event.HasField("summary"):
                if event.step < latest:
                    back.append((path.name, event.step, latest))
                latest = max(latest, event.step)
    return back


def scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar series logged in a run folder (all event files in it, not below)."""
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def scalar_steps(run_dir: Path) -> dict[str, list[int]]:
    """Every scalar's steps as TensorBoard shows them (points hidden by a purge step left out)."""
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [event.step for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    """IDX format as Fashion-MNIST ships it: magic (0, 0, dtype 0x08, ndim), big-endian sizes, bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def write_tiny_fashion_mnist(root: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    """Four tiny IDX files in torchvision's layout, with labels the images encode (pixel 0 = label)."""
    rng = np.random.default_rng(seed)
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n)
        images = rng.integers(0, 256, (n, 28, 28))
        images[:, 0, 0] = labels
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


def hparams_plugin_data(run_dir: Path) -> list:
    """The HParams plugin's records of a run folder, as TensorBoard's HParams tab reads them."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    try:
        contents = accumulator.PluginTagToContent("hparams").values()
    except KeyError:  # no HParams summary at all, e.g. a stopped run
        return []
    return [plugin_data_pb2.HParamsPluginData.FromString(content) for content in contents]


def hparams(run_dir: Path) -> dict[str, object]:
    """The hyperparameters of a run's HParams summary; {} when it has none."""
    for data in hparams_plugin_data(run_dir):
        if data.HasField("session_start_info"):
            from src.runs import setting

            return {k: v.WhichOneof("kind") and setting(v) for k, v in data.session_start_info.hparams.items()}
    return {}


def hparams_order(run_dir: Path) -> list[str]:
    """The hyperparameters in the order of the run's HParams experiment, the order TensorBoard shows them in."""
    for data in hparams_plugin_data(run_dir):
        if data.HasField("experiment"):
            return [info.name for info in data.experiment.hparam_infos]
    return []
