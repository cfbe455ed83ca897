"""Where Hydra finds the sequential launcher (`hydra/launcher=sequential`, the project's default), in any Hydra app."""

from hydra.core.config_store import ConfigStore

from src.launch.sequential_launcher import SequentialLauncher as _SequentialLauncher


class SequentialLauncher(_SequentialLauncher):
    """`src.launch.sequential_launcher.SequentialLauncher`, under the name Hydra accepts."""


ConfigStore.instance().store(group="hydra/launcher", name="sequential", provider="project",
                             node={"_target_": "hydra_plugins.project_launchers.sequential.SequentialLauncher"})
