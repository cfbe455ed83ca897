"""Every config group option composes, and instantiates into the object it names."""

import pytest
import yaml
from hydra.utils import instantiate
from lightning.pytorch.strategies import Strategy
from omegaconf import OmegaConf

from src.config import CONF_DIR
from src.errors import build
from src.models.module import Classifier
from src.optim import build_optimizer
from tests.helpers import composed, on_a_trainer
from tests.test_bad_input import group_options


@pytest.mark.parametrize("model", group_options("model"))
def test_model_options_build_a_ten_class_network(model):
    import torch

    cfg = composed(f"model={model}")
    module = build("model", cfg.model, optimizer=build_optimizer(cfg.optim, cfg.data.batch_size))
    assert isinstance(module, Classifier)
    assert module(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert cfg.model_name == model


@pytest.mark.parametrize("model", group_options("model"))
def test_model_options_take_classes_and_channels_from_the_data_config(model):
    import torch

    cfg = composed(f"model={model}", "data.num_classes=7", "data.in_channels=3")
    module = build("model", cfg.model, optimizer=build_optimizer(cfg.optim, cfg.data.batch_size))
    assert module(torch.zeros(2, 3, 28, 28)).shape == (2, 7)
    assert module.train_acc.num_classes == 7


@pytest.mark.parametrize("optim", group_options("optim"))
def test_optim_options_build_the_optimizer_they_name(optim):
    cfg = composed("model=lenet", f"optim={optim}", "optim.lr_scaling=linear", "data.batch_size=512")
    module = build("model", cfg.model, optimizer=build_optimizer(cfg.optim, cfg.data.batch_size))
    optimizer = on_a_trainer(module).configure_optimizers()
    assert type(optimizer).__name__ == cfg.optim._target_.rpartition(".")[2]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optim.lr * 2), "scaled: 512 / base 256"
    assert {"sgd", "adam"} <= set(group_options("optim"))


@pytest.mark.parametrize("strategy", group_options("strategy"))
def test_strategy_options_instantiate(strategy):
    cfg = composed(f"strategy={strategy}")
    built = instantiate(cfg.strategy, _convert_="all")
    assert built == "auto" if strategy == "auto" else isinstance(built, Strategy)
    assert cfg.strategy_name == strategy


@pytest.mark.parametrize("data", group_options("data"))
def test_data_options_instantiate_with_a_global_batch(data):
    cfg = composed(f"data={data}", "data.batch_size=96")
    assert instantiate(cfg.data).batch_size == 96


def test_experiment_recipes_set_the_books_settings():
    def settings(recipe: str) -> tuple:
        cfg = composed(f"experiment={recipe}")
        return cfg.model_name, cfg.optim.lr, cfg.data.batch_size, cfg.max_epochs

    assert settings("d2l_lenet") == ("lenet", 0.2, 256, 10)
    assert settings("d2l_resnet18") == ("resnet18", 0.1, 256, 10)
    assert set(group_options("experiment")) >= {"d2l_lenet", "d2l_resnet18"}


def test_command_line_overrides_win_over_recipes():
    cfg = composed("experiment=d2l_lenet", "optim.lr=0.05", "max_epochs=3")
    assert (cfg.optim.lr, cfg.max_epochs) == (0.05, 3)


def test_top_level_interface_keys_exist():
    cfg = composed()
    for key in ("devices", "accelerator", "num_nodes", "precision", "max_epochs", "seed", "ckpt_path",
                "data.batch_size", "data.root", "optim.lr", "optim.momentum",
                "optim.weight_decay", "trainer.limit_train_batches", "trainer.accumulate_grad_batches"):
        assert OmegaConf.select(cfg, key, throw_on_missing=True) is not None or key in ("ckpt_path", "trainer.limit_train_batches")


def test_run_folder_is_named_after_model_strategy_devices_and_precision_used():
    cfg = composed("model=resnet18", "strategy=ddp", "devices=4", "precision=16-mixed", "accelerator=cpu")
    assert cfg.run_name == "resnet18_ddp_4dev_bf16-mixed"  # fp16 autocast needs CUDA: the run uses bf16
    assert cfg.precision_used == "bf16-mixed"
    assert composed("precision=32", "num_nodes=2").run_name == "lenet_auto_1dev_2nodes_32-true"
    assert composed("experiment=d2l_lenet", "precision=32").run_name == "lenet_auto_1dev_32-true_d2l_lenet"
    run_dir = yaml.safe_load((CONF_DIR / "hydra" / "default.yaml").read_text())["run"]["dir"]
    assert run_dir == "${claim_dir:outputs/runs/${run_stamp:}_${run_name}}"


def test_debug_quick_shrinks_a_run_and_the_command_line_still_wins():
    full, quick = composed(), composed("debug=quick")
    assert (full.max_epochs, full.trainer.limit_train_batches) == (10, None)
    assert (quick.max_epochs, quick.trainer.limit_train_batches, quick.trainer.enable_progress_bar) == (1, 4, False)
    assert "debug" not in quick, "a global package: it sets existing keys and adds none"
    again = composed("debug=quick", "max_epochs=3", "trainer.limit_train_batches=20")
    assert (again.max_epochs, again.trainer.limit_train_batches, again.trainer.limit_val_batches) == (3, 20, 2)
    assert composed("experiment=d2l_lenet", "debug=quick").max_epochs == 1, "debug comes after a recipe"
