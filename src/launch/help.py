"""`--help`, answered as Hydra answers it (the `hydra.help` template of the config composed with the command's
overrides), with the config groups listed from one reading of the config sources: Hydra's own help reads all of
them again for each group it lists, about a hundred times, which was most of the answer's time."""

import string
from collections.abc import Iterator
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

HELP_FLAGS = ("--help", "-h")
CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
ANSWERED = {"APP_CONFIG_GROUPS", "CONFIG"}  # a template with Hydra's other parts is left to Hydra


def wants_help(args: list[str]) -> bool:
    return any(arg in HELP_FLAGS for arg in args)


def _folder_options(folder: Path, group: str) -> Iterator[tuple[str, str]]:
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            yield from _folder_options(path, f"{group}/{path.name}" if group else path.name)
        elif group and path.suffix == ".yaml":
            yield group, path.stem


def _store_options(tree: dict, group: str = "") -> Iterator[tuple[str, str, str | None]]:
    for name, entry in tree.items():
        if isinstance(entry, dict):
            yield from _store_options(entry, f"{group}/{name}" if group else name)
        elif group:
            yield group, name.removesuffix(".yaml"), getattr(entry, "provider", None)


# Hydra's own groups that a user of this project picks from: how a sweep's jobs run, and how it chooses them; and
# Hydra's option among them that the project keeps as its default (every combination of the values typed).
HYDRA_GROUPS = ("hydra/launcher", "hydra/sweeper")
HYDRA_DEFAULTS = {"hydra/sweeper": "basic"}


def app_groups(config_dir: Path, chosen: dict[str, str] | None = None) -> str:
    """Each config group outside `hydra/` with its options, one line each as Hydra lists them: the config folder's
    and the ConfigStore's; then the launchers and sweepers: the project's (conf/hydra/ and the ConfigStore's of
    provider `project`), Hydra's `basic` sweeper and the ones `chosen`, not each plugin's every entry."""
    groups: dict[str, set[str]] = {}
    for group, option in _folder_options(config_dir, ""):
        if group != "hydra" and not group.startswith("hydra/") or group in HYDRA_GROUPS:
            groups.setdefault(group, set()).add(option)
    for group, option, provider in _store_options(ConfigStore.instance().repo):
        if group != "hydra" and not group.startswith("hydra/") or group in HYDRA_GROUPS and provider == "project":
            groups.setdefault(group, set()).add(option)
    for group, option in [*HYDRA_DEFAULTS.items(), *(chosen or {}).items()]:
        if option:
            groups.setdefault(group, set()).add(str(option))
    return "".join(f"{group}: {', '.join(sorted(options))}\n" for group, options in sorted(groups.items()))


def help_text(config_name: str, overrides: list[str], config_dir: Path = CONFIG_DIR) -> str | None:
    """The text Hydra's `--help` prints for this command line; None where the template asks for more than this
    writes (Hydra's flags, its own groups)."""
    with initialize_config_dir(str(config_dir), version_base="1.3"):
        cfg = compose(config_name, overrides, return_hydra_config=True)
    template = string.Template(cfg.hydra.help.template)
    asked = {match["named"] or match["braced"] for match in template.pattern.finditer(template.template)}
    if not asked - {None} <= ANSWERED:
        return None
    app = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    chosen = {group: cfg.hydra.runtime.choices.get(group) for group in HYDRA_GROUPS}
    return template.substitute(APP_CONFIG_GROUPS=app_groups(config_dir, chosen), CONFIG=OmegaConf.to_yaml(app))
