"""What every config key may hold: one table, read by `checks.check_config`.

The types of the top-level keys are also the schema's (src/config.py), which Hydra enforces while it
composes; a rule here adds the range and gives the words of both refusals. The config groups' keys
and the Trainer's arguments have no schema type (see src/config.py): their rules are the whole check.
A key of the composed config that no pattern here matches is unknown and refused. Patterns
use shell wildcards: `strategy.*` and `callbacks.*.*` are the arguments of the object a config
group names, which that object checks itself (e.g. `CommHookDDPStrategy.check_options`);
the command-line check refuses keys those groups' files do not have.
"""

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from src.checks.lightning_names import precisions


PRECISIONS = ["auto", *precisions()]  # `auto`, then every value `Trainer(precision=...)` takes
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
SEED_MAX = 2**32 - 1  # Lightning's seed_everything takes what numpy does: 0 .. 2**32 - 1
# What the Classifier logs, so what a checkpoint callback can watch.
METRICS = ("val/acc", "val/acc_best", "val/loss", "train/acc", "train/loss")


def shown(value: Any) -> str:
    """A value as it is typed on the command line: `null`, `true`, `1e+30`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@dataclass(frozen=True)
class Rule:
    """A test of one value, and the words that say what passes it."""

    test: Callable[[Any], bool]
    allowed: str

    def __or__(self, other: "Rule") -> "Rule":
        return Rule(lambda v: self.test(v) or other.test(v), f"{self.allowed}, or {other.allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, float) and math.isfinite(value)) or _is_int(value)


def whole(lo: int | None = None, hi: int | None = None) -> Rule:
    """A whole number in [lo, hi]."""
    if hi is not None:
        words = f"a whole number from {lo} to {hi}"
    else:
        words = "a whole number" + (f" of at least {lo}" if lo is not None else "")
    return Rule(lambda v: _is_int(v) and (lo is None or v >= lo) and (hi is None or v <= hi), words)


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> Rule:
    """A finite number between lo and hi; the open ends are excluded."""
    parts = []
    if lo is not None:
        parts.append(f"above {lo}" if lo_open else f"at least {lo}")
    if hi is not None:
        parts.append(f"below {hi}" if hi_open else f"at most {hi}")

    def test(v: Any) -> bool:
        return _is_number(v) and (lo is None or (v > lo if lo_open else v >= lo)) and (
            hi is None or (v < hi if hi_open else v <= hi)
        )

    return Rule(test, "a number" + (" " + " and ".join(parts) if parts else ""))


def fraction(lo_open: bool) -> Rule:
    """A float share of the batches: 1.0 is all, 0.25 a quarter."""
    words = "a fraction in (0, 1]" if lo_open else "a fraction in [0, 1]"
    return Rule(lambda v: isinstance(v, float) and (0 < v if lo_open else 0 <= v) and v <= 1, words)


def one_of(*choices: Any, why: str = "") -> Rule:
    """One of `choices`, of the same type: `1` is not `true`, `"10"` is not `10`."""
    words = ("one of: " if len(choices) > 1 else "") + ", ".join(shown(c) for c in choices) + (f" ({why})" if why else "")
    return Rule(lambda v: any(type(v) is type(c) and v == c for c in choices), words)


def _is_duration(value: Any) -> bool:
    match = isinstance(value, str) and re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", value.strip())
    return bool(match) and any(int(part) for part in match.groups())


ANY = Rule(lambda v: True, "anything")
NULL = one_of(None)
BOOL = one_of(True, False)
TEXT = Rule(lambda v: isinstance(v, str) and v != "", "a non-empty string")
DURATION = Rule(_is_duration, "a duration DD:HH:MM:SS above zero, e.g. 00:01:30:00")
MAIN_PRECISIONS = ("auto", "32", "16-mixed", "bf16-mixed", "64")
PRECISION = Rule(lambda v: not isinstance(v, bool) and str(v) in PRECISIONS,
                 f"one of {', '.join(MAIN_PRECISIONS)}, or Lightning's other spellings of them "
                 f"({', '.join(p for p in PRECISIONS if p not in MAIN_PRECISIONS and not p.startswith('transformer'))})")
# Names other tools give a value, and the value they mean here: `precision=fp16` gets `did you mean 16-mixed?`.
ALIASES = {"precision": {"fp16": "16-mixed", "float16": "16-mixed", "half": "16-mixed", "amp": "16-mixed",
                         "bfloat16": "bf16-mixed", "fp32": "32", "float32": "32", "float": "32", "full": "32",
                         "fp64": "64", "float64": "64", "double": "64"}}

SCHEMA: dict[str, Rule] = {
    # conf/train.yaml
    "accelerator": one_of(*ACCELERATORS),
    "devices": whole(1),
    "num_nodes": whole(1),
    "precision": PRECISION,
    "sync_batchnorm": BOOL,
    "channels_last": BOOL,
    "compile": BOOL,
    "cuda_graphs": BOOL | one_of("auto"),
    "steps_per_execution": one_of("auto") | whole(1),
    "max_epochs": whole(1),
    "seed": whole(0, SEED_MAX),
    "ckpt_path": NULL | TEXT,  # a file, `last` or `auto`; src/checkpoints.py says whether it exists
    "test_weights": one_of("best", "last"),
    "checkpoint.every_n_train_steps": whole(0),
    "tags": Rule(lambda v: isinstance(v, list) and all(isinstance(t, str) and t for t in v), "a list of words, e.g. tags=[baseline,lr-sweep]"),
    "model_name": TEXT,
    "strategy_name": TEXT,
    "run_name": TEXT,
    "output_dir": TEXT,
    # conf/optim: a partial of an optimizer class; the keys below are checked here, the class checks
    # the rest of its arguments when src/optim.py builds it once before the run starts
    "optim._target_": TEXT,
    "optim._partial_": one_of(True, why="the Classifier calls the optimizer with its parameters"),
    "optim.lr": number(0, lo_open=True),
    "optim.momentum": number(0, 1, hi_open=True),  # 1 would keep every past gradient forever
    "optim.weight_decay": number(0),
    "optim.lr_scaling": one_of("none", "linear"),
    "optim.base_batch_size": whole(1),
    "optim.schedule": one_of("none", "cosine"),
    "optim.warmup": number(0, 1, hi_open=True),
    "optim.*": ANY,
    # conf/model: a LightningModule and its parts; num_classes and in_channels must be the data's
    # (checks.check_across_keys), the objects check their other arguments when built
    "model._target_": TEXT,
    "model.*._target_": TEXT,
    "model.loss.label_smoothing": number(0, 1),  # torch checks it only in the first forward pass
    "model.*": ANY,
    # conf/data
    "data.num_classes": whole(2),
    "data.in_channels": whole(1),
    "data._target_": TEXT,
    "data.root": TEXT,
    "data.batch_size": whole(1),
    "data.val_size": whole(0),  # its upper bound, the training images less one, is checked when the data is read
    "data.download": BOOL,
    "data.shuffle": BOOL,
    "data.seed": whole(0, SEED_MAX),
    "data.random_crop": whole(0),
    "data.hflip": BOOL,
    "data.*": ANY,  # a new data module's own arguments, which it checks itself
    # conf/strategy: the strategy object checks its own options
    "strategy.*": ANY,
    # conf/trainer: lightning.Trainer's arguments
    "trainer.max_steps": one_of(-1, why="no limit") | whole(1),
    "trainer.max_time": NULL | DURATION,
    "trainer.min_epochs": NULL | whole(0),
    "trainer.min_steps": NULL | whole(0),
    "trainer.limit_train_batches": NULL | whole(1) | fraction(lo_open=True),
    "trainer.limit_val_batches": NULL | whole(0) | fraction(lo_open=False),
    "trainer.limit_test_batches": NULL | whole(1) | fraction(lo_open=True),
    "trainer.limit_predict_batches": NULL | whole(0) | fraction(lo_open=False),
    "trainer.overfit_batches": whole(0) | fraction(lo_open=False),
    "trainer.val_check_interval": NULL | whole(1) | fraction(lo_open=True) | DURATION,
    "trainer.check_val_every_n_epoch": NULL | whole(1),
    "trainer.num_sanity_val_steps": NULL | whole(-1),
    "trainer.log_every_n_steps": NULL | whole(1),
    "trainer.enable_checkpointing": NULL | BOOL,
    "trainer.enable_progress_bar": NULL | BOOL,
    "trainer.enable_model_summary": NULL | BOOL,
    "trainer.accumulate_grad_batches": whole(1),
    "trainer.gradient_clip_val": NULL | number(0),
    "trainer.gradient_clip_algorithm": NULL | one_of("norm", "value"),
    "trainer.deterministic": NULL | BOOL | one_of("warn"),
    "trainer.benchmark": NULL | BOOL,
    "trainer.inference_mode": BOOL,
    "trainer.profiler": NULL | one_of("simple", "advanced", "pytorch"),
    "trainer.detect_anomaly": BOOL,
    "trainer.reload_dataloaders_every_n_epochs": whole(0),
    "trainer.enable_autolog_hparams": BOOL,
    # These three would turn off the logger and checkpoints that make a run folder a result.
    "trainer.fast_dev_run": one_of(False, why="for a short run use max_epochs=1 trainer.limit_train_batches=<n>"),
    "trainer.barebones": one_of(False, why="barebones turns off the logging and checkpoints of every run"),
    "trainer.model_registry": one_of(None, why="the model registry needs the litmodels package"),
    # conf/logger
    "logger._target_": TEXT,
    "logger.save_dir": TEXT,
    "logger.*": ANY,
    # conf/callbacks
    "callbacks.*._target_": TEXT,
    "callbacks.*_checkpoint.dirpath": TEXT,
    "callbacks.*_checkpoint.filename": TEXT,
    "callbacks.best_checkpoint.auto_insert_metric_name": BOOL,
    "callbacks.best_checkpoint.monitor": one_of(*METRICS),
    "callbacks.best_checkpoint.mode": one_of("min", "max"),
    "callbacks.best_checkpoint.save_last": BOOL | one_of("link"),
    "callbacks.*.*": ANY,
}
