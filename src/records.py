"""A run folder's records, read as data: anyone who can write a shared folder may have written one, so it is plain
YAML, never resolved (a resolver could act), and may build only classes this project's conf/ names."""

import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from src.errors import UsageError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# `${a.b}` points at another key; any other `${...}` calls a resolver, which may act (create a folder, read a file).
RESOLVER = re.compile(r"\$\{(?![\w.]+\})")


def load(path: Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        reason = getattr(error, "strerror", None) or " ".join(str(error).split())[:200]
        raise UsageError(f"{path}: cannot be read as a record ({reason})") from None


@functools.cache
def conf_targets() -> frozenset[str]:
    return frozenset(target for path in CONF_DIR.rglob("*.yaml")
                     for target in re.findall(r"^\s*_target_:\s*(\S+)", path.read_text(), flags=re.MULTILINE))


def refused(path: Path, key: str, value: Any, why: str) -> UsageError:
    return UsageError(f"{path}: {key}={value} is not allowed in a run's records; {why}")


def check_data(node: Any, path: Path, allowed: frozenset[str] | None = None, key: str = "") -> None:
    """Refuse a resolver call anywhere in `node`, and (with `allowed`) a `_target_` outside `allowed`."""
    if isinstance(node, dict):
        for name, value in node.items():
            inner = f"{key}.{name}" if key else str(name)
            if name == "_target_" and allowed is not None and value not in allowed:
                raise refused(path, inner, value, "it names no class of this project's conf/, and a record may not "
                                                  "add code to run")
            check_data(value, path, allowed, inner)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            check_data(value, path, allowed, f"{key}[{index}]")
    elif isinstance(node, str) and RESOLVER.search(node):
        raise refused(path, key, node, "a resolver could act when it is read")


def select(data: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None
    return data


def config(path: Path) -> dict[str, Any]:
    data = load(path)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: holds no config (a mapping of keys)")
    check_data(data, path)
    return data


def overrides(lines: Any, path: Path) -> list[str]:
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise UsageError(f"{path}: holds no list of overrides")
    return list(lines)


# A sweep's launcher and sweeper as its command chose them: plain option names and values, no resolver or interpolation.
LAUNCH = re.compile(r"hydra(/(launcher|sweeper)=[\w-]+|\.(launcher|sweeper)\.[\w.]+=[^$]*)")


def launch_overrides(lines: Any, path: Path) -> list[str]:
    """The launcher and sweeper overrides a sweep's resume takes, so that it runs where the sweep ran."""
    return [line for line in overrides(lines, path) if LAUNCH.fullmatch(line) and "_target_" not in line]


def check_override(line: str, path: Path) -> None:
    """Stricter than typed input: no Hydra setting, no `_target_`, no resolver call."""
    key, _, value = line.partition("=")
    key = key.lstrip("+~")
    if re.split(r"[./@]", key)[0] == "hydra":
        raise refused(path, key, value, "a resume takes the run's settings, never Hydra's own")
    if "_target_" in line:
        raise refused(path, key, value, "a record may not name code to run; type the override again to resume with it")
    if RESOLVER.search(line):
        raise refused(path, key, value, "a resolver could act when it is read")


@dataclass(frozen=True)
class Result:
    """A run's `result.json`. `resumed`: it went on from a checkpoint of its folder; `skipped`: it only repeated the
    record of a run that had finished."""

    metrics: dict[str, float]
    line: str
    step: int = -1
    resumed: bool = False
    skipped: bool = False

    def save(self, folder: Path) -> None:
        partial = folder / ".result.json.partial"
        partial.write_text(json.dumps(asdict(self), indent=1))
        partial.replace(folder / RESULT)


RESULT = "result.json"


def result(folder: Path) -> Result | None:
    """None where the run recorded none, or one that is not a result."""
    path = folder / RESULT
    if not path.is_file():
        return None
    data = load(path)
    metrics, line, step = select(data, "metrics"), select(data, "line"), select(data, "step")
    if not (isinstance(metrics, dict) and isinstance(line, str) and isinstance(step, int)
            and all(isinstance(v, (int, float)) for v in metrics.values())):
        return None
    return Result({str(k): float(v) for k, v in metrics.items()}, line, step)
