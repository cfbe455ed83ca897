"""Where Hydra finds the parallel launcher (`-m hydra/launcher=parallel seed=1,2,3,4`), in any Hydra app."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from src.launch.parallel_launcher import ParallelLauncher as _ParallelLauncher


class ParallelLauncher(_ParallelLauncher):
    """`src.launch.parallel_launcher.ParallelLauncher`, under the name Hydra accepts."""


@dataclass
class ParallelLauncherConf:
    """Several sweep jobs at once, each on a share of the cores and GPUs; its output in `<sweep>/.parallel/<job>.out`."""

    _target_: str = "hydra_plugins.project_launchers.parallel.ParallelLauncher"
    jobs: int | None = None  # at most this many at once; null: as many as fit (GPUs x jobs_per_gpu, or cores, over a job's devices)
    jobs_per_gpu: int = 1  # jobs sharing one GPU (docs/results.md, sweeps side by side)


ConfigStore.instance().store(group="hydra/launcher", name="parallel", node=ParallelLauncherConf, provider="project")
