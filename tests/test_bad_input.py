"""Every input a user can type is checked: one `error: ...` line naming the option, exit status 2, no run folder.

The rules are tested in this process on the config Hydra composes (`src.config.check`), Hydra's own refusals through
the line `src.config.explain` makes of them, and what was typed through `check_args`; the command line is tested once
per way a run can fail (Hydra's composition, the checks, the launch, building, the checkpoint, inside Lightning's fit,
and a loss that diverges).
"""

import inspect
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import open_dict
from torch.utils.data import DataLoader, TensorDataset

from src import config
from src.callbacks.finite_loss import FiniteLossCheck
from src.checkpoints import check_checkpoint, open_checkpoint, resolve_ckpt_path
from src.errors import TrainingDiverged, UsageError, build
from src.models.module import Classifier
from src.tasks import check_model
from tests.helpers import QUICK, command_here, composed, free_port, hparams, train_with_ranks


def here(*args: str):
    """`python -m src.train <args>` in this process: what it says and leaves, not a process's behaviour."""
    return command_here("src.train", *args)


def refused(check, *args) -> str:
    with pytest.raises(UsageError) as caught:
        check(*args)
    message = str(caught.value)
    assert "\n" not in message
    return message


def hydra_refusal(*overrides: str) -> str:
    """The one line a command gets where Hydra refuses to compose these overrides."""
    with pytest.raises(Exception) as caught:
        composed(*overrides)
    line = config.explain(caught.value, list(overrides))
    assert line is not None and "\n" not in line, caught.value
    return line


def group_options(group: str) -> list[str]:
    return sorted(path.stem for path in (config.CONF_DIR / group).glob("*.yaml"))


# --- the composed config, in-process ---------------------------------------------------------------------


@pytest.mark.parametrize("group", ["model", "optim", "strategy", "experiment", "data", "debug"])
def test_every_shipped_option_passes_the_checks(group):
    for option in group_options(group):
        config.check(composed(f"{group}={option}"))


OUT_OF_RANGE = {
    "optim.lr=-0.1": "optim.lr must be a number above 0",
    "optim.lr=0": "optim.lr must be a number above 0",
    "optim.lr=inf": "optim.lr must be a number above 0",
    "optim.momentum=-0.5": "optim.momentum must be a number at least 0 and below 1",
    "optim.momentum=1": "optim.momentum must be a number at least 0 and below 1",
    "optim.weight_decay=-1e-4": "optim.weight_decay must be a number at least 0",
    "model.loss.label_smoothing=2": "model.loss.label_smoothing must be a number at least 0 and at most 1",
    "model.loss.label_smoothing=-0.1": "model.loss.label_smoothing must be a number at least 0 and at most 1",
    "optim.base_batch_size=0": "optim.base_batch_size must be a whole number of at least 1",
    "data.batch_size=0": "data.batch_size must be a whole number of at least 1",
    "data.batch_size=64.5": "data.batch_size must be a whole number",
    "data.val_size=-1": "data.val_size must be a whole number of at least 0",
    "data.val_size=ten": "data.val_size must be a whole number",
    "data.download=yes": "data.download must be one of: true, false",
    "data.shuffle=1": "data.shuffle must be one of: true, false",
    "data.root=3": "data.root must be a non-empty string",
    "seed=-1": "seed must be a whole number from 0 to 4294967295",
    "seed=4294967296": "seed must be a whole number from 0 to 4294967295",
    "sync_batchnorm=maybe": "sync_batchnorm must be one of: true, false",
    "num_nodes=0": "num_nodes must be a whole number of at least 1",
    "devices=0": "devices must be a whole number of at least 1",
    "precision=8-mixed": "precision must be one of auto, 32, 16-mixed, bf16-mixed, 64, or Lightning's other spellings",
    "accelerator=tpu": "accelerator must be one of: auto, cpu, gpu, cuda",
    "optim.lr_scaling=sqrt": "optim.lr_scaling must be one of: none, linear",
    "optim.schedule=step": "optim.schedule must be one of: none, cosine",
    "optim.warmup=1.0": "optim.warmup must be a number at least 0 and below 1",
    "~optim._partial_": "optim._partial_ must be true (the Classifier calls the optimizer with its parameters)",
    "ckpt_path=''": "ckpt_path must be null, or a non-empty string",
    "model.net.num_classes=5": "it must equal data.num_classes=10, what the data holds",
    "model.num_classes=5": "it must equal data.num_classes=10",
    "model.net.in_channels=3": "it must equal data.in_channels=1",
    "data.num_classes=1": "data.num_classes must be a whole number of at least 2",
    "data.in_channels=0": "data.in_channels must be a whole number of at least 1",
    "optim._partial_=false": "optim._partial_ must be true (the Classifier calls the optimizer with its parameters)",
    "trainer.limit_train_batches=0": "trainer.limit_train_batches must be null, or a whole number of at least 1",
    "trainer.limit_train_batches=-1": "trainer.limit_train_batches must be null",
    "trainer.limit_train_batches=0.0": "a fraction in (0, 1]",
    "trainer.limit_train_batches=1.5": "a fraction in (0, 1]",
    "trainer.limit_val_batches=-1": "trainer.limit_val_batches must be null, or a whole number of at least 0",
    "trainer.limit_test_batches=0": "trainer.limit_test_batches must be null, or a whole number of at least 1",
    "trainer.log_every_n_steps=0": "trainer.log_every_n_steps must be null, or a whole number of at least 1",
    "trainer.accumulate_grad_batches=0": "trainer.accumulate_grad_batches must be a whole number of at least 1",
    "trainer.check_val_every_n_epoch=0": "trainer.check_val_every_n_epoch must be null, or a whole number of at least 1",
    "trainer.max_steps=0": "trainer.max_steps must be -1 (no limit), or a whole number of at least 1",
    "trainer.max_steps=-2": "trainer.max_steps must be -1 (no limit)",
    "trainer.min_steps=-1": "trainer.min_steps must be null, or a whole number of at least 0",
    "trainer.gradient_clip_val=-1": "trainer.gradient_clip_val must be null, or a number at least 0",
    "trainer.gradient_clip_algorithm=max": "trainer.gradient_clip_algorithm must be null, or one of: norm, value",
    "trainer.val_check_interval=0": "trainer.val_check_interval must be null, or a whole number of at least 1",
    "trainer.val_check_interval=2.0": "a fraction in (0, 1]",
    "trainer.num_sanity_val_steps=-2": "trainer.num_sanity_val_steps must be null, or a whole number of at least -1",
    "trainer.fast_dev_run=true": "trainer.fast_dev_run must be false",
    "trainer.fast_dev_run=3": "trainer.fast_dev_run must be false",
    "trainer.barebones=true": "trainer.barebones must be false",
    "trainer.max_time=1h": "trainer.max_time must be null, or a duration DD:HH:MM:SS above zero",
    "trainer.max_time=00:00:00:00": "a duration DD:HH:MM:SS above zero",
    "trainer.enable_progress_bar=no": "trainer.enable_progress_bar must be null, or one of: true, false",
    "trainer.deterministic=always": "trainer.deterministic must be null, or one of: true, false, or warn",
    "trainer.profiler=fancy": "trainer.profiler must be null, or one of: simple, advanced, pytorch",
    "trainer.inference_mode=1": "trainer.inference_mode must be one of: true, false",
    "trainer.reload_dataloaders_every_n_epochs=-1": "a whole number of at least 0",
    "trainer.overfit_batches=-1": "trainer.overfit_batches must be a whole number of at least 0",
    "callbacks.best_checkpoint.monitor=val/accuracy": "callbacks.best_checkpoint.monitor must be one of: val/acc",
    "callbacks.best_checkpoint.mode=maximum": "callbacks.best_checkpoint.mode must be one of: min, max",
    "checkpoint.every_n_train_steps=-1": "checkpoint.every_n_train_steps must be a whole number of at least 0",
    # rules across keys
    "trainer.min_epochs=20": "it must be at most max_epochs=10",
    "trainer.enable_checkpointing=false": "remove them with ~callbacks.best_checkpoint ~callbacks.last_checkpoint",
    "~callbacks.best_checkpoint ~callbacks.last_checkpoint trainer.enable_checkpointing=false":
        "remove them with ~callbacks.step_checkpoint",
    "strategy=dp devices=2 sync_batchnorm=true": "each GPU's replica normalises with its own shard; use strategy=ddp",
    "num_nodes=2": "torchrun or SLURM (see docs/cluster.md)",
    "strategy=ddp strategy.hook=zip": "strategy.hook must be one of: none, fp16, bf16, powersgd, powersgd_fp16, or the import path",
    "strategy=ddp strategy.powersgd_rank=0": "strategy.powersgd_rank must be a whole number of at least 1",
    "strategy=ddp strategy.start_powersgd_iter=1": "(PowerSGD's error feedback needs plain all-reduce steps first)",
    "strategy=ddp strategy.timeout_s=0": "strategy.timeout_s must be a number above 0",
    "strategy=ddp strategy.process_group_backend=ucc": "strategy.process_group_backend must be null, or one of: gloo, nccl, mpi",
    "strategy=ddp strategy.static_graph=1": "strategy.static_graph must be one of: true, false",
}


@pytest.mark.parametrize("override", OUT_OF_RANGE)
def test_out_of_range_values_are_refused_naming_the_key(override):
    message = refused(config.check, composed(*override.split()))
    key = override.split()[-1].split("=")[0].lstrip("~+")
    assert message.startswith(f"{key}=") and " is not allowed; " in message
    assert OUT_OF_RANGE[override] in message


WRONG_TYPES = {  # refused by the schema (src/config.py) when Hydra composes; on the command line, before that
    "seed=abc": "seed must be a whole number from 0 to 4294967295",
    "seed=null": "seed must be a whole number from 0 to 4294967295",
    "max_epochs=x": "max_epochs must be a whole number of at least 1",
    "devices=1.5": "devices must be a whole number of at least 1",
    "checkpoint.every_n_train_steps=ten": "checkpoint.every_n_train_steps must be a whole number of at least 0",
}


@pytest.mark.parametrize("override", WRONG_TYPES)
def test_values_of_the_wrong_type_are_refused_naming_the_key(override):
    message = hydra_refusal(override)
    assert message.startswith(f"{override} is not allowed; ") and WRONG_TYPES[override] in message


ACCEPTED = [
    "optim.lr=1e-5", "optim.momentum=0.99", "optim.weight_decay=0", "seed=0", "seed=4294967295", "model.loss.label_smoothing=1",
    "data.val_size=0", "precision=64", "trainer.limit_train_batches=1",
    "trainer.limit_train_batches=0.5", "trainer.limit_train_batches=1.0", "trainer.limit_val_batches=0",
    "trainer.max_steps=-1", "trainer.max_steps=100", "trainer.max_time=00:01:30:00", "trainer.num_sanity_val_steps=-1",
    "trainer.gradient_clip_val=0", "trainer.gradient_clip_val=0.5", "trainer.gradient_clip_algorithm=value",
    "trainer.val_check_interval=0.25", "trainer.val_check_interval=20", "trainer.check_val_every_n_epoch=null",
    "trainer.deterministic=warn", "trainer.profiler=simple", "trainer.min_epochs=10", "trainer.overfit_batches=0.1",
]


@pytest.mark.parametrize("override", ACCEPTED)
def test_values_in_range_pass(override):
    config.check(composed(override))


def test_more_than_one_node_is_fine_under_a_launcher(monkeypatch):
    for name, value in {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    config.check(composed("num_nodes=2", "strategy=ddp"))


# --- keys and groups: what was typed, and Hydra's refusals in one line ---------------------------------------

UNKNOWN_KEYS = {  # refused by Hydra while it composes, said in one line
    "unknown_key=1": "unknown_key is not a known key (top-level keys: accelerator,",
    "optim.learning_rate=0.1": "optim.learning_rate is not a known key; did you mean optim.lr?",
    "data.batchsize=64": "data.batchsize is not a known key; did you mean data.batch_size?",
    "callbacks.best_checkpoint.monitr=val/acc": "did you mean callbacks.best_checkpoint.monitor?",
    "trainer.max_epoch=3": "trainer.max_epoch is not a lightning.Trainer argument; did you mean max_epochs? (a top-level key",
    "trainer.epochs=3": "trainer.epochs is not a known key; did you mean trainer.min_epochs?",
    "+optim.lr=0.1": "+optim.lr: optim.lr is already in the config; set it with optim.lr=...",
    "optim=rmsprop": "optim=rmsprop is not an option; choose one of: adam, sgd",
    "debug=slow": "debug=slow is not an option; choose one of: fdr, limit, overfit, profiler, quick",
    "model=resnet19": "model=resnet19 is not an option; did you mean model=resnet18? choose one of: lenet, resnet18",
    # a key below one that is not there: its parent's keys, never a key that does not exist either
    "model.optimizer.lr=0.1": "model.optimizer.lr is not a known key: model has no optimizer (model's keys: _recursive_, "
                              "loss, net, num_classes)",
    "optim.lr=[": "optim.lr=[ is not allowed; it must follow Hydra's override grammar",
}


@pytest.mark.parametrize("override", UNKNOWN_KEYS)
def test_unknown_keys_are_refused_with_the_closest_known_key(override):
    assert UNKNOWN_KEYS[override] in hydra_refusal(override)


TYPED = {  # refused as typed, before Hydra composes anything
    "++unknown=1": None,  # added: then refused by the rules, as a key no rule knows
    "trainer.max_epochs=3": "trainer.max_epochs is set by the top-level key; use max_epochs=... instead",
    "~model": "~model is not allowed; choose model=<option> instead",
    "~debug": "~debug is not allowed; choose debug=<option> instead",
    "output_dir=/tmp/x": "output_dir is derived from the other settings; set hydra.run.dir=<folder> instead",
    "precision_used=32-true": "precision_used is derived from the other settings; set precision and accelerator instead",
    "threads=4": "threads is derived from the other settings; set OMP_NUM_THREADS (or taskset's cores) instead",
    "model.net._target_=torch.nn.Identity": "model.net._target_ is set by the config group; choose model=<option>",
    "optim._target_=torch.optim.Adam": "optim._target_ is set by the config group; choose optim=<option>",
    "--devices": "--devices is not an option; settings are typed key=value: devices=...",
    # a template's habits: an empty group is refused in one line, not Hydra's traceback
    "logger=[]": "logger=[] is not allowed; every run logs to TensorBoard, whose figures are the run's record "
                 "(logger=tensorboard is TensorBoard alone); choose logger=<option> (csv, mlflow, tensorboard, wandb)",
    "logger=null": "logger=null is not allowed; every run logs to TensorBoard",
    "callbacks=null": "callbacks=null is not allowed; its callbacks write the run's checkpoints and figures",
    "debug=null": "debug=null is not allowed; it is the default: leave it out, or choose debug=<option> (fdr, limit, "
                  "overfit, profiler, quick)",
    "optim.lr=[": "optim.lr=[ is not allowed; it must follow Hydra's override grammar",
}


@pytest.mark.parametrize("override", TYPED)
def test_what_a_command_line_may_not_type_is_refused_before_hydra(override):
    if TYPED[override] is None:
        config.check_args([override])
        assert refused(config.check, composed(override)).startswith("unknown is not a known key (top-level keys:")
    else:
        assert refused(config.check_args, [override]).startswith(TYPED[override])


def test_keys_are_still_checked_under_debug_quick():
    config.check(composed("debug=quick", "trainer.limit_train_batches=10", "max_epochs=2"))
    assert hydra_refusal("debug=quick", "trainer.limit_train_batchs=10").startswith(
        "trainer.limit_train_batchs is not a known key; did you mean trainer.limit_train_batches?")
    assert refused(config.check, composed("debug=quick", "trainer.limit_train_batches=0")).startswith(
        "trainer.limit_train_batches=0 is not allowed")


def test_a_key_of_a_group_option_that_lacks_it_names_the_option():
    config.check(composed("strategy=ddp_fp16", "strategy.powersgd_rank=2"))
    assert hydra_refusal("strategy=auto", "strategy.hook=fp16").startswith("strategy.hook is not a known key of strategy=auto")


def test_a_new_callback_needs_its_target():
    assert refused(config.check, composed("+callbacks.extra.logging_interval=step")).startswith(
        "callbacks.extra has no _target_; a new callback needs +callbacks.extra._target_=")
    assert refused(config.check, composed("+callbacks.extra._target_=nowhere.Callback")).startswith(
        "callbacks.extra._target_=nowhere.Callback is not allowed; it must name a class of an importable module")


@pytest.mark.parametrize("args", [["~callbacks.comm"], ["hydra/launcher=basic"], ["trainer.overfit_batches=2"],
                                  ["+callbacks.lr._target_=lightning.pytorch.callbacks.LearningRateMonitor",
                                   "+callbacks.lr.logging_interval=step"],
                                  ["experiment=d2l_lenet", "optim.lr=0.3"], ["++trainer.max_steps=5"]])
def test_known_keys_pass(args):
    config.check_args(args)
    config.check(composed(*args))


def test_a_model_config_that_cannot_be_built_is_one_line():
    cfg = composed("model=lenet")
    with open_dict(cfg):
        cfg.model.net.depth = 3
    message = refused(build, "model", cfg.model)
    assert message.startswith("model: Error in call to target 'src.models.module.Classifier'") and "depth" in message
    cfg = composed("model=lenet")
    with open_dict(cfg):
        cfg.model._target_ = "torch.nn.Identity"
    assert refused(check_model, build("model", cfg.model), cfg.model._target_, (1, 28, 28), 10).startswith(
        "model._target_=torch.nn.Identity is not allowed; it must name a LightningModule")


def test_a_network_that_does_not_fit_the_data_is_one_line():
    lenet = Classifier(instantiate(composed("model=lenet").model.net))
    check_model(lenet, "x", (1, 28, 28), 10)
    assert refused(check_model, lenet, "x", (1, 28, 28), 7) == (
        "model: the network gives outputs of shape (10,) for the data's images, not one score for each of its 7 classes")
    assert refused(check_model, lenet, "x", (1, 32, 32), 10).startswith(
        "model: the network cannot take the data's images of shape (1, 32, 32)")


# --- checkpoints -------------------------------------------------------------------------------------------


def lenet_checkpoint(path: Path) -> Path:
    """A Lightning-shaped checkpoint holding a LeNet classifier's weights."""
    path.parent.mkdir(parents=True, exist_ok=True)
    module = Classifier(instantiate(composed("model=lenet").model.net))
    torch.save({"state_dict": module.state_dict(), "epoch": 0, "global_step": 4}, path)
    return path


def test_a_checkpoint_must_be_one_of_this_model(tmp_path):
    resnet = Classifier(instantiate(composed("model=resnet18").model.net))
    lenet = Classifier(instantiate(composed("model=lenet").model.net))
    text, empty = tmp_path / "notes.txt", tmp_path / "empty.ckpt"
    text.write_text("hello, this is not a checkpoint\n")
    empty.write_bytes(b"")
    for path in (text, empty):
        message = refused(check_checkpoint, open_checkpoint(path), str(path), lenet, "lenet")
        assert message.startswith(f"ckpt_path={path} is not allowed; {path} is not a checkpoint file")
    torch.save({"weights": 1}, tmp_path / "other.ckpt")
    assert "holds no state_dict" in refused(check_checkpoint, open_checkpoint(tmp_path / "other.ckpt"), "x", lenet, "lenet")
    ckpt = lenet_checkpoint(tmp_path / "lenet.ckpt")
    message = refused(check_checkpoint, open_checkpoint(ckpt), str(ckpt), resnet, "resnet18")
    assert "it holds another model than model=resnet18" in message
    check_checkpoint(open_checkpoint(ckpt), str(ckpt), lenet, "lenet")


# --- the command line, through its own entry in this process, once per way a run fails ----------------------------------------------------

BAD_INPUTS = {
    "unknown model": (["model=vgg"], "model=vgg is not an option; choose one of: lenet, resnet18"),
    "unknown strategy in a sweep": (["-m", "strategy=ddp,bogus"], "strategy=bogus is not an option"),
    "misspelled key": (["optim.learning_rate=0.1"], "optim.learning_rate is not a known key; did you mean optim.lr?"),
    "run folder below /proc": (["hydra.run.dir=/proc/nope/run"], "error: /proc/nope: No such file or directory"),
    "negative learning rate": (["optim.lr=-0.1"], "optim.lr=-0.1 is not allowed; optim.lr must be a number above 0"),
    "batch not divisible": (["strategy=ddp", "devices=2", "data.batch_size=255"], "data.batch_size=255"),
    "strategy knob": (["strategy=ddp", "devices=2", "strategy.hook=zip"], "strategy.hook=zip is not allowed"),
    "classes the data lacks": (["data.num_classes=5"], "data.num_classes=5 is not allowed; Fashion-MNIST has 10 classes"),
    "optimizer argument": (["optim=adam", "optim.betas=[0.9,1.5]"], "optim: Adam refuses its arguments (Invalid beta parameter"),
    "a sweep's bad value": (["-m", "seed=1,abc"], "seed=abc is not allowed; seed must be a whole number"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_fails_with_one_line_and_no_run_folder(tmp_path, data_root, case):
    args, message = BAD_INPUTS[case]
    run_dir = tmp_path / "run"
    result = here(*QUICK, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *args)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1]
    assert "Traceback" not in result.stderr and len([line for line in lines if line.startswith("error: ")]) == 1
    assert not run_dir.exists() and not (tmp_path / "sweep").exists()


def test_auto_strategy_on_two_devices_and_a_missing_checkpoint_are_refused(tmp_path):
    assert refused(config.check, composed("devices=2")) == (
        "strategy=auto runs on one device, not devices=2; use strategy=ddp (or dp on GPUs)")
    assert "ckpt_path=last: no checkpoint" in refused(resolve_ckpt_path, "last", tmp_path)


def test_a_resumed_run_keeps_its_folder_when_its_input_is_bad(tmp_path, quick_run):
    run_dir = quick_run.copy(tmp_path)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    result = here(*QUICK, f"hydra.run.dir={run_dir}", "ckpt_path=last", "model=resnet18")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: model=resnet18 is not allowed in a resume of {run_dir}: the run used model=lenet")
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    checkpoint = lenet_checkpoint(tmp_path / "alone" / "checkpoints" / "last.ckpt")
    result = here(*QUICK, f"hydra.run.dir={tmp_path / 'alone'}", "ckpt_path=last")
    assert result.returncode == 2 and checkpoint.is_file()
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'alone' / '.hydra' / 'overrides.yaml'} is missing: a resume takes the run's settings from "
        "it; resume a folder that a run wrote, or start a new run elsewhere")


def test_lightning_refusals_inside_ddp_fit_give_one_line(tmp_path, data_root, monkeypatch):
    """`val_check_interval` above the batches is refused by Lightning inside a DDP process's fit: one line, no folder.
    This process is the one rank of a world of one, as torchrun starts it; a rank's failure on 2 processes started by
    this project's launcher, one line for both, is the diverging loss's test below."""
    for name, value in (("RANK", "0"), ("GROUP_RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                        ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    try:
        result = here(*QUICK, "strategy=ddp", "devices=1", "trainer.val_check_interval=50", f"hydra.run.dir={run_dir}")
    finally:
        if torch.distributed.is_initialized():  # torchrun's rank would end here
            torch.distributed.destroy_process_group()
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: trainer.val_check_interval: `val_check_interval` (50) must be less than")
    assert "Traceback" not in result.stderr and len([line for line in lines if line.startswith("error: ")]) == 1
    assert not run_dir.exists()


# --- runs that train -----------------------------------------------------------------------------------------


def test_a_diverging_loss_stops_the_run_naming_step_and_rate(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = here(*QUICK, "optim.lr=1e30", f"hydra.run.dir={run_dir}")
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: train/loss is nan at step ") and "(epoch 1) with learning rate 1e+30; lower optim.lr" in last
    assert "Traceback" not in result.stderr and "test/acc=" not in result.stdout
    assert not run_dir.exists()


@pytest.mark.slow
def test_a_diverging_loss_under_ddp_stops_every_process_with_one_line(tmp_path, data_root, capfd):
    run_dir = tmp_path / "run"
    result = train_with_ranks(capfd, *QUICK, "strategy=ddp", "devices=2", "optim.lr=1e30", f"hydra.run.dir={run_dir}")
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: train/loss is nan at step ")
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_precision_64_trains_end_to_end(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = here(*QUICK, "precision=64", "data.batch_size=32", "trainer.limit_train_batches=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert hparams(run_dir)["precision_used"] == "64-true"
    weights = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert weights["net.0.weight"].dtype == torch.float64


def test_every_trainer_argument_has_a_rule_and_the_precisions_are_lightnings():
    """A Trainer argument without a rule in src/config.py would be refused as unknown; the precisions the rules list
    are those `Trainer(precision=...)` declares."""
    declared = inspect.signature(Trainer.__init__).parameters
    for name in set(declared) - {"self"} - config.OWNED_BY_TOP_LEVEL:
        assert config.rule_for(f"trainer.{name}") is not None, name
    literals = typing.get_args(declared["precision"].annotation)
    assert set(config.LIGHTNING_PRECISIONS) == {str(v) for literal in literals for v in typing.get_args(literal)}


class DivergesAt(LightningModule):
    """A tiny regression whose loss is nan from batch `bad_batch` on (16 batches an epoch)."""

    def __init__(self, bad_batch: int) -> None:
        super().__init__()
        self.bad_batch = bad_batch
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        return loss * float("nan") if batch_idx >= self.bad_batch else loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.ones(32, 2)), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(("bad_batch", "every_n_steps", "stopped_after"), [(4, 1, 5), (4, 3, 6), (15, 100, 16)])
def test_the_first_bad_step_is_named_before_a_checkpoint_is_written(tmp_path, bad_batch, every_n_steps, stopped_after):
    """Read every few steps, as on a GPU, the record still names the first bad step; read at the
    latest at epoch end, before the checkpoint callback saves the epoch."""
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "checkpoints"), FiniteLossCheck(every_n_steps=every_n_steps)]
    trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, default_root_dir=tmp_path)
    with pytest.raises(TrainingDiverged, match=rf"^train/loss is nan at step {bad_batch} \(epoch 1\) with learning rate 0.01; "):
        trainer.fit(DivergesAt(bad_batch))
    assert trainer.global_step == stopped_after
    assert not (tmp_path / "checkpoints").exists()


def test_a_checkpoint_due_between_the_checks_is_not_written_after_a_bad_step(tmp_path):
    """The record is read before any checkpoint is built, also one a step interval makes due mid-epoch."""
    callbacks = [ModelCheckpoint(dirpath=tmp_path / "checkpoints", every_n_train_steps=2), FiniteLossCheck(every_n_steps=100)]
    trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, default_root_dir=tmp_path)
    with pytest.raises(TrainingDiverged, match=r"^train/loss is nan at step 5 \(epoch 1\) "):
        trainer.fit(DivergesAt(5))
    assert trainer.global_step == 6
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["epoch=0-step=4.ckpt"]


def test_across_processes_the_record_is_read_every_50_steps_whatever_the_logging_interval():
    """A read across processes is a collective, a meeting of every rank: per-step logging must not add one per step."""
    check = FiniteLossCheck()
    trainer = SimpleNamespace(world_size=2, log_every_n_steps=1, global_step=0, current_epoch=0)
    check.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))
    reads = []
    check.check = lambda trainer: reads.append(trainer.global_step)
    for batch_idx in range(120):
        trainer.global_step = batch_idx
        check.on_train_batch_start(trainer, None, None, batch_idx)
        check.on_train_batch_end(trainer, None, torch.tensor(1.0), None, batch_idx)
    assert reads == [49, 99]


@pytest.mark.parametrize(("args", "message"), [
    (["--devices", "2"], "--devices is not an option; settings are typed key=value: devices=2"),
    (["--max_epochs=3"], "--max_epochs=3 is not an option; settings are typed key=value: max_epochs=3"),
    (["trainer.max_epoch=3"], "trainer.max_epoch is not a lightning.Trainer argument; did you mean max_epochs? "
                              "(a top-level key: max_epochs=...)"),
    (["precision=fp16"], "precision=fp16 is not allowed; did you mean precision=16-mixed? precision must be one of auto"),
])
def test_a_near_miss_gets_what_was_meant(tmp_path, args, message):
    result = here(f"hydra.run.dir={tmp_path / 'run'}", *args)  # in this test's folder: outputs/ is every test's
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), result.stderr


def test_the_keys_an_unknown_key_is_told_are_those_a_user_can_set():
    listed = hydra_refusal("foo=1").split("top-level keys: ", 1)[1]
    assert "max_epochs" in listed and not {"model_name", "strategy_name", "run_name", "output_dir", "precision_used",
                                             "threads", "hydra"} & set(listed.rstrip(")").split(", "))


def test_a_missing_checkpoint_or_data_folder_and_an_uneven_global_batch_are_refused_by_the_checks(tmp_path):
    """What the config and the file system decide is refused by the checks (src/config.py), before torch loads
    (tests/test_cli.py runs them as commands, src.eval's too): the data module and the launch meet these only in a
    rank that torchrun started, or under a strategy the checks do not know."""
    missing, nodata = tmp_path / "missing.ckpt", tmp_path / "nodata"
    assert refused(config.check, composed(f"ckpt_path={missing}")) == (
        f"ckpt_path={missing}: no checkpoint at {missing}; give a .ckpt file, `last` or `auto`")
    assert refused(config.check, composed(f"data.root={nodata}", "data.download=false")).startswith(
        f"data.root={nodata}: Fashion-MNIST not found in {nodata / 'FashionMNIST' / 'raw'} (data.download=false); ")
    assert refused(config.check, composed("data.batch_size=10", "strategy=ddp", "devices=4")) == (
        "data.batch_size=10 is the global batch and must be a positive multiple of the 4 processes "
        "(devices x num_nodes); try 8")
    config.check(composed(f"data.root={nodata}"))  # downloaded where it is missing: the data module tries
    config.check(composed("data.batch_size=10", "strategy=ddp", "devices=2"))
    config.check(composed("data.batch_size=10", "strategy=dp", "devices=4"))  # one process: dp splits by itself
    config.check(composed("ckpt_path=last"))  # the run folder's: src/checkpoints.py looks
    assert not nodata.exists()


def test_a_refusal_a_built_class_makes_itself_is_its_own_line_not_hydras_wrapping(tmp_path):
    """A logger that finds a link in the run's folder refuses in its own words; Hydra's instantiate wraps that in
    `Error in call to target ...`, which `build` takes off. Hydra's own refusals keep the group's name."""
    (tmp_path / "metrics.csv").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageError) as refused:
        build("logger.csv", {"_target_": "src.folders.read_bytes", "path": str(tmp_path / "metrics.csv"), "limit": 1})
    assert str(refused.value).startswith(f"{tmp_path / 'metrics.csv'} is a symbolic link; a run reads and writes only")
    with pytest.raises(UsageError) as refused:
        build("logger.csv", {"_target_": "src.no_such_module.Logger"})
    assert str(refused.value).startswith("logger.csv: Error locating target 'src.no_such_module.Logger'")
