"""Where Hydra looks for sweepers: it instantiates only plugin classes defined under `hydra_plugins`."""
