"""`steps_per_execution` and `cuda_graphs`: several optimizer steps per training batch train what one a batch
trains, counts stay counts of optimizer steps, and the settings are refused where they cannot work.

CUDA graphs themselves need a GPU: tests/test_gpu.py runs them against eager steps. Here a stand-in
replays the step on CPU as a graph does, to check what the module does around the graph.
"""

import copy

import pytest
import torch
from hydra.utils import instantiate
from lightning import Callback, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy

from src.data.fashion_mnist import FashionMNISTDataModule
from src.errors import UsageError
from src.fast_path import (STEPS_PER_EXECUTION, TORCH_FP32_MATH, FastSteps, GraphedStep, float32_math, hooks_in_step,
                           resolve_fast_steps)
from src.models import module
from src.models.lenet import LeNet
from tests.equivalence import checkpoint, deviation
from tests.helpers import DATA_ROOT, composed, scalar_steps, scalars, train_here

SMALL = [f"data.root={DATA_ROOT}", "precision=32", "data.batch_size=64", "trainer.limit_train_batches=4",
         "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false",
         "trainer.enable_model_summary=false", "optim.momentum=0.9"]


def resolve(cuda_graphs="auto", steps="auto", **overrides) -> FastSteps:
    args = dict(accelerator="gpu", world_size=1, strategy="auto", compile=False, trainer_args={}, supported=True)
    return resolve_fast_steps(cuda_graphs, steps, **{**args, **overrides})


def test_auto_takes_several_steps_in_one_process_and_graphs_only_on_one_cuda_device():
    assert resolve() == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=True)
    assert resolve(strategy=SingleDeviceStrategy()) == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=True)
    assert resolve(accelerator="cpu") == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=False)
    assert resolve(compile=True) == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=False, compiled=True)
    assert resolve(cuda_graphs=True, compile=True) == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=True, compiled=True)
    assert resolve(world_size=2) == FastSteps(1, cuda_graphs=False)
    assert resolve(strategy=object()) == FastSteps(1, cuda_graphs=False)  # dp
    assert resolve(trainer_args={"accumulate_grad_batches": 2}) == FastSteps(1, cuda_graphs=False)
    assert resolve(trainer_args={"gradient_clip_val": 1.0}) == FastSteps(1, cuda_graphs=False)
    assert resolve(supported=False) == FastSteps(1, cuda_graphs=False)


def test_auto_takes_the_largest_number_of_steps_that_divides_every_step_count():
    assert resolve(step_counts={"trainer.limit_train_batches": 4}).steps_per_execution == 4
    assert resolve(step_counts={"checkpoint.every_n_train_steps": 100, "trainer.max_steps": -1}).steps_per_execution == 4
    assert resolve(step_counts={"trainer.max_steps": 7}).steps_per_execution == 1
    assert resolve(steps=3, accelerator="cpu").steps_per_execution == 3  # explicit steps need no GPU


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(cuda_graphs=True, accelerator="cpu"), "cuda_graphs=true needs a CUDA device; use cuda_graphs=false"),
    (dict(steps=4, world_size=2), "steps_per_execution=4 needs a strategy of one process on one device (strategy=auto)"),
    (dict(steps=4, trainer_args={"accumulate_grad_batches": 2}), "steps_per_execution=4 needs trainer.accumulate_grad_batches=1"),
    (dict(steps=3, step_counts={"trainer.limit_train_batches": 4}),
     "steps_per_execution=3 does not divide trainer.limit_train_batches=4; use a divisor of it"),
])
def test_what_cannot_work_is_refused_naming_the_option(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(**{"cuda_graphs": kwargs.pop("cuda_graphs", "auto"), "steps": kwargs.pop("steps", "auto"), **kwargs})


def test_cuda_graphs_are_off_by_default_until_a_gpu_has_measured_them():
    cfg = composed()
    assert cfg.cuda_graphs is False
    assert resolve(cfg.cuda_graphs) == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=False)  # on one CUDA device too


class GradientNorms(Callback):
    """A user's callback that reads gradients as they are made: inside the step a CUDA graph replays."""

    def on_after_backward(self, trainer, pl_module) -> None:
        pass


class NormedClassifier(module.Classifier):
    def on_before_backward(self, loss) -> None:
        pass


def test_a_hook_a_replay_would_skip_refuses_cuda_graphs_true_in_one_line_and_leaves_auto_eager():
    hooks = hooks_in_step(lenet(), [GradientNorms()])
    assert hooks == ["GradientNorms.on_after_backward"]
    with pytest.raises(UsageError) as refused:
        resolve(True, hooks=hooks)
    assert str(refused.value) == ("cuda_graphs=true needs no hook that runs inside the training step, where a replay "
                                  "skips it (here: GradientNorms.on_after_backward); use cuda_graphs=false")
    assert resolve("auto", hooks=hooks) == FastSteps(STEPS_PER_EXECUTION, cuda_graphs=False)
    torch.manual_seed(0)
    assert hooks_in_step(NormedClassifier(LeNet(), torch.optim.SGD), []) == ["NormedClassifier.on_before_backward"]


def test_the_projects_own_callbacks_and_module_leave_the_step_whole_for_a_replay(tmp_path):
    callbacks = [instantiate(node) for node in composed(f"output_dir={tmp_path}").callbacks.values()]
    assert len(callbacks) > 3 and hooks_in_step(lenet(), callbacks) == []


@pytest.fixture
def torch_float32_math():
    yield
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = TORCH_FP32_MATH


def math() -> tuple[str, str]:
    return torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision


def test_precision_32_on_cuda_computes_in_float32_and_the_other_runs_keep_torchs_defaults(torch_float32_math):
    assert TORCH_FP32_MATH[0] == "tf32"  # what torch does unless told: cuDNN convolves float32 in TF32
    assert float32_math(composed("precision=32", "accelerator=cpu").precision_used, "gpu") and math() == ("ieee", "ieee")
    assert not float32_math("bf16-mixed", "gpu") and math() == TORCH_FP32_MATH  # a sequential sweep's next run
    assert not float32_math("32-true", "cpu") and math() == TORCH_FP32_MATH


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_root):
    """Two epochs of 4 steps with one step a batch and with two; one epoch with one step a batch, resumed with two: runs
    of one process each, trained in this one."""
    root = tmp_path_factory.mktemp("fast_steps")
    dirs = {name: root / name for name in ("one", "two", "first_epoch", "resumed")}
    results = [
        train_here(*SMALL, "max_epochs=2", "steps_per_execution=1", f"hydra.run.dir={dirs['one']}"),
        train_here(*SMALL, "max_epochs=2", "steps_per_execution=2", f"hydra.run.dir={dirs['two']}"),
        train_here(*SMALL, "max_epochs=1", "steps_per_execution=1", f"hydra.run.dir={dirs['first_epoch']}"),
    ]
    results.append(train_here(*SMALL, "max_epochs=2", "steps_per_execution=2", f"hydra.run.dir={dirs['resumed']}",
                              f"ckpt_path={dirs['first_epoch'] / 'checkpoints' / 'last.ckpt'}"))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return dirs


def test_two_steps_a_batch_train_what_one_step_a_batch_trains(runs):
    one, two = checkpoint(runs["one"]), checkpoint(runs["two"])
    assert one["global_step"] == two["global_step"] == 8  # limit_train_batches counts optimizer steps either way
    assert deviation(two, one) < 1e-4
    assert scalars(runs["two"])["train/loss"] == pytest.approx(scalars(runs["one"])["train/loss"], rel=1e-5)


def test_every_point_sits_at_its_optimizer_step_as_with_one_step_a_batch(runs):
    """Lightning logs at the training batches it took; TensorBoard shows every series at the same steps either way,
    also in a run that resumed a checkpoint of one step a batch (its folder holds the second epoch only)."""
    one, two = scalar_steps(runs["one"]), scalar_steps(runs["two"])
    assert one["val/acc"] == [3, 7] and one["test/acc"] == [7]  # the test at the last training step
    assert two == one
    second_epoch = {tag: [step for step in steps if step > 3] for tag, steps in one.items()}
    assert scalar_steps(runs["resumed"]) == second_epoch


def test_a_checkpoint_resumes_across_steps_per_execution(runs):
    resumed, one = checkpoint(runs["resumed"]), checkpoint(runs["one"])
    assert resumed["global_step"] == 8  # the 4 steps taken before the checkpoint count
    assert deviation(resumed, one) < 1e-4


def test_a_count_that_the_steps_do_not_divide_is_one_line(tmp_path, data_root):
    run_dir = tmp_path / "run"
    result = train_here(*SMALL, "steps_per_execution=3", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: steps_per_execution=3 does not divide trainer.limit_train_batches=4; use a divisor of it, "
        "or steps_per_execution=auto")
    assert "Traceback" not in result.stderr and not run_dir.exists()


class ReplayedOnCpu(GraphedStep):
    """A GraphedStep whose graph is played on CPU: capturing runs the step once, and a replay runs it again and
    writes what it computed into the tensors of the capture, whatever the parameters' `.grad` hold by then,
    as a CUDA graph writes the memory it was captured with."""

    def _capture(self, step):
        self.step = step
        return step(self.x, self.y)

    def _replay(self):
        held = [param.grad for param, _ in self.grads]
        for param, _ in self.grads:
            param.grad = None
        loss, logits = self.step(self.x, self.y)
        for (param, captured), grad in zip(self.grads, held):
            captured.copy_(param.grad)
            param.grad = grad
        self.loss.copy_(loss)
        self.logits.copy_(logits)


def fit(classifier: module.Classifier, data_root, **trainer_args) -> None:
    """Epochs of 16 optimizer steps of 32 images, on CPU, in training batches of the classifier's steps."""
    data = FashionMNISTDataModule(root=str(data_root), batch_size=32, download=False)
    data.steps_per_execution = classifier.fast_steps.steps_per_execution
    settings = dict(accelerator="cpu", max_epochs=1, limit_train_batches=16 // data.steps_per_execution, limit_val_batches=0,
                    num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, use_distributed_sampler=False)
    Trainer(**{**settings, **trainer_args}).fit(classifier, datamodule=data)


def lenet(momentum: float = 0.9) -> module.Classifier:
    """The LeNet classifier these tests train, the same weights each call."""
    torch.manual_seed(0)
    return module.Classifier(LeNet(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=momentum))


def eager_and_graphed(monkeypatch) -> dict[str, module.Classifier]:
    """Two copies of one LeNet classifier, 8 steps a batch, the second with the graph played on CPU."""
    monkeypatch.setattr(module, "GraphedStep", ReplayedOnCpu)
    eager = lenet()
    modules = {"eager": eager, "graphs": copy.deepcopy(eager)}
    for name, classifier in modules.items():
        classifier.use_fast_steps(FastSteps(8, cuda_graphs=name == "graphs"), step_batch_size=32)
    return modules


def assert_same_weights(trained: module.Classifier, reference: module.Classifier) -> None:
    for (key, a), b in zip(reference.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(b, a, msg=key)


def test_under_autocast_each_step_of_a_batch_computes_with_the_weights_the_last_one_left(data_root):
    """Lightning opens one autocast context per training batch, with autocast's weight cache off: the cache
    does not see in-place updates, and would serve the batch's later steps the weights of its first."""
    one = lenet()
    eight = copy.deepcopy(one)
    eight.use_fast_steps(FastSteps(8), step_batch_size=32)
    for classifier in (one, eight):
        fit(classifier, data_root, precision="bf16-mixed")
    assert_same_weights(eight, one)


def test_graph_replays_keep_training_after_lightning_drops_the_gradients_to_validate(data_root, monkeypatch):
    """Lightning sets every `.grad` to None before validating; replays after it must still step the optimizer."""
    modules = eager_and_graphed(monkeypatch)
    initial = copy.deepcopy(modules["eager"].net.state_dict())
    for classifier in modules.values():
        fit(classifier, data_root, max_epochs=3, limit_val_batches=1)
    assert isinstance(modules["graphs"].graphed, ReplayedOnCpu)
    assert all(not torch.equal(initial[key], value) for key, value in modules["eager"].net.state_dict().items())
    assert_same_weights(modules["graphs"], modules["eager"])


def test_a_graph_serves_the_next_fit_unless_it_holds_another_precision(data_root, monkeypatch):
    modules = eager_and_graphed(monkeypatch)
    for classifier in modules.values():
        fit(classifier, data_root)
    graph = modules["graphs"].graphed
    for classifier in modules.values():
        fit(classifier, data_root)
    assert modules["graphs"].graphed is graph
    assert_same_weights(modules["graphs"], modules["eager"])
    fit(modules["graphs"], data_root, precision="bf16-mixed")
    assert modules["graphs"].graphed is not graph


def test_a_compiled_network_is_captured_without_compiling_again(data_root, monkeypatch):
    """`cuda_graphs=true compile=true`: the capture runs under the autocast state of the warm steps before it
    (Lightning's, weight cache off), or torch.compile would compile again inside the capture, where it cannot."""
    monkeypatch.setattr(module, "GraphedStep", ReplayedOnCpu)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    torch._dynamo.reset()
    classifier = lenet(momentum=0.0)
    classifier.net.compile(backend="aot_eager")  # dynamo's guards without a C++ compiler's minutes
    classifier.use_fast_steps(FastSteps(8, cuda_graphs=True, compiled=True), step_batch_size=32)
    fit(classifier, data_root, precision="bf16-mixed")
    assert isinstance(classifier.graphed, ReplayedOnCpu) and classifier.trainer.global_step == 16
    torch._dynamo.reset()


class RefusesHostWaits(ReplayedOnCpu):
    """A capture that fails, as CUDA's does, when the step waits for the device (`.item()`) while being captured."""

    def _capture(self, step):
        def refused(tensor):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "item", refused)
            return super()._capture(step)


class CheckedLeNet(LeNet):
    """A user's LeNet that checks its input on the host in every forward pass: a wait for the device on a GPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.isfinite(x.abs().max()).item():
            raise ValueError("non-finite input")
        return super().forward(x)


def test_a_network_that_waits_for_the_device_falls_back_to_eager_steps_with_one_line(data_root, monkeypatch, caplog):
    monkeypatch.setattr(module, "GraphedStep", RefusesHostWaits)
    torch.manual_seed(0)
    modules = {name: module.Classifier(net(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
               for name, net in (("eager", CheckedLeNet), ("graphs", CheckedLeNet), ("plain", LeNet))}
    modules["graphs"].load_state_dict(modules["eager"].state_dict())
    for name, classifier in modules.items():
        classifier.use_fast_steps(FastSteps(8, cuda_graphs=name != "eager"), step_batch_size=32)
    with caplog.at_level("WARNING", logger="src.models.module"):
        for classifier in modules.values():
            fit(classifier, data_root)
    assert isinstance(modules["plain"].graphed, RefusesHostWaits)  # the stand-in captures a step that does not wait
    assert modules["graphs"].graphed is None and not modules["graphs"].fast_steps.cuda_graphs
    assert modules["graphs"].trainer.global_step == 16
    assert [r.getMessage() for r in caplog.records if r.name == "src.models.module"] == [
        "cuda_graphs: the training step cannot be captured as a CUDA graph (CUDA error: operation not permitted when "
        "stream is capturing); it runs eagerly"]
    assert_same_weights(modules["graphs"], modules["eager"])
