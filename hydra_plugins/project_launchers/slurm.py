"""Where Hydra looks for launchers: it instantiates only plugin classes defined under `hydra_plugins`."""

try:
    from src.launch.slurm_launcher import SlurmLauncher as _SlurmLauncher
except ImportError:  # without the `slurm` extra (hydra-submitit-launcher) there is no SLURM launcher
    pass
else:

    class SlurmLauncher(_SlurmLauncher):
        """`src.launch.slurm_launcher.SlurmLauncher`, under the name Hydra accepts."""
