import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.models.lenet import LeNet
from src.models.module import Classifier
from src.optim import Schedule, build_optimizer, check_optimizer, scaled_lr
from tests.helpers import on_a_trainer


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


SGD = {"_target_": "torch.optim.SGD", "_partial_": True}


def test_the_optimizer_takes_no_scaling_or_schedule_key_of_the_config():
    optim = OmegaConf.create({**SGD, "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "lr_scaling": "linear",
                              "base_batch_size": 128, "schedule": "cosine", "warmup": 0.1})
    factory = build_optimizer(optim, global_batch=512)
    assert factory.keywords == {"lr": pytest.approx(0.4), "momentum": 0.9, "weight_decay": 5e-4}
    assert optim.lr == 0.1, "the config itself is left as it is"
    assert build_optimizer({**SGD, "lr": 0.1, "momentum": 0.0}, global_batch=4096).keywords["lr"] == 0.1


def test_the_classifier_optimizer_uses_the_scaled_lr():
    optim = {**SGD, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0, "lr_scaling": "linear"}
    optimizer = on_a_trainer(Classifier(LeNet(), optimizer=build_optimizer(optim, global_batch=1024))).configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 1024 / 256)
    assert optimizer.param_groups[0]["momentum"] == 0.9


def test_any_optimizer_class_is_a_config_away():
    """Neither the Classifier nor src/optim.py names an optimizer: the config's _target_ does."""
    optim = {"_target_": "torch.optim.RMSprop", "_partial_": True, "lr": 0.01, "alpha": 0.9, "lr_scaling": "linear", "base_batch_size": 64}
    optimizer = on_a_trainer(Classifier(LeNet(), optimizer=build_optimizer(optim, global_batch=128))).configure_optimizers()
    assert isinstance(optimizer, torch.optim.RMSprop)
    assert optimizer.param_groups[0]["alpha"] == 0.9 and optimizer.param_groups[0]["lr"] == pytest.approx(0.02)


def test_an_optimizer_config_that_cannot_be_built_is_one_line():
    with pytest.raises(UsageError) as caught:
        build_optimizer({**SGD, "_target_": "torch.optim.Adamm", "lr": 0.1}, global_batch=256)
    assert str(caught.value).startswith("optim._target_=torch.optim.Adamm: Error locating target")
    assert "\n" not in str(caught.value)


def test_an_argument_the_optimizer_refuses_is_one_line_before_training():
    factory = build_optimizer({"_target_": "torch.optim.Adam", "_partial_": True, "lr": 0.1, "betas": [0.9, 1.5]}, 256)
    with pytest.raises(UsageError, match=r"^optim: Adam refuses its arguments \(Invalid beta parameter"):
        check_optimizer(factory, LeNet().parameters())
    factory = build_optimizer({**SGD, "lr": 0.1, "nesterov_typo": True}, 256)
    with pytest.raises(UsageError, match="^optim: SGD refuses its arguments .*nesterov_typo"):
        check_optimizer(factory, LeNet().parameters())


def test_cosine_schedule_warms_up_then_falls_to_zero():
    schedule = Schedule("cosine", warmup=0.1)
    factors = [schedule.factor(step, total_steps=100) for step in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0) and factors[55] == pytest.approx(0.5) and factors[100] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert Schedule().factor(50, 100) == 1.0


def test_the_classifier_steps_its_schedule_every_optimizer_step(data_root, tmp_path):
    from lightning import Trainer
    from src.data.fashion_mnist import FashionMNISTDataModule

    optimizer = build_optimizer(OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1}), 256)
    module = Classifier(LeNet(), optimizer, schedule=Schedule("cosine"))
    trainer = Trainer(max_epochs=1, limit_train_batches=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=FashionMNISTDataModule(root=str(data_root), batch_size=64))
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # 4 of 4 steps taken
