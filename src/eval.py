"""`python -m src.eval ckpt_path=<file or run folder>`: test accuracy and loss of a saved model, without training.

    python -m src.eval ckpt_path=outputs/runs/<run>                       # its newest checkpoint
    python -m src.eval ckpt_path=outputs/runs/<run>/checkpoints/best-epoch7.ckpt strategy=ddp devices=2

Any strategy and number of processes: every test image counts once. The model is the one the
checkpoint's run used (from its `config.yaml`) unless `model=` is given. The result is one line and
the `test/acc` and `test/loss` scalars in `outputs/eval/<date>_<time>_<model>_<strategy>_<N>dev_<precision>/`.
"""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from src.launch import cli
from src.train import run


def evaluate(cfg: DictConfig) -> dict[str, float]:
    return run(cfg, fit=False)


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def hydra_main(cfg: DictConfig) -> float | None:
    return cli.run_job(evaluate, cfg)


def with_checkpoint_model(args: list[str]) -> list[str]:
    """`args` plus `model=<the model of the checkpoint's run>` when no model is given and the run's config is there."""
    given = dict(arg.split("=", 1) for arg in args if "=" in arg and not arg.startswith(("-", "+", "~")))
    if "model" in given or "ckpt_path" not in given:
        return args
    path = Path(given["ckpt_path"])
    run_dir = path if path.is_dir() else path.parent.parent
    config = run_dir / "config.yaml"
    if not config.is_file():
        return args
    model = OmegaConf.load(config).get("model_name")
    return [*args, f"model={model}"] if model else args


def main() -> None:
    sys.argv = [sys.argv[0], *with_checkpoint_model(sys.argv[1:])]
    cli.run_entry(hydra_main)


if __name__ == "__main__":
    main()
