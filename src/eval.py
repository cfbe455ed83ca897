"""`python -m src.eval ckpt_path=<file or run folder> [test_weights=last]`: test accuracy and loss of a saved model,
under any strategy. The model is the one the checkpoint's run built (its `config.yaml`), this command's `model.*` on it."""

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from src import config, records
from src.errors import UsageError
from src.launch import cli
from src.records import Result
from src.runs import resolved_config, resolved_config_file


INSTANTIATE = ("_target_", "_partial_", "_args_", "_recursive_", "_convert_")  # what tells Hydra how to build a node


def targets(node: Any, prefix: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if isinstance(node, dict):
        found |= {f"{prefix}.{key}": node[key] for key in INSTANTIATE if key in node}
        for key, value in node.items():
            found |= targets(value, f"{prefix}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found |= targets(value, f"{prefix}[{i}]")
    return found


def as_trained(cfg: DictConfig, overrides: list[str], group: str) -> DictConfig:
    """The checkpoint's run's `model` or `data` with this command's `<group>.*` on top: its values, never its
    `_target_`s (a copied folder could run any function)."""
    saved = None if OmegaConf.is_missing(cfg, "ckpt_path") else resolved_config(cfg.ckpt_path)
    choice = cfg.get(f"{group}_name")  # model_name; the data group has one option, and no name in the config
    if saved is None or saved.get(f"{group}_name") != choice or not isinstance(saved.get(group), DictConfig):
        return cfg[group]
    trained = saved[group]
    ours, theirs = (targets(OmegaConf.to_container(c, resolve=False), group) for c in (cfg[group], trained))
    differ = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
    if differ:
        key, here = differ[0], f"{group}={choice}" if choice else f"this command's {group}"
        raise UsageError(f"ckpt_path={cfg.ckpt_path} is not allowed; {resolved_config_file(cfg.ckpt_path)} builds the "
                         f"{group} with {key}={theirs.get(key)} where {here} has {ours.get(key)}, and a run's config may "
                         f"change the {group}'s values, not what builds it; move that file away to score with {here} "
                         "as configured here")
    typed = [key.removeprefix(f"{group}.") for key in (override.split("=", 1)[0] for override in overrides)
             if key.startswith(f"{group}.")]  # `<group>.<known key>=` typed here wins
    if group == "data" and "root" not in typed and trained.get("root") != cfg.data.root:
        raise UsageError(f"data.root is needed: {resolved_config_file(cfg.ckpt_path)} says the run read its data from "
                         f"data.root={records.bounded(trained.get('root'))}, and where data is read is typed, never "
                         "taken from a run's records; type data.root=<a folder holding FashionMNIST/raw>")
    kept = [key for key in config.flatten(OmegaConf.to_container(trained, resolve=False))
            if not records.carried(f"{group}.{key}") and OmegaConf.select(cfg[group], key) is not None]
    for path in [*typed, *kept]:  # and where the data is, and whether it is downloaded, are this command's
        OmegaConf.update(trained, path, OmegaConf.select(cfg[group], path), merge=False)
    return trained


def take_the_runs_model(cfg: DictConfig) -> None:
    overrides = list(HydraConfig.get().overrides.task)
    cfg.model, cfg.data = as_trained(cfg, overrides, "model"), as_trained(cfg, overrides, "data")


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(cfg: DictConfig) -> Result:
    from src.tasks import evaluate  # torch and Lightning: a run's config has passed its checks (cli.CheckFirst)

    return cli.run_job(cfg, evaluate, prepare=take_the_runs_model)


def with_checkpoint_model(args: list[str]) -> list[str]:
    given = dict(arg.split("=", 1) for arg in args if "=" in arg and not arg.startswith(("-", "+", "~")))
    if "model" in given or "ckpt_path" not in given:
        return args
    config = resolved_config(given["ckpt_path"])
    model = config.get("model_name") if config is not None else None
    if model is not None and not records.OPTION.fullmatch(str(model)):
        raise records.refused(resolved_config_file(given["ckpt_path"]), "model_name", model,
                              "it must name an option of the model group; give the model with model=<option>")
    return [*args, f"model={model}"] if model else args


def check_own_folder(args: list[str]) -> None:
    """An evaluation writes its records into a folder of its own: a training run's folder (it holds checkpoints or
    a result) is refused before anything is written there, its config, records and result kept."""
    given = [arg.split("=", 1)[1] for arg in args if arg.startswith("hydra.run.dir=")]
    if given and (records.has_checkpoints(Path(given[-1])) or (Path(given[-1]) / records.RESULT).exists()):
        raise UsageError(f"hydra.run.dir={given[-1]} holds a run; src.eval writes into a folder of its own: leave "
                         "hydra.run.dir out (outputs/eval/<date>_<time>_...), or give a new folder")


def command() -> None:
    """`python -m src.eval`: the run's model chosen from its checkpoint's folder, then the Hydra entry."""
    try:
        check_own_folder(sys.argv[1:])
        sys.argv = [sys.argv[0], *with_checkpoint_model(sys.argv[1:])]
    except UsageError as error:
        cli.end_run(str(error), 2)
    cli.main(main, "eval", prepare=take_the_runs_model)


if __name__ == "__main__":
    command()
