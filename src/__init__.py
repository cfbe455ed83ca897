"""Data-parallel training experiments on Fashion-MNIST with Lightning and Hydra."""

# On import of any src module, so that every composer of conf/ (the entry points, a SLURM task, tests, benchmarks)
# finds the schema conf/train.yaml names and the resolvers its folder names and the SLURM launcher call.
from src import config, slurm  # noqa: F401
from src.launch import naming

naming.register_resolvers()
slurm.register_resolvers()
