"""Names of run and sweep-job folders, so that TensorBoard's run list reads as the runs."""

import functools
import shutil
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src import folders, records
from src.launch.ranks import external_rank, run_stamp

# Folders this process has claimed, by the name asked for: Hydra may resolve a folder name more than once.
_claimed: dict[str, str] = {}
_created: dict[str, list[Path]] = {}  # by claimed folder: the folders its claim created, deepest first


def swept_keys(args: list[str]) -> list[str]:
    """Keys given several values on the command line (`devices=1,2,4`), in the order typed."""
    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:
        return []
    return [o.key_or_group for o in overrides if o.is_sweep_override()]


def sweep_args(sweep_dir: str) -> list[str]:
    """The sweep's command-line overrides, from the `multirun.yaml` Hydra writes before any job starts.

    Read from the file rather than sys.argv, because a launcher such as submitit runs each job
    in a worker whose argv is its own.
    """
    saved = Path(sweep_dir) / "multirun.yaml"
    if saved.is_file():
        stat = saved.stat()
        return list(_saved_overrides(str(saved), stat.st_mtime_ns, stat.st_size))
    return sys.argv[1:]


@functools.lru_cache(maxsize=8)
def _saved_overrides(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    """Read once per version of the file: each job's folder name asks for it, several times a job."""
    return tuple(records.overrides(records.select(records.load(Path(path)), "hydra.overrides.task"), Path(path)))


def run_label(model: str, strategy: str, devices: int, num_nodes: int, precision: object, accelerator: str) -> str:
    """`lenet_ddp_2dev_bf16-mixed`: what the run is, with the precision it uses (`auto` resolved, Lightning's
    spelling: `32` is `32-true`), so that runs read apart in folder lists and in TensorBoard."""
    from src.fast_path import resolve_accelerator, resolve_precision

    used = resolve_precision(precision, resolve_accelerator(str(accelerator)), quiet=True)
    nodes = f"_{num_nodes}nodes" if int(num_nodes) > 1 else ""
    return f"{model}_{strategy}_{devices}dev{nodes}_{used}"


# Swept keys the run label already shows by value.
LABELLED = ("model", "strategy", "devices", "num_nodes")


def sweep_job_dirname(job_overrides: list[str], job_num: int, sweep_dir: str, label: str = "") -> str:
    """The job's run label, then the job's values of the swept keys it does not show:
    `lenet_ddp_2dev_32-true` for `devices=1,2`, `lenet_auto_1dev_32-true_seed=2` for `seed=1,2`.

    A swept precision is shown as typed unless the label shows it as typed (`32` is `32-true`
    there, and `auto` may become any), so two jobs never share a folder.
    """
    # `+key=a,b` adds a key: swept_keys names it `key`
    values = {key.lstrip("+"): value for key, value in (item.split("=", 1) for item in job_overrides if "=" in item)}
    swept = [key for key in swept_keys(sweep_args(sweep_dir)) if key in values]
    if not label:  # a job named before it resolved its label (one that never started): by every swept value
        return ",".join(f"{key}={values[key]}" for key in swept) or f"job{job_num}"
    parts = [f"{key}={values[key]}" for key in swept
             if key not in LABELLED and not (key == "precision" and label.endswith("_" + values[key]))]
    return "_".join([label, ",".join(parts)]) if parts else label


def job_dirname(config: DictConfig) -> str:
    """A sweep job's folder name before it runs, resolved from its config as Hydra's `run_job` resolves it:
    under the job's own Hydra config, which `hydra:` interpolations (its model and strategy) read."""
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        return str(OmegaConf.select(config, "hydra.sweep.subdir"))
    finally:
        HydraConfig.instance().cfg = saved


def job_folder_name(sweep_dir: Path, overrides: list[str], job_num: int) -> str:
    """The folder a job of this sweep ran in, found by the overrides Hydra saved there (its name holds
    what the job resolved, which a submitter on another machine may not: `precision=auto`); named
    by the swept keys alone for a job that never started."""
    for saved in sweep_dir.glob("*/.hydra/overrides.yaml"):
        if records.load(saved) == list(overrides):
            return saved.parent.parent.name
    return sweep_job_dirname(overrides, job_num, str(sweep_dir))


def claim_dir(path: str, kind: str = "run") -> str:
    """`path`, or `path-2`, `path-3`, ... if taken: created here, atomically, so that two runs (or
    sweeps, `kind=sweep`) started in the same second never share a folder.

    Processes started by torchrun or SLURM all name the same folder after the launcher's run id
    (see `run_stamp`), so there the name is used as it is: a restarted run finds its own folder.
    """
    if external_rank() is not None:
        return path
    if kind == "run" and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return path  # a sweep job lives in the sweep's folder; Lightning still reads hydra.run.dir
    if path in _claimed:
        return _claimed[path]
    candidate, number = Path(path), 1
    while True:
        try:
            created = folders.missing(candidate)
            candidate.mkdir(parents=True)
            break
        except FileExistsError:
            if not candidate.exists():  # a parent is a file: no name below it can be created
                return path
            number += 1
            candidate = Path(f"{path}-{number}")
        except OSError:
            return path  # not creatable: reported in one line where the folder is checked
    _claimed[path] = str(candidate)
    _created[str(candidate.absolute())] = created
    return str(candidate)


def unclaim_dir(folder: Path) -> None:
    """Remove a claimed folder and the parents its claim created, as far as they are empty (a failed run's)."""
    shutil.rmtree(folder, ignore_errors=True)
    folders.remove_empty(_created.get(str(Path(folder).absolute()), [Path(folder)]))


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)
    if not OmegaConf.has_resolver("claim_dir"):
        OmegaConf.register_new_resolver("claim_dir", claim_dir, use_cache=True)
    if not OmegaConf.has_resolver("run_label"):
        OmegaConf.register_new_resolver("run_label", run_label, use_cache=True)
    if not OmegaConf.has_resolver("sweep_job_dirname"):
        OmegaConf.register_new_resolver(
            "sweep_job_dirname",
            lambda overrides, num, sweep_dir, label="": sweep_job_dirname(list(overrides), num, sweep_dir, str(label)),
        )
