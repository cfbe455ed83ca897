import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.optim import LR_SCALINGS, optimizer_args, scaled_lr


@pytest.mark.parametrize("global_batch", [32, 256, 1024])
def test_no_scaling_keeps_the_learning_rate(global_batch):
    assert scaled_lr(0.1, global_batch, "none", base_batch_size=256) == 0.1


def test_linear_scaling_is_proportional_to_the_global_batch():
    lr, base = 0.1, 256
    assert scaled_lr(lr, base, "linear", base) == pytest.approx(lr)
    for factor in (0.25, 2, 4):
        assert scaled_lr(lr, int(base * factor), "linear", base) == pytest.approx(lr * factor)
    assert scaled_lr(lr, 96, "linear", base_batch_size=32) == pytest.approx(3 * lr)


def test_the_default_base_batch_is_the_books_256():
    assert scaled_lr(0.2, 512, "linear") == pytest.approx(2 * scaled_lr(0.2, 256, "linear"))
    assert scaled_lr(0.2, 256, "linear") == pytest.approx(0.2)


@pytest.mark.parametrize("bad", ["Linear", "sqrt", "", None])
def test_unknown_scaling_is_a_usage_error_naming_the_choices(bad):
    with pytest.raises(UsageError, match=f"optim.lr_scaling={bad}.*{', '.join(LR_SCALINGS)}"):
        scaled_lr(0.1, 256, bad)


@pytest.mark.parametrize("bad", [0, -256, 2.5, True, "256"])
def test_bad_base_batch_size_is_a_usage_error(bad):
    with pytest.raises(UsageError, match="optim.base_batch_size"):
        scaled_lr(0.1, 256, "linear", bad)


def test_optimizer_args_consume_the_scaling_keys_of_the_config():
    optim = OmegaConf.create({"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "lr_scaling": "linear", "base_batch_size": 128})
    args = optimizer_args(optim, global_batch=512)
    assert args == {"lr": pytest.approx(0.4), "momentum": 0.9, "weight_decay": 5e-4}
    assert optim.lr == 0.1, "the config itself is left as it is"


def test_optimizer_args_without_scaling_keys_leave_lr_alone():
    assert optimizer_args({"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}, global_batch=4096)["lr"] == 0.1


def test_the_classifier_optimizer_uses_the_scaled_lr():
    args = optimizer_args({"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "lr_scaling": "linear"}, global_batch=1024)
    optimizer = Classifier(LeNet(), **args).configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 1024 / 256)
    assert optimizer.param_groups[0]["momentum"] == 0.9
