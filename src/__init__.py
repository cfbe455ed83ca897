"""Data-parallel training experiments on Fashion-MNIST with Lightning and Hydra."""

from src import slurm

# Registered on import of any src module, so that configs composed anywhere (the command line,
# a submitit worker, tests) can resolve `${slurm_gpus:...}` in conf/hydra/launcher/slurm.yaml.
slurm.register_resolvers()
