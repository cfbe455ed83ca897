"""Two nodes on one machine: two torchrun launchers meeting at a c10d rendezvous on 127.0.0.1."""

import pytest

from tests.helpers import QUICK, TorchrunNodes, cpu_precision, hparams, scalars


@pytest.mark.slow
def test_two_torchrun_nodes_train_one_run_with_world_size_nodes_times_devices(tmp_path, data_root):
    outputs = tmp_path / "outputs"
    with TorchrunNodes(2, "strategy=ddp", "devices=2", "num_nodes=2", *QUICK,
                       f"hydra.run.dir={outputs}/runs/${{run_stamp:}}_${{run_name}}", nproc_per_node=2) as nodes:
        assert nodes.wait() == [0, 0], "\n".join(log[-3000:] for log in nodes.logs)
    logs = nodes.logs

    runs = list((outputs / "runs").iterdir())
    precision = cpu_precision()  # what precision=auto uses here
    assert [run.name for run in runs] == [f"torchrun-twonodes_lenet_ddp_2dev_2nodes_{precision}"]
    run = runs[0]
    assert hparams(run)["world_size"] == 4 and hparams(run)["num_nodes"] == 2
    assert {"train/loss", "val/acc", "test/acc", "time/epoch_s"} <= set(scalars(run))
    # Rank 0 alone writes the config and train.log; the other three ranks log under their own names, from their first
    # line on (a rank that says nothing leaves no empty file).
    assert (run / ".hydra" / "config.yaml").is_file()
    logs_written = sorted(p.name for p in run.glob("*.log"))
    assert logs_written[0] == "train.log" and set(logs_written[1:]) <= {f"train_rank_{rank}.log" for rank in (1, 2, 3)}
    assert all(p.stat().st_size > 0 for p in run.glob("*.log"))
    assert sum("test/acc=" in log for log in logs) == 1
