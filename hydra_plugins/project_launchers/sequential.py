"""Where Hydra finds the sequential launcher (`hydra/launcher=sequential`, the default)."""

from src.launch.sequential_launcher import SequentialLauncher as _SequentialLauncher


class SequentialLauncher(_SequentialLauncher):
    """`src.launch.sequential_launcher.SequentialLauncher`, under the name Hydra accepts."""
