"""Evaluation counts every image once, on any number of processes (the commands run in this process, the ranks in
their own)."""

import pytest

from tests.helpers import DATA_ROOT, QUICK, command_here, scalars, train_here


@pytest.mark.slow
def test_test_accuracy_on_three_processes_equals_one_process(tmp_path, data_root, capfd):
    """Three processes split the 10,000 test images unevenly; each image counts once, so the score is one process's.
    The three score the run folder (its best checkpoint), which the launcher resolves before its ranks start."""
    trained = tmp_path / "trained"
    assert train_here(*QUICK, "trainer.limit_train_batches=20", f"hydra.run.dir={trained}").returncode == 0
    results = {}
    for devices, strategy in ((1, "auto"), (3, "ddp")):
        run_dir = tmp_path / f"devices{devices}"
        # src.eval scores its weights on all 10,000 test images (255 per batch: 85 per process on 3).
        # fp32: bf16 convolutions round differently at another batch size and may flip a borderline image.
        result = command_here("src.eval", f"data.root={DATA_ROOT}", f"ckpt_path={trained}", f"strategy={strategy}",
                              f"devices={devices}", "data.batch_size=255", "precision=32", "trainer.limit_test_batches=1.0",
                              "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        results[devices] = scalars(run_dir)["test/acc"][-1]
    assert results[3] == results[1]
    assert round(results[1] * 10_000) == pytest.approx(results[1] * 10_000, abs=1e-3), "a count out of 10,000 images"
    said = [line for line in capfd.readouterr().out.splitlines() if "test/acc=" in line]  # rank 0's, a process of its own
    assert len(said) == 1 and "3 processes" in said[0], said
