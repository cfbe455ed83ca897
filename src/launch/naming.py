"""Names of run and sweep-job folders, so that TensorBoard's run list reads as the runs; the resolvers that make them."""

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.config import options
from src.errors import UsageError, interpreter
from src.folders import linked, missing, own_file, remove_empty, remove_tree
from src.records import load, overrides, select, value_of
from src.launch.lock import LOCK
from src.launch.ranks import external_rank, run_stamp

# Folders this process claimed, by the name asked for (Hydra may resolve one twice); the folders each claim created;
# the run folder the command typed where it was there before (the user's, even empty).
_claimed: dict[str, str] = {}
_created: dict[str, list[Path]] = {}
_given: set[str] = set()


def note_given(args: list[str]) -> None:
    """Keep `hydra.run.dir=<folder>` of the command where the folder is there already: a failing command never
    removes a folder it did not make."""
    _given.clear()
    for arg in args:
        if arg.startswith("hydra.run.dir=") and os.path.isdir(arg.partition("=")[2]):
            _given.add(os.path.abspath(arg.partition("=")[2]))


def swept_keys(lines: list[str]) -> list[str]:
    """The keys of a sweep's recorded overrides that its jobs may differ in: every key but those whose value
    `records.value_of` reads as one value (a number, text, a list). The record is read, never parsed by Hydra's
    grammar; a value it does not read (a dict, `glob(*)`, `sort(...)`) counts as swept, so that at worst a folder's
    name is longer, and two jobs never share one."""
    from hydra.core.override_parser.types import Sweep

    keys = []
    for line in lines:
        key, has_value, text = line.partition("=")
        try:
            one = not has_value or not isinstance(value_of(text, sweep=True), Sweep)
        except ValueError:
            one = False
        if not one:
            keys.append(key.lstrip("+~"))
    return keys


def sweep_args(sweep_dir: str) -> list[str]:
    """The sweep's overrides from its `multirun.yaml`, written before any job starts (a SLURM job's argv is its own),
    then a search's space as its config typed it (`hydra.sweeper.params`), so that its trials' folders differ too."""
    saved = Path(sweep_dir) / "multirun.yaml"
    if not saved.is_file():
        return []
    recorded = load(saved)
    typed, params = overrides(select(recorded, "hydra.overrides.task"), saved), select(recorded, "hydra.sweeper.params")
    keys = {line.partition("=")[0].lstrip("+~") for line in typed}  # the command line's win, as in the search
    return [*typed, *(f"{key}={value}" for key, value in (params.items() if isinstance(params, dict) else ())
                      if str(key).lstrip("+~") not in keys)]


def precision_used(precision: object, accelerator: str) -> str:
    """The one place `precision=auto` (and 16-mixed on a CPU) becomes what the run computes in."""
    from src.fast_path import resolve_accelerator, resolve_precision  # torch: only once a run is named

    return resolve_precision(precision, resolve_accelerator(str(accelerator)))


def run_label(model: str, strategy: str, devices: int, num_nodes: int, precision: str, experiment: str | None = None) -> str:
    """`lenet_ddp_2dev_bf16-mixed`, `lenet_auto_1dev_32-true_d2l_lenet`: what the run is, with the precision it uses."""
    nodes = f"_{num_nodes}nodes" if int(num_nodes) > 1 else ""
    recipe = f"_{experiment}" if experiment else ""
    return f"{model}_{strategy}_{devices}dev{nodes}_{precision}{recipe}"


LABELLED = ("model", "strategy", "devices", "num_nodes", "experiment")  # swept keys the run label shows by value
TRIAL = "callbacks.optuna_trial.trial"  # a search's trial number: a sampler may draw the same settings twice


def sweep_job_dirname(job_overrides: list[str], job_num: int, sweep_dir: str, label: str = "") -> str:
    """The run label, then a search's trial (as its lines count it), then the swept values it does not show:
    `lenet_auto_1dev_32-true_seed=2` for `seed=1,2`, `..._trial3_optim.lr=0.01` in a search; a swept precision as typed
    unless the label shows it so (`32` is `32-true`); without a label (a job that never started), every swept value:
    two jobs never share a folder."""
    values = swept_values(job_overrides, swept_keys(sweep_args(sweep_dir)))
    trial = [f"trial{int(values[TRIAL]) + 1}"] if values.get(TRIAL, "").isdigit() else []
    parts = [f"{key}={value}" for key, value in values.items() if key != TRIAL and not (label and (
             key in LABELLED or key == "precision" and label.endswith("_" + value)))]
    return folder_name("_".join([*([label] if label else []), *trial, *([",".join(parts)] if parts else [])]),
                       f"job{job_num}")


def swept_values(job_overrides: list[str], swept: list[str]) -> dict[str, str]:
    """A job's values of the swept keys (and a search's trial number), as its overrides give them, in the sweep's
    order."""
    values = {key.lstrip("+~"): value for key, _, value in (item.partition("=") for item in job_overrides)}
    return {key: values[key] for key in [TRIAL, *swept] if key in values}


NAME_BYTES = 200  # a job folder's name at most (file systems take 255)


def folder_name(text: str, fallback: str) -> str:
    """`text` as one folder of the sweep's: `/`, `\\`, control characters and a leading `.` as `_`, at most
    `NAME_BYTES`; a name changed so ends in a digest of `text`, so that two values stay two folders. `fallback` for
    none at all."""
    name = "".join("_" if char in "/\\" or not char.isprintable() else char for char in text)
    name = "_" + name[1:] if name.startswith(".") else name
    if name == text and len(name.encode()) <= NAME_BYTES:
        return name or fallback
    digest = hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:12]
    return f"{name.encode()[:NAME_BYTES - 13].decode(errors='ignore')}-{digest}"


@contextmanager
def hydra_config_of(config: DictConfig) -> Iterator[None]:
    """`${hydra:...}` resolved under `config`'s Hydra settings, as Hydra's `run_job` sets them, then as they were."""
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = saved  # as `run_job` puts it back: `set_config` takes no unset one


def job_dirname(config: DictConfig) -> str:
    """A sweep job's folder name before it runs, resolved under its own Hydra config as Hydra's `run_job` does."""
    with hydra_config_of(config):
        return str(OmegaConf.select(config, "hydra.sweep.subdir"))


def job_folder_name(sweep_dir: Path, job_overrides: list[str], job_num: int) -> str:
    """The folder a job of this sweep ran in, found by the swept values its recorded overrides hold (a resumed sweep's
    command adds overrides of its own, and numbers its jobs anew: `shuffle()`, values typed in another order); else its
    swept values."""
    swept = swept_keys(sweep_args(str(sweep_dir)))
    wanted = swept_values(job_overrides, swept)
    for saved in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):
        recorded = load(saved, root=sweep_dir)
        if isinstance(recorded, list) and all(isinstance(line, str) for line in recorded) \
                and swept_values(recorded, swept) == wanted:
            return saved.parent.parent.name
    return sweep_job_dirname(job_overrides, job_num, str(sweep_dir))


def claim_dir(path: str, kind: str = "run") -> str:
    """`path`, or `path-2`, `path-3`, ... if taken, created atomically: two runs started in one second never share
    a folder. Processes under torchrun or SLURM share the folder their launcher's run id names (`run_stamp`)."""
    sweep_job = kind == "run" and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if external_rank() is not None or sweep_job:  # a sweep job lives in its sweep folder; Lightning reads run.dir
        return path
    if path in _claimed:
        return _claimed[path]
    candidate, number = Path(path), 1
    while True:
        try:
            created = missing(candidate)
            candidate.mkdir(parents=True)
            break
        except FileExistsError:
            if not candidate.exists():  # a parent is a file: no name below it can be created
                return path
            number += 1
            candidate = Path(f"{path}-{number}")
        except OSError:
            return path  # not creatable: Hydra's own mkdir says why, in one line
    _claimed[path] = str(candidate)
    _created[str(candidate.absolute())] = created
    return str(candidate)


def unclaim_dir(folder: Path) -> None:
    """Remove a failed command's own folder and the parents its claim created, as far as they are empty; never one
    that holds a checkpoint (a run that failed later, on a full disk, resumes from it)."""
    if any(Path(folder).glob("**/*.ckpt")):
        return
    for handler in own_logs(folder):  # its log goes with it; the descriptor freed (`ulimit -n` may be why it failed)
        logging.root.removeHandler(handler)
        handler.close()
    remove_tree(Path(folder))
    remove_empty(_created.get(str(Path(folder).absolute()), [Path(folder)]))


def untouched(folder: Path) -> bool:
    """Whether a folder holds nothing but its lock and this run's logs (this process's, and its other ranks' under
    torchrun or SLURM: `train_rank_1.log`), and the command did not find it there: a command made it, and may take
    it back if it fails; a folder any other command wrote in, or the user made, stays."""
    if os.path.abspath(folder) in _given:
        return False
    stems = [Path(handler.baseFilename).stem for handler in own_logs(folder)]
    ours = [re.compile(rf"{re.escape(stem)}(_rank_\d+)?\.log") for stem in stems]
    return folder.is_dir() and all(p.name == LOCK or any(log.fullmatch(p.name) for log in ours) for p in folder.iterdir())


def check_own_logs(folder: Path) -> None:
    """This process's log in the folder is a file of its own: a link there, or a file with another name (a hard
    link), is closed unwritten, and refused."""
    for handler in own_logs(folder):
        path = Path(handler.baseFilename)
        try:
            if path.is_symlink():
                raise linked(path)
            if handler.stream is not None:
                os.close(own_file(os.dup(handler.stream.fileno()), path, writing=True))
        except UsageError:
            logging.root.removeHandler(handler)
            handler.close()
            raise


def own_logs(folder: Path) -> list[logging.FileHandler]:
    """This process's log files in `folder` (Hydra's `<job>.log`)."""
    return [handler for handler in logging.root.handlers if isinstance(handler, logging.FileHandler)
            and Path(handler.baseFilename).parent == Path(folder).absolute()]


def holds_only_settings(folder: Path) -> bool:
    """What a folder holds before a run has written anything of its own: its settings, lock and logs."""
    settings = (".hydra", "config.yaml", LOCK)
    return folder.is_dir() and all(p.name in settings or p.suffix == ".log" for p in folder.iterdir())


def unclaim_unused() -> None:
    """Take back every folder this process claimed (created itself) that a run wrote nothing of its own in."""
    for folder in map(Path, list(_claimed.values())):
        if holds_only_settings(folder):
            unclaim_dir(folder)


def threads_used(strategy: str, devices: int) -> int:
    """The threads each of the run's processes computes with, as `src.launch.workers` sets them."""
    from src.launch.workers import threads_per_process  # torch: only once a run is named

    return threads_per_process(strategy, int(devices))


def register_resolvers() -> None:
    for name, function in (("run_stamp", run_stamp), ("claim_dir", claim_dir), ("run_label", run_label),
                           ("precision_used", precision_used), ("python", interpreter), ("options", options),
                           ("sweep_job_dirname", sweep_job_dirname)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, function, use_cache=True)
    if not OmegaConf.has_resolver("threads_used"):  # asked again in a job's own process: a parallel job's slot
        OmegaConf.register_new_resolver("threads_used", threads_used)
