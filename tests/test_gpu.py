"""Runs that need a CUDA GPU: skipped where there is none (see tests/conftest.py)."""

import pytest

from tests.helpers import QUICK, hparams, scalars, train

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
@pytest.mark.parametrize("strategy", ["auto", "ddp"])
def test_16_mixed_on_one_gpu(tmp_path, data_root, model, strategy):
    run_dir = tmp_path / "run"
    result = train(*QUICK, f"model={model}", f"strategy={strategy}", "devices=1", "accelerator=gpu",
                   "precision=16-mixed", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    params = hparams(run_dir)
    assert params["precision_used"] == "16-mixed" and params["accelerator"] == "cuda"
    assert {"test/acc", "time/epoch_s"} <= set(scalars(run_dir))
