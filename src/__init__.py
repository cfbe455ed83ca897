"""Data-parallel training experiments on Fashion-MNIST with Lightning and Hydra."""

# conf/train.yaml names the schema this registers: with the package, every composer (the entry
# points, tests, benchmarks) finds it.
from src import config  # noqa: F401
