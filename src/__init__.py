"""Data-parallel training experiments on Fashion-MNIST with Lightning and Hydra."""

# On import of any src module, so that every composer (the entry points, a submitit worker, tests,
# benchmarks) finds the schema conf/train.yaml names and the `${slurm_gpus:...}` resolver of
# conf/hydra/launcher/slurm.yaml.
from src import config, slurm  # noqa: F401

slurm.register_resolvers()
