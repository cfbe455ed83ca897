"""The schema of the primary config (`conf/train.yaml`): OmegaConf refuses a value of the wrong type
when Hydra composes it, so `seed=abc` never reaches a run.

Registered in Hydra's ConfigStore as `train_schema`, which `conf/train.yaml` names first in its
defaults. Ranges and choices with reasons are not types: `src/checks` checks those. Some keys stay
`Any`: a switch, because OmegaConf's bool also takes `yes`, `on` and `1`, which the checks refuse
(`1` is not `true`); a key of two types (`precision`: 32 or bf16-mixed), as OmegaConf 2.3 has no
Union; and the config groups, whose keys are the arguments of the class a group option names.
A new top-level key needs a field here, and a rule in src/checks/schema.py for its range.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

SCHEMA_NAME = "train_schema"


@dataclass
class CheckpointConfig:
    every_n_train_steps: int = MISSING


@dataclass
class TrainConfig:
    accelerator: str = MISSING
    devices: int = MISSING
    num_nodes: int = MISSING
    precision: Any = MISSING
    channels_last: Any = MISSING
    compile: Any = MISSING
    cuda_graphs: Any = MISSING
    steps_per_execution: Any = MISSING
    sync_batchnorm: Any = MISSING
    max_epochs: int = MISSING
    seed: int = MISSING
    ckpt_path: str | None = None
    tags: list[str] = field(default_factory=list)
    test_weights: str = MISSING
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model_name: str = MISSING
    strategy_name: str = MISSING
    run_name: str = MISSING
    output_dir: str = MISSING
    model: dict[str, Any] = field(default_factory=dict)
    optim: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)  # a typed node could not drop an argument: ~trainer.<name>
    callbacks: dict[str, Any] = field(default_factory=dict)
    logger: dict[str, Any] = field(default_factory=dict)


ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
