"""What local DDP's forkserver imports first, once for every worker it forks: the training code, through `frozen`.

Imported the usual way, torch's and Lightning's 700,000 objects wait for the collector's next full walk, and that
comes soon after the fork, in the server and in each worker. Walking them writes to every page the fork shares: each
of those processes copied about 100 MB and spent a quarter of a second of a core on it (docs/results.md, start-up).
"""

from src.launch import frozen

for name in ("src.runner", "src.launch.workers"):
    frozen.import_module(name)
