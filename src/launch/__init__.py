"""How a run starts, names its folder and stops: the command line's plumbing, DDP child processes,
run and sweep folder names, signals and dead ranks."""
