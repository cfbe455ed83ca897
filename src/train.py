"""`python -m src.train [-m] key=value ...`: `src.launch.cli` checks the command line and the config, then starts the
run's processes, each of which builds, fits and tests the run (`src.tasks.train`). Nothing here imports torch or
Lightning: `--help`, `--cfg job` and a refused config are answered without them."""

import hydra
from omegaconf import DictConfig

from src.launch import cli
from src.records import Result


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> Result:
    from src.tasks import fit_and_test  # torch and Lightning: a run's config has passed its checks (cli.CheckFirst)

    return cli.run_job(cfg, fit_and_test)


def command() -> None:
    """`python -m src.train`: a run, or a sweep and its report."""
    cli.main(main, "train", report=True)


if __name__ == "__main__":
    command()
