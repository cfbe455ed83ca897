"""The fast path: `precision=auto`, `channels_last`, `compile` and cuDNN autotuning."""

import resource
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from src import fast_path
from src.fast_path import cudnn_benchmark, keep_freed_memory, one_channel_nchw_pays, resolve_precision, speed_up
from src.models.lenet import LeNet
from src.models.resnet import resnet18
from tests.helpers import QUICK, WARNING_LINE, Run, hparams, train_here


@pytest.mark.parametrize(("cpu_bf16", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_precision_on_a_cpu_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, cpu_bf16, expected):
    monkeypatch.setattr(fast_path, "cpu_has_bf16", lambda: cpu_bf16)
    assert resolve_precision("auto", "cpu") == expected


def test_explicit_precisions_are_left_alone_by_auto(monkeypatch):
    monkeypatch.setattr(fast_path, "cpu_has_bf16", lambda: True)
    assert resolve_precision("32", "cpu") == "32-true" and resolve_precision("64", "cpu") == "64-true"
    assert resolve_precision("16-mixed", "cpu") == "bf16-mixed"


@pytest.mark.parametrize(("benchmark", "deterministic", "expected"),
                         [(None, None, True), (None, False, True), (None, True, False), (None, "warn", False),
                          (False, None, False), (True, True, True)])
def test_cudnn_autotuning_is_on_unless_asked_off_or_deterministic(benchmark, deterministic, expected):
    assert cudnn_benchmark(benchmark, deterministic) is expected


@pytest.mark.parametrize("make", [LeNet, resnet18])
@pytest.mark.parametrize("one_channel_nchw", [False, True])
def test_channels_last_changes_the_layout_not_the_numbers(make, one_channel_nchw):
    torch.manual_seed(0)
    plain = make().eval()
    fast = speed_up(make().eval(), channels_last=True, compile=False, one_channel_nchw=one_channel_nchw)
    fast.load_state_dict(plain.state_dict())
    # With one input channel or a 1x1 kernel both layouts are the same bytes: those are not asked to differ.
    convs = [m.weight for m in fast.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels > 1 and m.kernel_size != (1, 1)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous() for w in convs)
    # A one-channel input's convolution has NHWC strides too, unless asked to keep NCHW ones (DDP on CUDA).
    first = next(m.weight for m in fast.modules() if isinstance(m, torch.nn.Conv2d) and m.in_channels == 1)
    nchw, nhwc = torch.empty(first.shape).stride(), torch.empty(first.shape, memory_format=torch.channels_last).stride()
    assert nchw != nhwc and first.stride() == (nchw if one_channel_nchw else nhwc)
    x = torch.randn(8, 1, 28, 28)
    torch.testing.assert_close(fast(x), plain(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("accelerator", "strategy", "expected"), [
    ("gpu", DDPStrategy(), True), ("gpu", "auto", False), ("cpu", DDPStrategy(), False), ("cpu", "auto", False)])
def test_only_ddp_on_cuda_keeps_one_channel_convolutions_in_nchw(accelerator, strategy, expected):
    assert one_channel_nchw_pays(accelerator, strategy) is expected


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["quick_run", "ddp_run"])
def test_a_cpu_run_convolves_every_layer_in_channels_last(request, fixture):
    """The checkpoint keeps each weight's strides: the first convolution's are NHWC's, on one process and under DDP,
    whose gloo buckets then get gradients of their own strides (no warning)."""
    run: Run = request.getfixturevalue(fixture)
    weight = torch.load(run.dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]["net.0.weight"]
    assert weight.shape[1] == 1 and weight.stride() == torch.empty(weight.shape, memory_format=torch.channels_last).stride()
    logs = "".join(log.read_text() for log in run.dir.glob("train*.log"))
    assert "Grad strides do not match" not in run.result.stderr + logs
    assert not WARNING_LINE.findall(run.result.stderr)  # nor any other: those known to be harmless are filtered


def faults_of_a_fresh_block() -> int:
    """Minor page faults of allocating, touching and freeing 64 MiB: 16,384 pages, each faulted in if the
    memory came fresh from the kernel."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_cpu_step_reuses_freed_memory_without_page_faults():
    """glibc maps a block this large afresh at every allocation and faults it in page by page (a CPU run
    of this process may have kept freed memory already: the setting is the process's)."""
    assert keep_freed_memory()
    for _ in range(3):  # as a run's first steps do, the heap grows to hold the block where it is freed
        faults_of_a_fresh_block()
    assert faults_of_a_fresh_block() < 16_384 / 100


def test_defaults_are_the_fast_path(quick_run: Run):
    """A run with no speed options uses precision=auto and channels_last, and says what auto chose."""
    params = hparams(quick_run.dir)
    assert params["precision"] == "auto" and params["channels_last"] == 1 and params["compile"] == 0  # TensorBoard keeps bools as numbers
    assert params["precision_used"] == fast_path.auto_precision("cpu").replace("32", "32-true")


@pytest.mark.slow  # compiles
def test_compile_trains_and_keeps_the_checkpoint_keys(tmp_path, monkeypatch):
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # compiles here, without a pool of compile workers
    run_dir = tmp_path / "run"
    result = train_here(*QUICK, "compile=true", "trainer.limit_train_batches=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert hparams(run_dir)["compile"] == 1
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    net_keys = {k.removeprefix("net.") for k in state if k.startswith("net.")}
    assert net_keys == set(LeNet().state_dict())  # no `_orig_mod.`: the checkpoint loads into a plain LeNet


def test_compile_with_dp_is_refused_in_one_line(tmp_path):
    result = train_here(*QUICK, "compile=true", "strategy=dp", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: compile=true is not allowed") and "strategy=dp" in line
    assert not Path(tmp_path / "run").exists()
