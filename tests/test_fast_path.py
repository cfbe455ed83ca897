"""The fast path: `precision=auto`, `channels_last`, `compile` and cuDNN autotuning."""

from pathlib import Path

import pytest
import torch

from src import fast_path
from src.fast_path import cudnn_benchmark, resolve_precision, speed_up
from src.models.lenet import LeNet
from src.models.resnet import resnet18
from tests.helpers import QUICK, Run, hparams, train


@pytest.mark.parametrize(("cpu_bf16", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_precision_on_a_cpu_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, cpu_bf16, expected):
    monkeypatch.setattr(fast_path, "cpu_has_bf16", lambda: cpu_bf16)
    assert resolve_precision("auto", "cpu") == expected


def test_explicit_precisions_are_left_alone_by_auto(monkeypatch):
    monkeypatch.setattr(fast_path, "cpu_has_bf16", lambda: True)
    assert resolve_precision("32", "cpu") == "32-true" and resolve_precision("64", "cpu") == "64-true"
    assert resolve_precision("16-mixed", "cpu", quiet=True) == "bf16-mixed"


@pytest.mark.parametrize(("benchmark", "deterministic", "expected"),
                         [(None, None, True), (None, False, True), (None, True, False), (None, "warn", False),
                          (False, None, False), (True, True, True)])
def test_cudnn_autotuning_is_on_unless_asked_off_or_deterministic(benchmark, deterministic, expected):
    assert cudnn_benchmark(benchmark, deterministic) is expected


@pytest.mark.parametrize("make", [LeNet, resnet18])
def test_channels_last_changes_the_layout_not_the_numbers(make):
    torch.manual_seed(0)
    plain = make().eval()
    fast = speed_up(make().eval(), channels_last=True, compile=False)
    fast.load_state_dict(plain.state_dict())
    # With one input channel or a 1x1 kernel both layouts are the same bytes: those are not asked to differ.
    convs = [m.weight for m in fast.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1 and m.kernel_size != (1, 1)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)
    # A one-channel input's convolution keeps the strides cuDNN gives its gradient (DDP compares them).
    first = next(m.weight for m in fast.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels == 1)
    assert first.stride() == torch.empty(first.shape).stride()
    x = torch.randn(8, 1, 28, 28)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-5)


def test_defaults_are_the_fast_path(quick_run: Run):
    """A run with no speed options uses precision=auto and channels_last, and says what auto chose."""
    params = hparams(quick_run.dir)
    assert params["precision"] == "auto" and params["channels_last"] == 1 and params["compile"] == 0  # TensorBoard keeps bools as numbers
    assert params["precision_used"] == fast_path.auto_precision("cpu").replace("32", "32-true")


@pytest.mark.slow
def test_compile_trains_and_keeps_the_checkpoint_keys(tmp_path):
    run_dir = tmp_path / "run"
    result = train(*QUICK, "compile=true", "trainer.limit_train_batches=2", f"hydra.run.dir={run_dir}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert hparams(run_dir)["compile"] == 1
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    net_keys = {k.removeprefix("net.") for k in state if k.startswith("net.")}
    assert net_keys == set(LeNet().state_dict())  # no `_orig_mod.`: the checkpoint loads into a plain LeNet


def test_compile_with_dp_is_refused_in_one_line(tmp_path):
    result = train(*QUICK, "compile=true", "strategy=dp", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: compile=true is not allowed") and "strategy=dp" in line
    assert not Path(tmp_path / "run").exists()
