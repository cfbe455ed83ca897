"""Hydra multirun sweeps with DDP through the real command line.

A sweep over strategies and devices that runs each job in its own folder: tests/test_readme.py,
which runs the README's sweep (`-m strategy=ddp,ddp_fp16 devices=1,2,4`) and checks every job's folder.
"""

import re

import pytest


from tests.helpers import QUICK, cpu_precision, train

PRECISION = cpu_precision()  # what precision=auto uses here


@pytest.mark.slow
def test_a_bad_job_fails_alone_and_the_sweep_exits_non_zero(tmp_path, data_root):
    sweep = tmp_path / "sweep"
    result = train("-m", "strategy=auto,ddp", "devices=2", *QUICK, f"hydra.sweep.dir={sweep}", timeout=600)
    assert result.returncode == 2
    assert "error: strategy=auto runs on one device" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 sweep job failed")
    assert {p.name for p in sweep.iterdir() if p.is_dir() and p.name != "report"} == {f"lenet_ddp_2dev_{PRECISION}"}
    assert re.search(r"^job 1/2 failed: lenet_auto_2dev_\S+: strategy=auto runs on one device", result.stdout, flags=re.M)
    assert re.search(r"^job 2/2 done: lenet_ddp_2dev_\S+: test/acc=", result.stdout, flags=re.M)
    assert result.stdout.splitlines()[-1] == f"sweep of 2 jobs: 1 done, 0 resumed, 0 skipped, 1 failed; report: {sweep / 'report.md'}"
