"""docs/cluster.md against a real SLURM scheduler: the launcher sweep and the sbatch/srun DDP script,
as written there, then a job stopped with `scancel --signal=TERM` and requeued.

`.ci/test-slurm` starts a one-node CPU-only cluster on this machine and runs this file. Skipped where
no slurmctld runs on this machine or no cluster answers `sinfo`. Every job runs from a folder of its own that
links this checkout's `src/` and `conf/`, so its runs land there and `src` is this checkout's.
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.helpers import DATA_ROOT, REPO, cpu_precision, epoch_lines, scalar_steps, steps_going_back, user_env
from tests.test_sandbox import NASTY, rewrite_record

# A job's folder: what it runs (the one-node cluster is this machine, so precision=auto uses what it does here).
LABEL = f"lenet_auto_1dev_{cpu_precision()}"

CLUSTER_DOC = REPO / "docs" / "cluster.md"
WAIT_S = 600  # generous: the machine may be busy; every wait ends as soon as its event happens
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")
# A long run of tiny epochs, so that it is still running when signalled, whatever the machine's speed.
ENDLESS = ["max_epochs=1000", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
           "trainer.limit_test_batches=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
STEPS_PER_EPOCH = 2


def controller_runs() -> bool:
    """A slurmctld process on this machine: without one, `sinfo` keeps trying for about 9 s, at every
    collection of the suite on a machine where `.ci/test-slurm` installed SLURM and stopped it again."""
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError):
            if comm.read_text().strip() == "slurmctld":
                return True
    return False


def cluster_answers() -> bool:
    if shutil.which("sinfo") is None or not controller_runs():
        return False
    result = subprocess.run(["sinfo", "--noheader", "--responding"], capture_output=True, text=True)
    return result.returncode == 0 and bool(result.stdout.strip())


ANSWERS = cluster_answers()
if not ANSWERS and os.environ.get("SLURM_CLUSTER") == "required":  # set by .ci/test-slurm, where a skip would hide a failure
    raise RuntimeError("SLURM_CLUSTER=required, but no slurmctld on this machine answers sinfo")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ANSWERS, reason="no SLURM cluster answers sinfo (.ci/test-slurm starts one)"),
]


def doc_block(heading: str) -> str:
    """The first ```bash block under `heading` in docs/cluster.md, with the data root made this machine's."""
    text = CLUSTER_DOC.read_text()
    start = text.index(f"\n{heading}\n")
    block = re.search(r"```bash\n(.*?)```", text[start:], flags=re.S).group(1)
    return block.replace("/shared/data", str(DATA_ROOT))


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A folder where a user would submit from: this checkout's code and configs, outputs of its own."""
    for part in ("src", "conf", "hydra_plugins", "pyproject.toml", "tests"):  # tests: the faults a job may be given
        (tmp_path / part).symlink_to(REPO / part)
    return tmp_path


def job_env() -> dict[str, str]:
    """A user's shell with the project's environment active: `python` is this interpreter."""
    env = {k: v for k, v in user_env().items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def wait_for(condition, what: str, timeout: float = WAIT_S):
    """Poll until `condition()` is truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...); finished jobs stay listed for MinJobAge."""
    out = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                         check=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_until_ended(job_id: str) -> dict[str, str]:
    return wait_for(lambda: (f := job_fields(job_id))["JobState"] in ENDED and f, f"job {job_id} to end")


def sbatch(checkout: Path, *overrides: str) -> str:
    script = checkout / "ddp.sbatch"
    script.write_text(doc_block("## SLURM with sbatch and srun"))
    result = subprocess.run(["sbatch", "--parsable", script.name, *overrides], cwd=checkout, env=job_env(),
                            capture_output=True, text=True, check=True)
    return result.stdout.strip().split(";")[0]


def run_dir(checkout: Path, job_id: str) -> Path:
    folders = list((checkout / "outputs" / "runs").glob(f"slurm-{job_id}_*"))
    assert len(folders) == 1, folders  # one folder per job, requeued or not
    return folders[0]


def read_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)  # a checkpoint this test's own job wrote


def logged_epochs(job: Path) -> list[int]:
    """The epochs (1-based) of a job's epoch lines, in the order its train.log names them."""
    return [epoch for epoch, _ in epoch_lines((job / "train.log").read_text())]


def test_launcher_sweep_on_a_cpu_cluster(checkout):
    """docs/cluster.md's CPU-cluster sweep: two jobs of a SLURM array, one task each, no GPU request."""
    command = doc_block("### On a CPU-only cluster").strip() + " debug=quick hydra.sweep.dir=sweep"
    result = subprocess.run(["bash", "-c", command], cwd=checkout, env=job_env(), capture_output=True, text=True,
                            timeout=WAIT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    sweep = checkout / "sweep"
    scripts = list((sweep / ".submitit").glob("*/*_submission.sh"))
    assert len(scripts) == 1, scripts  # one sbatch: the sweep is one job array
    sbatch_lines = scripts[0].read_text().splitlines()
    assert "#SBATCH --array=0-1%2" in sbatch_lines and "#SBATCH --ntasks-per-node=1" in sbatch_lines
    assert not any("gpus" in line or "gres" in line for line in sbatch_lines)
    array_id = scripts[0].parent.name
    for task, seed in ((0, 1), (1, 2)):
        assert (sweep / ".submitit" / f"{array_id}_{task}" / f"{array_id}_{task}_0_result.pkl").is_file()
        assert "test/acc=" in (sweep / f"{LABEL}_seed={seed}" / "train.log").read_text()
        assert (sweep / f"{LABEL}_seed={seed}" / "checkpoints" / "last.ckpt").is_file()
    assert "2 runs" in (sweep / "report.md").read_text()  # the end-of-sweep callback ran on the submitter


def sweep_command(*overrides: str) -> list[str]:
    """docs/cluster.md's CPU-cluster sweep command with these overrides instead of its seeds, into `sweep/`."""
    command = doc_block("### On a CPU-only cluster").strip().replace("seed=1,2 ", "")
    return ["bash", "-c", f"exec {command} hydra.sweep.dir=sweep {' '.join(overrides)}"]


def launcher_sweep(checkout: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(sweep_command(*overrides), cwd=checkout, env=job_env(), capture_output=True, text=True,
                          timeout=WAIT_S)


def test_a_failed_launcher_job_fails_in_slurm_and_the_sweep_exits_2(checkout):
    """A job that stops with an `error:` line exits 2 (FAILED in SLURM), the sweep names it with its line and
    exits 2, the report lists it, and no folder of it is left; the other job, 2 DDP ranks, logs one file per rank."""
    result = launcher_sweep(checkout, "strategy=auto,ddp", "devices=2", "debug=quick")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    line = "strategy=auto runs on one device, not devices=2"
    assert last.startswith("error: 1 sweep job failed: strategy=auto: ") and line in last, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    job_id = re.search(r"\(SLURM job (\d+_\d+)\)", last).group(1)
    fields = job_fields(job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), fields

    sweep = checkout / "sweep"
    ddp_name = LABEL.replace("_auto_1dev_", "_ddp_2dev_")
    assert {p.name for p in sweep.iterdir() if p.name.startswith("lenet_")} == {ddp_name}
    report = (sweep / "report.md").read_text()
    assert "1 job failed:" in report and line in report
    ddp = sweep / ddp_name
    assert "test/acc=" in (ddp / "train.log").read_text()
    done = "Job completed successfully"  # submitit's line, one per rank
    assert (ddp / "train.log").read_text().count(done) == 1 and done in (ddp / "train_rank_1.log").read_text()


def test_sbatch_srun_ddp_over_two_tasks(checkout):
    """docs/cluster.md's batch script: srun starts 2 tasks that train as 2 DDP ranks of one run."""
    job_id = sbatch(checkout, "debug=quick")
    fields = wait_until_ended(job_id)
    output = (checkout / f"slurm-{job_id}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-3000:]
    run = run_dir(checkout, job_id)
    log = (run / "train.log").read_text()
    assert "Starting with 2 processes" in output
    assert re.search(r"test/acc=\d\.\d{4} .*2 processes", log), log[-2000:]
    assert "GLOBAL_RANK: 1" in (run / "train_rank_1.log").read_text()
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_scancel_term_keeps_last_ckpt_and_a_requeued_job_resumes(checkout):
    job_id = sbatch(checkout, *ENDLESS)
    out = checkout / f"slurm-{job_id}.out"
    wait_for(lambda: list((checkout / "outputs" / "runs").glob(f"slurm-{job_id}_*/checkpoints/last.ckpt")),
             "the first last.ckpt")
    subprocess.run(["scancel", "--signal=TERM", job_id], check=True)
    fields = wait_until_ended(job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "143:0"), out.read_text()[-3000:]  # 128 + SIGTERM

    # One line says where the run stopped; last.ckpt is whole and at most one epoch behind that step.
    stop = re.search(r"error: run stopped by SIGTERM during epoch (\d+) \(step (\d+)\)", out.read_text())
    assert stop, out.read_text()[-3000:]
    stopped_in, stopped_at = int(stop.group(1)), int(stop.group(2))
    run = run_dir(checkout, job_id)
    first = read_ckpt(run / "checkpoints" / "last.ckpt")
    assert first["global_step"] % STEPS_PER_EPOCH == 0  # an epoch's end
    assert stopped_at - STEPS_PER_EPOCH <= first["global_step"] <= stopped_at
    assert (first["epoch"] + 1) * STEPS_PER_EPOCH == first["global_step"]
    logged = epoch_lines((run / "train.log").read_text())
    # Epochs counted from 1 in both: the stop came in the epoch after the last one logged (or at its very end).
    assert logged[-1][0] in (stopped_in - 1, stopped_in), (logged[-1], stopped_in)

    # Requeued: the same job id, so the same folder, where ckpt_path=auto resumes from last.ckpt.
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    resumed_step = first["global_step"] + STEPS_PER_EPOCH

    def resumed_an_epoch() -> bool:  # a line of its own: the stop may have come after an epoch's line, before its last.ckpt
        if epoch_lines((run / "train.log").read_text())[len(logged):]:
            return True
        if (state := job_fields(job_id)["JobState"]) in ENDED:
            pytest.fail(f"the requeued job ended ({state}) before an epoch: {out.read_text()[-3000:]}")
        return False

    wait_for(resumed_an_epoch, "the requeued job to finish an epoch")  # after SLURM's hold on requeued jobs
    subprocess.run(["scancel", job_id], check=True)
    fields = wait_until_ended(job_id)
    assert fields["Restarts"] == "1"
    run_dir(checkout, job_id)  # still one folder
    after = epoch_lines((run / "train.log").read_text())[len(logged):]
    # The second attempt's first epoch is the one after the checkpoint, not epoch 1 again.
    assert after and after[0] == (first["epoch"] + 2, resumed_step), after


def test_a_launcher_job_requeued_by_usr2_resumes_and_a_stopped_submitter_cancels_it(checkout):
    """submitit's timeout signal (USR2) requeues the job without a traceback; the requeued job resumes from
    last.ckpt without `ckpt_path` given (auto under the launcher); SIGTERM to the submitter cancels the job."""
    submitter = subprocess.Popen(sweep_command(*ENDLESS), cwd=checkout, env=job_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    array_id = None
    try:
        sweep = checkout / "sweep"
        last = wait_for(lambda: next(iter(sweep.glob("*/checkpoints/last.ckpt")), None), "the first last.ckpt")
        run = last.parent.parent
        array_id = next(p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit())
        job_id = array_id  # the array's one job
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)

        wait_for(lambda: job_fields(job_id)["Restarts"] == "1" and job_fields(job_id)["JobState"] == "PENDING",
                 "the job to be requeued")
        first_attempt = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
        assert "Traceback" not in first_attempt, first_attempt[-3000:]
        checkpoint = read_ckpt(last)
        logged = epoch_lines((run / "train.log").read_text())
        resumed_step = checkpoint["global_step"] + STEPS_PER_EPOCH

        def resumed_an_epoch() -> bool:  # a line of its own: USR2 may have come after an epoch's line, before its last.ckpt
            if epoch_lines((run / "train.log").read_text())[len(logged):]:
                return True
            assert job_fields(job_id)["JobState"] not in ENDED, submitter.stderr
            return False

        wait_for(resumed_an_epoch, "the requeued job to finish an epoch")
        after = epoch_lines((run / "train.log").read_text())[len(logged):]
        assert after and after[0] == (checkpoint["epoch"] + 2, resumed_step), after
        assert "ckpt_path: auto" in (run / "config.yaml").read_text()

        submitter.send_signal(signal.SIGTERM)
        out, err = submitter.communicate(timeout=WAIT_S)
    finally:
        if submitter.poll() is None:
            submitter.kill()
            submitter.communicate()
        if array_id:  # whatever happened above, no job of this test keeps the cluster busy
            subprocess.run(["scancel", array_id])
    assert submitter.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == f"error: run stopped by SIGTERM; cancelled SLURM job {array_id}"
    assert "Traceback" not in err
    assert wait_until_ended(job_id)["JobState"] == "CANCELLED"
    # The resumed attempt continued the TensorBoard series: no point going back, no step twice.
    assert not steps_going_back(run)
    for tag, series in scalar_steps(run).items():
        assert tag == "trainer/epoch" or len(series) == len(set(series)), (tag, series)


@pytest.mark.parametrize(("request_", "asked"), [("num_nodes=2", "NumNodes=2"), ("devices=4", "NumTasks=4")],
                         ids=["2 nodes", "4 tasks on 2 CPUs"])
def test_a_launcher_job_that_can_never_start_ends_the_sweep(checkout, request_, asked):
    """More than the one-node partition has: pending for ever (PartitionConfig) unless the sweep ends it."""
    result = launcher_sweep(checkout, request_, "strategy=ddp", "debug=quick")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: SLURM job \d+(_0)? can never start \(\w+\): it asks for .*\b{asked}\b.*; "
                        r"partition debug has TotalNodes=1 .*; the sweep's jobs are cancelled", last), last
    assert "Traceback" not in result.stderr
    job_id = re.search(r"SLURM job (\S+)", last).group(1)
    assert wait_until_ended(job_id)["JobState"] == "CANCELLED"


def test_a_sweep_that_sbatch_refuses_ends_in_one_line(checkout):
    result = launcher_sweep(checkout, "debug=quick", "accelerator=gpu")  # a GPU request, on a cluster without GPUs
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == \
        "error: sbatch refused the sweep: Invalid generic resource (gres) specification"
    assert "Traceback" not in result.stderr


def cancelled_sweep(checkout: Path, *overrides: str) -> tuple[int, str, str]:
    """A launcher sweep whose array `scancel` cancels once a job has checkpointed an epoch: the submitter's exit
    status, its stderr, and the array's id."""
    submitter = subprocess.Popen(sweep_command(*overrides), cwd=checkout, env=job_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    try:
        sweep = checkout / "sweep"
        wait_for(lambda: next(iter(sweep.glob("*/checkpoints/last.ckpt")), None), "the first last.ckpt")
        array_id = next(p.name for p in (sweep / ".submitit").iterdir() if p.name.isdigit())
        subprocess.run(["scancel", array_id], check=True)
        _, err = submitter.communicate(timeout=WAIT_S)
    finally:
        if submitter.poll() is None:
            submitter.kill()
            submitter.communicate()
    return submitter.returncode, err, array_id


def test_a_launcher_job_cancelled_by_hand_fails_the_sweep(checkout):
    """A job that leaves no result (here `scancel` while it trains) is a failed job, with or without sacct."""
    status, err, array_id = cancelled_sweep(checkout, *ENDLESS)
    assert status == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: 1 sweep job failed: {LABEL}: run stopped by SIGTERM during epoch \d+ \(step \d+\); "
                        rf".*last\.ckpt holds the last finished epoch; resume with: {re.escape(sys.executable)} -m src\.train -m "
                        rf"hydra\.sweep\.dir=sweep ckpt_path=auto {re.escape(f'data.root={DATA_ROOT}')} "
                        rf"\(SLURM job {array_id}(_0)?\)", last), last
    assert "Traceback" not in err


def test_a_cancelled_launcher_sweep_resumes_with_the_command_its_line_names(checkout):
    """`scancel` of the whole array while its jobs train; the command the sweep's line names runs the same sweep
    under the launcher again (its `hydra/launcher=slurm` kept): each job resumes from its checkpoint and finishes.
    A job holds after its first epoch until `scancel`, so that it is still training then, however fast the machine."""
    epochs = 4
    released = checkout / "released"  # made once the array is cancelled: no run holds after that
    hold = ["+callbacks.hold._target_=tests.faults.HoldAfterEpoch", f"+callbacks.hold.until={released}"]
    status, err, array_id = cancelled_sweep(checkout, f"max_epochs={epochs}", *ENDLESS[1:], "seed=1,2", *hold)
    released.touch()
    assert status == 1, err[-3000:]
    sweep = checkout / "sweep"
    # the interpreter that ran, and where the data is, which a resume types again (a record never carries it)
    command = f"{sys.executable} -m src.train -m hydra.sweep.dir=sweep ckpt_path=auto data.root={DATA_ROOT}"
    assert f"; resume with: {command} (SLURM job {array_id}" in err, err[-3000:]
    # A job that had checkpointed was held there: its first epoch logged and checkpointed, nothing after it.
    interrupted = [p.parent.parent for p in sweep.glob("*/checkpoints/last.ckpt")]
    assert interrupted
    for job in interrupted:
        assert (read_ckpt(job / "checkpoints" / "last.ckpt")["epoch"], logged_epochs(job)) == (0, [1]), job

    # The hold callback names code to run: a record may not, so the resume types it again, as the refusal would ask.
    resumed = subprocess.run(["bash", "-c", f"exec {command} {' '.join(hold)}"], cwd=checkout, env=job_env(), capture_output=True,
                             text=True, timeout=WAIT_S)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Submitit 'slurm' sweep output dir" in resumed.stdout
    jobs = sorted(p for p in sweep.iterdir() if p.name.startswith(f"{LABEL}_seed="))
    assert [p.name for p in jobs] == [f"{LABEL}_seed=1", f"{LABEL}_seed=2"]
    for job in jobs:
        assert read_ckpt(job / "checkpoints" / "last.ckpt")["epoch"] == epochs - 1
        assert not steps_going_back(job)
    for job in interrupted:  # went on from its checkpoint: each epoch trained once, and its lines say so
        assert logged_epochs(job) == list(range(1, epochs + 1)), job
        assert re.search(rf"^job [12]/2 resumed: {re.escape(job.name)} \(", resumed.stdout, re.M), resumed.stdout[-3000:]
        assert re.search(rf"^job [12]/2 done after resuming: {re.escape(job.name)}: ", resumed.stdout, re.M)



CANARY = "SLURM_CANARY_VALUE"


def untouched(checkout: Path, sweep: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder the checkout holds outside the sweep's folder (not through its links to the code)."""
    found = {}
    for top in checkout.iterdir():
        if top.is_symlink() or top == sweep:
            continue
        for path in [top, *(top.rglob("*") if top.is_dir() else [])]:
            found[str(path)] = (path.lstat().st_size, path.lstat().st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def launcher_sweep_done(tmp_path_factory) -> tuple[Path, str]:
    """A finished SLURM launcher sweep of one job in a checkout of its own, and its record as written."""
    checkout = tmp_path_factory.mktemp("checkout")
    for part in ("src", "conf", "hydra_plugins", "pyproject.toml", "tests"):
        (checkout / part).symlink_to(REPO / part)
    result = launcher_sweep(checkout, "debug=quick", "seed=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return checkout, (checkout / "sweep" / "multirun.yaml").read_text()


@seed(78)
@settings(max_examples=int(os.environ.get("SANDBOX_EXAMPLES", "4")), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(added=st.booleans(), index=st.integers(0, 400), value=NASTY)
def test_a_launcher_sweep_whose_record_was_rewritten_resumes_inside_it(launcher_sweep_done, added, index, value):
    """tests/test_sandbox.py's corpus on a SLURM sweep: a line of its record rewritten, or a swept value added, and the
    resume under the launcher finishes or is refused in one line, writes nothing outside the sweep's folder and prints
    no variable's value (a record is read by src.resume before the launcher submits anything: it gets typed values)."""
    checkout, record = launcher_sweep_done
    sweep = checkout / "sweep"
    (sweep / "multirun.yaml").write_text(record)
    rewrite_record(sweep / "multirun.yaml", added, index, value)
    before = untouched(checkout, sweep)
    command = f"exec {sys.executable} -m src.train -m hydra.sweep.dir=sweep ckpt_path=auto data.root={DATA_ROOT}"
    resumed = subprocess.run(["bash", "-c", command], cwd=checkout, env={**job_env(), "SANDBOX_CANARY": CANARY},
                             capture_output=True, text=True, timeout=WAIT_S)
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode in (0, 1, 2), said[-3000:]
    errors = [text for text in resumed.stderr.strip().splitlines() if text.startswith("error: ")]
    assert resumed.returncode == 0 or errors and resumed.stderr.strip().endswith(errors[-1]), said[-3000:]
    assert untouched(checkout, sweep) == before and not (checkout.parent / "x").exists()
    assert CANARY not in said
