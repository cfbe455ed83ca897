"""A run folder's records, read as data: anyone who can write a shared folder may have written one, so it is plain
YAML, never resolved (a resolver could act), and may build only classes this project's conf/ names."""

import functools
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from src.errors import UsageError
from src.folders import read_bytes, shown, write_file

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


LIMIT = 4 * 2**20  # bytes: the largest record read; a run's own are a few kB


class NoAliases(yaml.SafeLoader):
    """Plain YAML without anchors and aliases: nine nested aliases make a gigabyte, one that refers to itself a cycle."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent) or getattr(self.peek_event(), "anchor", None) is not None:
            raise yaml.YAMLError("it holds a YAML anchor or alias, which a record never needs")
        return super().compose_node(parent, index)


def load(path: Path, root: Path | None = None) -> Any:
    """A record's data: plain YAML (JSON too), at most `LIMIT` bytes, no aliases, never through a link below `root`
    (the run or sweep folder; by default the record's own folder)."""
    try:
        return yaml.load(read_bytes(Path(path), LIMIT, root), Loader=NoAliases)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as error:
        reason = getattr(error, "strerror", None) or " ".join(str(error).split())[:200]
        raise UsageError(f"{shown(path)}: cannot be read as a record ({reason})") from None


@functools.cache
def slot_targets() -> dict[str, frozenset[str]]:
    """The classes conf/ names for each slot (`model`, `model.net`, `model.loss`, `callbacks.<name>`), by the key they
    sit under: a record may put only a network where a network belongs."""
    slots: dict[str, set[str]] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                if name == "_target_" and isinstance(value, str):
                    slots.setdefault(key, set()).add(value)
                walk(value, f"{key}.{name}" if key else str(name))

    for path in CONF_DIR.rglob("*.yaml"):
        group = path.parent.relative_to(CONF_DIR).as_posix()
        if group.startswith("hydra"):
            continue
        text = path.read_text()
        walk(yaml.safe_load(text), "" if group == "." or "@package _global_" in text else group)
    return {key: frozenset(targets) for key, targets in slots.items()}


def slot_of(key: str) -> str:
    """`model.net` for `model.net._target_`; a named callback's slot is any callback's (`callbacks.*`)."""
    slot = key.removesuffix("._target_").removesuffix("_target_").rstrip(".")
    return re.sub(r"^(callbacks|logger)\.[^.]+$", r"\1.*", slot)


def targets_for(slot: str) -> frozenset[str]:
    if slot.endswith(".*"):
        parent = slot[:-1]
        return frozenset(t for key, ts in slot_targets().items() if key.startswith(parent) and key.count(".") == 1
                         for t in ts)
    return slot_targets().get(slot, frozenset())


def refused(path: Path, key: str, value: Any, why: str) -> UsageError:
    """One line naming the file and the key, quoting at most `SHOWN` characters of each."""
    return UsageError(f"{shown(path)}: {shown(key)[:SHOWN]}={bounded(value)} is not allowed in a run's records; {why}")


def bounded(value: Any) -> str:
    """A value read from a record, quoted in a line: printable, at most `SHOWN` characters, `...` where cut."""
    text = shown(value)
    return text[:SHOWN] + "..." * (len(text) > SHOWN)


SHOWN = 80  # characters of a refused record's key and of its value quoted


def check_data(node: Any, path: Path, key: str = "", targets: bool = True) -> None:
    """Refuse a resolver call anywhere in `node`, and (with `targets`: it will be built) a `_target_` that conf/ does
    not name for its slot."""
    if isinstance(node, dict):
        for name, value in node.items():
            inner = f"{key}.{name}" if key else str(name)
            if targets and name == "_target_" and value not in targets_for(slot_of(inner)):
                raise refused(path, inner, value, f"conf/ names no such class for {slot_of(inner)}, and a record may "
                                                  "not add code to run")
            check_data(value, path, inner, targets)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            check_data(value, path, f"{key}[{index}]", targets)
    elif isinstance(node, str) and ("$" in node or "\\" in node):
        raise refused(path, key, node, "a resolver or escape could act when it is read")
    elif not isinstance(node, (str, int, float, bool, type(None))):  # YAML's dates, binary, sets
        raise refused(path, key, node, f"it is a {type(node).__name__}, where a record holds text, numbers, true, "
                                       "false, null, lists and mappings")


def select(data: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None
    return data


def config(path: Path) -> dict[str, Any]:
    data = load(path)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: holds no config (a mapping of keys)")
    check_data(data, path, targets=False)  # read, compared and shown; what builds from it checks its slots
    return data


def overrides(lines: Any, path: Path) -> list[str]:
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise UsageError(f"{path}: holds no list of overrides")
    return list(lines)


RESUMES = Path(".hydra") / "resumes.yaml"  # beside overrides.yaml, which keeps what the run was started with


def resumes(folder: Path) -> list[dict[str, Any]]:
    """Each resume of the run in `folder`, oldest first: the overrides its command typed (`overrides`) and when it
    began (`at`); none before the first."""
    path = folder / RESUMES
    if not path.is_file():
        return []
    data = load(path, root=folder)
    if not isinstance(data, list) or not all(isinstance(entry, dict) and set(entry) <= {"at", "overrides"}
                                             and isinstance(entry.get("at", ""), str) for entry in data):
        raise UsageError(f"{shown(path)}: holds no list of resumes (each its `overrides` and `at`); move it away to "
                         "resume the run with the settings it was started with")
    return [{"at": entry.get("at", ""), "overrides": overrides(entry.get("overrides"), path)} for entry in data]


# What a record's override line may hold, read here and never by Hydra's grammar: a key of plain names, and values
# that are numbers, booleans, null, words or quoted one-line text without `$`, `\`, quotes or control characters. A
# value is read into the typed value Hydra would read (Hydra's own types for quoted text and sweeps), checked, and
# written out again from that value (`emit`): what reaches Hydra is never the recorded text.
KEY = re.compile(r"[A-Za-z]\w*(\.[A-Za-z]\w*)*", re.ASCII)
BARE = r"[A-Za-z0-9_/+.%*@?|:-]+"  # the characters of a bare value in Hydra's lexer, less `$` and `\`
QUOTED = r"'[^'\"\\$\x00-\x1f\x7f]*'|\"[^'\"\\$\x00-\x1f\x7f]*\""
SCALAR = re.compile(rf"{BARE}|{QUOTED}")
# Hydra's lexer's numbers (OverrideLexer.g4), so that a value is read here as Hydra reads it: `00` is text, `1_000` a
# whole number, `inf` and `.5` numbers.
_UNSIGNED = r"(0|[1-9](_?\d)*)"
_POINT = rf"({_UNSIGNED}\.|{_UNSIGNED}?\.\d(_?\d)*)"
FLOAT = re.compile(rf"[+-]?({_POINT}|({_UNSIGNED}|{_POINT})[eE][+-]?\d(_?\d)*|[Ii][Nn][Ff]|[Nn][Aa][Nn])")
INT = re.compile(rf"[+-]?{_UNSIGNED}")
CALL = re.compile(r"([a-z]+)\((.*)\)", re.S)  # a sweep's function: interval, range, choice, and int() and tag(log, )
# Launcher settings a sweep's record never sets: where its jobs write.
WHERE = re.compile(r"(^|\.)(\w*dir|\w*dirpath|\w*path|\w*folder|\w*_uri|\w*file|filename|root)$")
# The keys a record carries: those that decide what a run computes. Where its data is read and whether it is
# downloaded, where it writes, what its loggers are named and where they log, and code to call (strategy.hook_state)
# come from conf/ and the typed command only; a key not listed here is not taken, however it is named.
CARRIED = re.compile(r"""(accelerator|devices|num_nodes|precision|channels_last|compile|cuda_graphs|steps_per_execution
    |sync_batchnorm|max_epochs|seed|tags|test_weights|checkpoint\.every_n_train_steps
    |model(\.[A-Za-z]\w*)+|optim\.[A-Za-z]\w*|strategy\.(?!hook_state$)[A-Za-z]\w*|data\.(?!download$|root$)[A-Za-z]\w*
    |trainer\.(?P<trainer>\w+)|callbacks\.time_to_accuracy\.targets|callbacks\.best_checkpoint\.(monitor|mode))""",
    re.X | re.ASCII)


def carried(key: str) -> bool:
    """Whether a record may set `key` (`CARRIED`; a Trainer argument that conf/trainer's schema names)."""
    from src.config import RULES  # the schema's Trainer arguments

    found = CARRIED.fullmatch(key)
    return bool(found) and (found.group("trainer") is None or key in RULES)


LAUNCHERS, SWEEPERS = ("sequential", "parallel", "slurm"), ("optuna",)
# A config group's option by its name, found where Hydra looks (conf/ and a search path the command types), never a
# path to another file.
OPTION = re.compile(r"[A-Za-z0-9][\w-]*")


def scalar(token: str) -> Any:
    """A token as Hydra types a bare value (its lexer's rules, first match on a tie): a number, a whole number, a
    boolean or null in any case, else text; quoted, text."""
    if token[:1] in "'\"":
        return token[1:-1]
    if FLOAT.fullmatch(token):
        return float(token.replace("_", ""))
    if INT.fullmatch(token):
        return int(token.replace("_", ""))
    if token.lower() in ("true", "false", "null"):
        return None if token.lower() == "null" else token.lower() == "true"
    return token


def parts(text: str) -> list[str] | None:
    """Comma-separated scalar tokens (a quoted one may hold commas); None where any is not one."""
    found, at = [], 0
    while text.strip():
        token = re.compile(rf"\s*({QUOTED}|{BARE})\s*(,|$)").match(text, at)
        if token is None:
            return None
        found.append(token.group(1))
        if not token.group(2):
            return found
        at = token.end()
    return found


def items(text: str) -> list[Any] | None:
    """Comma-separated scalars; None where any is not one."""
    tokens = parts(text)
    return None if tokens is None else [scalar(token) for token in tokens]


def number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def value_of(text: str, sweep: bool = False) -> Any:
    """The typed value Hydra reads from a record's `text`, read by the rules above: a scalar, a list of scalars, and in
    a sweep scalars to sweep over (`a,b`) and the spaces `choice(...)`, `range(...)`, `shuffle(...)` of those,
    `interval(a, b)`, `int(interval(a, b))` and `tag(log, ...)` of those intervals, as Hydra's own sweep types.
    ValueError for anything else."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Quote, QuotedString, RangeSweep

    if SCALAR.fullmatch(text):
        return scalar(text)
    if text.startswith("[") and text.endswith("]") and (listed := items(text[1:-1])) is not None:
        return listed
    if not sweep:
        raise ValueError(text)
    call = CALL.fullmatch(text)
    if call is None:  # `a,b,c`: a sweep's simple form keeps quoted text quoted, as Hydra's does
        tokens = parts(text)
        if tokens is None or len(tokens) < 2:
            raise ValueError(text)
        return ChoiceSweep(list=[QuotedString(token[1:-1], Quote.single if token[0] == "'" else Quote.double)
                                 if token[:1] in "'\"" else scalar(token) for token in tokens], simple_form=True)
    name, inner = call.groups()
    if name == "shuffle":  # the same jobs, in an order drawn anew by each command that reads it
        inner_call = CALL.fullmatch(inner.strip())
        if inner_call and inner_call.group(1) in ("choice", "range"):
            spaced = value_of(inner.strip(), sweep)
        elif (listed := items(inner)) and len(listed) >= 2 and None not in listed:
            spaced = ChoiceSweep(list=listed, simple_form=True)
        else:
            raise ValueError(text)
        return replace(spaced, shuffle=True)
    if name == "choice" and (chosen := items(inner)) and None not in chosen:  # Hydra's choice() takes no null
        return ChoiceSweep(list=chosen)
    if name == "range" and (args := bound(inner, ("start", "stop", "step"))) and "start" in args \
            and args.get("step") != 0:
        start, stop = (0, args["start"]) if args.get("stop") is None else (args["start"], args["stop"])
        return RangeSweep(start=start, stop=stop, step=args.get("step", 1))
    if name == "tag" and (tagged := re.fullmatch(r"log,\s*(.*)", inner, re.S)):
        spaced = value_of(tagged.group(1), sweep)
        if isinstance(spaced, IntervalSweep):
            return IntervalSweep(start=spaced.start, end=spaced.end, tags={"log"})
    if name == "int" and isinstance(spaced := value_of(inner, sweep), IntervalSweep) and not spaced.tags \
            and spaced.start.is_integer() and spaced.end.is_integer():
        return IntervalSweep(start=int(spaced.start), end=int(spaced.end))
    if name == "interval" and (args := items(inner)) and len(args) == 2 and all(map(number, args)):
        return IntervalSweep(start=float(args[0]), end=float(args[1]))
    raise ValueError(text)


def bound(inner: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    """A call's numbers bound to `names` as Python binds them (positional first, then `name=`); None where they do
    not bind or one is not a number."""
    args: dict[str, Any] = {}
    named_before = False
    for index, piece in enumerate(inner.split(",") if inner.strip() else []):
        named = re.fullmatch(r"\s*(\w+)\s*=(.*)", piece)
        name, token = (named.group(1), named.group(2).strip()) if named else (None, piece.strip())
        if name is None and (named_before or index >= len(names)):
            return None  # a positional argument after a named one, or one too many
        named_before = named_before or name is not None
        name = name or names[index]
        if name not in names or name in args or not SCALAR.fullmatch(token) or not number(value := scalar(token)):
            return None
        args[name] = value
    return args


def emit(value: Any) -> str:
    """`value` (as `value_of` types it) as override text that Hydra reads back as exactly that value."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Quote, QuotedString, RangeSweep

    if isinstance(value, (ChoiceSweep, RangeSweep)) and value.shuffle:
        return f"shuffle({emit(replace(value, shuffle=False))})"
    if isinstance(value, IntervalSweep):
        space = f"interval({emit(value.start)}, {emit(value.end)})"
        space = f"int({space})" if isinstance(value.start, int) else space
        return f"tag(log, {space})" if "log" in value.tags else space
    if isinstance(value, RangeSweep):
        step = "" if value.step == 1 and isinstance(value.step, int) else f", step={emit(value.step)}"
        return f"range({emit(value.start)}, {emit(value.stop)}{step})"
    if isinstance(value, ChoiceSweep):
        listed = [emit(item) for item in value.list]
        return ",".join(listed) if value.simple_form else f"choice({', '.join(listed)})"
    if isinstance(value, list):
        return "[" + ",".join(emit(item) for item in value) + "]"
    if isinstance(value, QuotedString):
        quote = "'" if value.quote == Quote.single else '"'
        return emit_quoted(value.text, quote)
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if number(value):
        return repr(value)  # Hydra's lexer reads Python's repr of an int or a float, inf and nan included
    if isinstance(value, str):
        return value if re.fullmatch(BARE, value) and scalar(value) == value else emit_quoted(value, "'")
    raise ValueError(f"no override text for {type(value).__name__}")


def emit_quoted(text: str, quote: str) -> str:
    if not re.fullmatch(QUOTED, quote + text + quote):
        raise ValueError("quoted text holds quotes, $, \\ or control characters")
    return quote + text + quote


def plain(text: str, sweep: bool) -> bool:
    """Whether an override's value is one that `value_of` reads."""
    try:
        value_of(text, sweep)
    except ValueError:
        return False
    return True


SWEPT_LIMIT = 10_000  # values of one key a sweep's record may hold: each is a job, and a range may name millions


def swept_count(value: Any) -> int:
    """How many jobs a typed value names: a range's length, a sweep's choices, 1 for anything else."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    if isinstance(value, RangeSweep):
        return max(0, math.ceil((value.stop - value.start) / value.step))
    return len(value.list) if isinstance(value, ChoiceSweep) else 1


def settings(lines: Any, path: Path, sweep: bool = False, typed: set[str] = frozenset()) -> list[str]:
    """A run's (or a sweep's) recorded overrides, taken only as values: a group's option by its name in conf/, a key
    that `carried` names with a plain value, written out again from its typed value (the composed config is then
    checked as a typed command's is). A key of the config that a record does not carry is left to conf/ and the command; any other line is refused in one
    line naming the file and the key. A line whose key is `typed` is the command's, and is not read."""
    from src.config import DERIVED, GROUPS, TrainConfig, options  # the schema: its keys and groups

    top_level = set(TrainConfig.__dataclass_fields__) - set(DERIVED)
    kept = []
    for line in overrides(lines, path):
        prefix = re.match(r"\+\+|\+|~|", line).group()
        key, has_value, text = line[len(prefix):].partition("=")
        if key in typed or key == "ckpt_path":  # the command's own (a resume always gives ckpt_path)
            continue
        if not KEY.fullmatch(key):
            raise refused(path, key, text, "its key must be a key of the config (plain names joined by dots); a "
                                          "record may not name code, Hydra's settings or a package")
        if key in GROUPS and not prefix:
            listed = re.fullmatch(r"\[(.*)\]", text) if key == "logger" else None
            names = (listed.group(1) if listed else text).split(",")
            if not all(OPTION.fullmatch(name) for name in names) or len(names) > 1 and not (listed or sweep):
                raise refused(path, key, text, f"it must name an option of the {key} group (conf/{key}: "
                                               f"{options(key)}), never a path")
            kept.append(f"{key}=" + (f"[{','.join(names)}]" if listed else ",".join(names)))
            continue
        head = key.split(".")[0]
        if head == "hydra" or head not in top_level | set(GROUPS):
            raise refused(path, key, text, "a resume takes the run's own settings (keys of conf/train.yaml), never "
                                          "Hydra's or those derived from others")
        if prefix not in ("", "~") and not (prefix == "+" and head == "trainer"):
            raise refused(path, key, text, "a record may add no key but a lightning.Trainer argument")
        try:
            value = value_of(text, sweep) if has_value else None
        except ValueError:
            raise refused(path, key, text, "its value must be a number, true, false, null, a word or quoted text on "
                                          "one line without $, \\, quotes or control characters, or a list of them"
                                          + ("; in a sweep also a,b, choice(), range() and shuffle() of these, and "
                                             f"interval(), int(interval()), tag(log, ...): type {shown(key)[:SHOWN]}="
                                             "... as the sweep had it again to resume it" if sweep else "")) from None
        if swept_count(value) > SWEPT_LIMIT:
            raise refused(path, key, text[:80], f"a sweep's record names at most {SWEPT_LIMIT:,} values of a key "
                                                "(each is a job); type the sweep again to run more")
        if key == "strategy.hook" and not {str(getattr(v, "text", v)) for v in getattr(value, "list", [value])} <= {
                "none", "fp16", "bf16", "powersgd", "powersgd_fp16"}:
            raise refused(path, key, text, "a hook of one's own (an import path) is typed, never taken from a record")
        if not (carried(key) or prefix == "~" and re.fullmatch(r"callbacks\.[A-Za-z]\w*", key)):
            continue  # where it reads, writes or logs, or code: conf/'s or the command's (src.resume compares)
        kept.append(f"{prefix}{key}={emit(value)}" if has_value else f"{prefix}{key}")
    return kept


def launch_settings(lines: Any, path: Path) -> list[str]:
    """The launcher and sweeper a sweep ran with, by name, and their settings that are numbers, booleans or words,
    written out from their values: never a `setup` line, a folder, a class or an argument list."""
    kept = []
    for line in overrides(lines, path):
        key, _, text = line.partition("=")
        group = re.fullmatch(r"hydra/(launcher|sweeper)", key)
        setting = re.fullmatch(r"hydra\.(launcher|sweeper)\.[a-z]\w*", key)
        value = scalar(text) if SCALAR.fullmatch(text) else None
        if group and text in (LAUNCHERS if group.group(1) == "launcher" else SWEEPERS):
            kept.append(f"{key}={text}")
        elif setting and not WHERE.search(key) and key.rpartition(".")[2] != "setup" and (
                number(value) or isinstance(value, str) and re.fullmatch(r"[A-Za-z][\w-]*", value)):
            kept.append(f"{key}={emit(value)}")
    return kept


@dataclass(frozen=True)
class Result:
    """A run's `result.json`. `resumed`: it went on from a checkpoint of its folder; `skipped`: it only repeated the
    record of a run that had finished; `time_to_accuracy`: each target val/acc with the training seconds (warm-up
    included), the optimizer step at which the run first reached it and the warm-up seconds in them (`warmup_s`,
    absent from records written before), all None where it did not."""

    metrics: dict[str, float]
    line: str
    step: int = -1
    resumed: bool = False
    skipped: bool = False
    time_to_accuracy: list[dict[str, float | int | None]] = field(default_factory=list)

    def save(self, folder: Path) -> None:
        write_file(folder / RESULT, json.dumps(asdict(self), indent=1))


RESULT = "result.json"
CKPT_WORDS = ("last", "auto")  # ckpt_path's words for a run folder's newest checkpoint (src.checkpoints)


def has_checkpoints(run_dir: Path) -> bool:
    """Known by the files' names: reading a checkpoint takes torch (src.checkpoints), which a resume's settings do not."""
    return any((run_dir / "checkpoints").glob("*.ckpt"))


TO_TARGET = "time/to_val_acc_"  # and a target's name: the scalar of the seconds it took to reach it
HPARAMS_TO_TARGET = "time/s_to_val_acc_"  # and a target's name: the same, HParams' column, for every run
NOT_REACHED = -1.0  # that column where the run did not reach the target: HParams' parallel coordinates draw numbers


def hparams_target(name: str) -> str:
    """What HParams' time-to-accuracy column says of itself."""
    return (f"training seconds (as time/epoch_s counts them) until val/acc first reached {name}; {NOT_REACHED:g} where "
            "the run did not reach it (a number, so that HParams' parallel coordinates draw every run)")


def target_name(target: float) -> str:
    """A target val/acc as tags and tables name it: `0.85`, `0.80`; more decimals only where it has them (`0.925`)."""
    return f"{target:.2f}" if abs(target * 100 - round(target * 100)) < 1e-9 else f"{target:g}"


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
    return Result({str(k): float(v) for k, v in metrics.items()}, shown(line), step,  # printed as it was written
                  time_to_accuracy=reached_targets(select(data, "time_to_accuracy")))


def reached_targets(data: Any) -> list[dict[str, float | int | None]]:
    """`Result.time_to_accuracy` as typed values; [] where the record holds none, or something else."""
    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(data, list):
        return []
    typed = []
    for entry in data:
        if not (isinstance(entry, dict) and number(entry.get("target")) and 0 < entry["target"] <= 1):
            return []
        seconds, step = entry.get("seconds"), entry.get("step")
        if (seconds is None) != (step is None) or seconds is not None and not (
                number(seconds) and seconds >= 0 and isinstance(step, int) and not isinstance(step, bool)):
            return []
        warmup = entry.get("warmup_s")
        if warmup is not None and not (number(warmup) and 0 <= warmup <= (seconds or 0)):
            return []
        typed.append({"target": float(entry["target"]), "seconds": None if seconds is None else float(seconds),
                      "step": step, **({"warmup_s": None if warmup is None else float(warmup)}
                                       if "warmup_s" in entry else {})})
    return typed
