"""`python -m src.train`: compose the config, build the pieces, fit, test, log.

    python -m src.train                                   # LeNet, one device
    python -m src.train model=resnet18 strategy=ddp devices=4 precision=16-mixed
    python -m src.train -m strategy=ddp,ddp_fp16 devices=1,2,4

The command line is checked, and `--help` answered, before torch and Lightning are imported: the job
imports what runs it (`src.runner`) once Hydra has composed its config.
"""

import hydra
from omegaconf import DictConfig

from src.launch import cli, forkserver, frozen
from src.launch.naming import register_resolvers

register_resolvers()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def hydra_main(cfg: DictConfig) -> cli.JobDone | cli.JobFailed:
    forkserver.start_early(cfg)  # a DDP run's workers: their server imports the code while this process does
    runner = frozen.import_module("src.runner")

    return cli.run_job(runner.train, cfg)


def main() -> None:
    cli.run_entry(hydra_main, resumes=True)


if __name__ == "__main__":
    main()
