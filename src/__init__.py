"""Data-parallel training experiments on Fashion-MNIST with Lightning and Hydra."""
