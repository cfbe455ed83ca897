"""Where Hydra finds the parallel launcher (`hydra/launcher=parallel`, conf/hydra/launcher/parallel.yaml)."""

from src.launch.parallel_launcher import ParallelLauncher as _ParallelLauncher


class ParallelLauncher(_ParallelLauncher):
    """`src.launch.parallel_launcher.ParallelLauncher`, under the name Hydra accepts."""
