"""docs/extending.md, followed as written: each new piece is a class in tests/examples/ and a config file,
run through the real command line with `hydra.searchpath` pointing at a folder holding that file.

The config files are the doc's own blocks (those starting `# conf/<group>/<name>.yaml`), so the
page cannot drift from what works. Each run is tiny (`debug=quick`).
"""

import json
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src import config
from tests.helpers import (DATA_ROOT, QUICK, REPO, command_here, composed, hparams, scalars, train_as_torchrun,
                           train_here)
from tests.test_bad_input import hydra_refusal

DOC = REPO / "docs" / "extending.md"


def doc_config_files() -> dict[str, str]:
    """`{"model/mlp.yaml": "<text>"}` for every yaml block of the doc that names its file."""
    blocks = re.findall(r"```yaml\n# conf/(\S+\.yaml)\n(.*?)```", DOC.read_text(), flags=re.S)
    return {path: text for path, text in blocks}


@pytest.fixture(scope="module")
def searchpath(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("my_conf")
    for path, text in doc_config_files().items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return f"hydra.searchpath=[file://{folder}]"


def finished(result, run_dir: Path) -> tuple[dict, dict]:
    """The run's resolved config and last checkpoint, once it is known to have ended well: its result is recorded (a
    DDP run's ranks, which this process starts, print the result line where a test does not read it)."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test/acc=" in json.loads((run_dir / "result.json").read_text())["line"]
    return OmegaConf.load(run_dir / "config.yaml"), torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)


def test_the_doc_gives_a_file_for_every_kind_of_piece():
    assert set(doc_config_files()) == {"model/mlp.yaml", "optim/rmsprop.yaml", "strategy/ddp_fp16_example.yaml",
                                       "strategy/ddp_fp16_warmup_example.yaml",
                                       "strategy/announced.yaml", "data/random_images.yaml"}


def test_searchpath_options_are_known_to_the_checks(searchpath):
    config.check(composed(searchpath, "model=mlp", "model.net.hidden=32", "data=random_images", "data.image_size=28"))
    assert hydra_refusal(searchpath, "model=vgg") == "model=vgg is not an option; choose one of: lenet, mlp, resnet18"
    assert hydra_refusal(searchpath, "model=mlp", "model.net.hiden=32").startswith(
        "model.net.hiden is not a known key of model=mlp; did you mean model.net.hidden")
    assert hydra_refusal("model=mlp").startswith("model=mlp is not an option")


def test_a_new_model_trains_and_its_checkpoint_is_scored_by_eval(tmp_path, data_root, searchpath):
    run_dir = tmp_path / "run"
    config, checkpoint = finished(train_here(*QUICK, searchpath, "model=mlp", "model.net.hidden=32", f"hydra.run.dir={run_dir}"),
                                  run_dir)
    assert config.model.net._target_ == "tests.examples.mlp.MLP" and config.model_name == "mlp"
    assert checkpoint["state_dict"]["net.1.weight"].shape == (32, 28 * 28)
    assert hparams(run_dir)["model"] == "mlp"
    # src.eval rebuilds the model as the run built it (hidden=32 without repeating it), through the same search path.
    eval_dir = tmp_path / "eval"
    result = command_here("src.eval", "debug=quick", f"data.root={DATA_ROOT}", searchpath, f"ckpt_path={run_dir}",
                          f"hydra.run.dir={eval_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert scalars(eval_dir)["test/acc"] == scalars(run_dir)["test/acc"], "the same weights on the same test batches"


def test_a_new_optimizer_is_a_config_file(tmp_path, data_root, searchpath):
    run_dir = tmp_path / "run"
    config, checkpoint = finished(train_here(*QUICK, searchpath, "optim=rmsprop", "optim.lr=0.002", f"hydra.run.dir={run_dir}"), run_dir)
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert (group["alpha"], group["lr"]) == (0.9, 0.002), "RMSprop's own argument, from the file"
    assert config.optim._target_ == "torch.optim.RMSprop"
    assert hparams(run_dir)["optimizer"] == "RMSprop" and hparams(run_dir)["alpha"] == 0.9


@pytest.mark.slow
def test_a_new_comm_hook_with_or_without_state_is_a_function_and_a_strategy_file(tmp_path, data_root, searchpath):
    """Both of the doc's hooks, each a run of two processes, on one start of the ranks."""
    runs = {"plain": ["strategy=ddp_fp16_example"], "stateful": ["strategy=ddp_fp16_warmup_example", "trainer.log_every_n_steps=1"]}
    results = train_as_torchrun([[*QUICK, searchpath, *args, "devices=2", f"hydra.run.dir={tmp_path / name}"]
                                 for name, args in runs.items()], tmp_path)
    (plain, _), (stateful, _) = (finished(result, tmp_path / name) for result, name in zip(results, runs))
    assert plain.strategy.hook == "tests.examples.hooks.fp16_allreduce_hook"
    # Only a hook that sends float16 halves the bytes: plain DDP's ratio is 1.
    assert scalars(tmp_path / "plain")["xfer/compression_ratio_epoch"] == [pytest.approx(2.0)]
    assert hparams(tmp_path / "plain")["world_size"] == 2
    assert stateful.strategy.hook_state.warmup_steps == 2
    # The state lives across calls: fp32 for the first two of the four steps, then float16.
    assert scalars(tmp_path / "stateful")["xfer/compression_ratio"] == [pytest.approx(r) for r in (1.0, 1.0, 2.0, 2.0)]


def assert_one_line(result, message: str, run_dir: Path) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in result.stderr and not run_dir.exists()


@pytest.mark.parametrize("args, message", [
    (["strategy.hook=fp16", "strategy.hook_state={_target_:tests.examples.hooks.WarmupState,_partial_:true}"],
     "error: strategy.hook_state is not allowed with strategy.hook=fp16"),
    (["strategy.hook=tests.examples.hooks.fp16_after_warmup_hook", "strategy.hook_state=3"],
     "error: strategy.hook_state=3 is not allowed; it must be null or a config with _target_ and _partial_: true"),
    (["strategy.hook=tests.examples.hooks.fp16_after_warmup_hook", "strategy.hook_state={_target_:tests.examples.hooks.WarmupState}"],
     "error: strategy.hook_state={'_target_': 'tests.examples.hooks.WarmupState'} is not allowed; it must be null or a config"),
    (["strategy.hook=tests.examples.hooks.fp16_after_warmup_hook", "strategy.hook_state={_target_:tests.examples.hooks.Nothing,_partial_:true}"],
     "error: strategy: Error locating target 'tests.examples.hooks.Nothing'"),
    (["strategy.hook=tests.examples.hooks.nothing_here"],
     "error: strategy.hook=tests.examples.hooks.nothing_here: no function of that name can be imported"),
])
def test_a_bad_hook_or_hook_state_is_one_line(tmp_path, args, message):
    """Refused before any rank starts, by the config rules or as the launcher builds the strategy (a hook, or its
    state, that does not import): the command in this process, which starts no rank. A rank that torchrun or SLURM
    started refuses the hook itself: test_comm_hooks' `test_a_hook_of_your_own_is_named_by_its_import_path`."""
    assert_one_line(train_here(*QUICK, "strategy=ddp", "devices=2", *args, f"hydra.run.dir={tmp_path / 'run'}"), message,
                    tmp_path / "run")


def test_a_new_strategy_is_a_lightning_strategy_class_and_a_file(tmp_path, data_root, searchpath):
    run_dir = tmp_path / "run"
    config, _ = finished(train_here(*QUICK, searchpath, "strategy=announced", "accelerator=cpu", f"hydra.run.dir={run_dir}"), run_dir)
    assert config.strategy._target_ == "tests.examples.strategies.AnnouncedSingleDevice"
    assert "AnnouncedSingleDevice: training on cpu" in (run_dir / "train.log").read_text()
    assert hparams(run_dir)["strategy"] == "announced"


def test_a_new_data_set_is_a_data_module_and_a_file(tmp_path, searchpath):
    """No Fashion-MNIST here: data.root is a key of fashion_mnist only."""
    run_dir = tmp_path / "run"
    config, checkpoint = finished(train_here("debug=quick", searchpath, "data=random_images", "model=lenet", f"hydra.run.dir={run_dir}"), run_dir)
    assert config.data._target_ == "tests.examples.random_images.RandomImagesDataModule"
    weights = checkpoint["state_dict"]
    assert weights["net.0.weight"].shape[1] == 3 and weights["net.9.weight"].shape[0] == 3, "3 channels in, 3 classes out"
    assert 0 <= scalars(run_dir)["test/acc"][-1] <= 1
