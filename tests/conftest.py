"""Session fixtures: the data copy, runs trained once for the tests that read them, and checks every test passes."""

import warnings

# The warning filters that the imports below install, pytest drops once it has loaded this file; a command run in the
# test process has them, as a new process of it has them from its own imports (tests.helpers.note_import_filters).
_filters_before_imports = warnings.filters[:]

import multiprocessing.process
import os
import subprocess

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hypothesis import settings as hypothesis_settings

# The launchers' configs, registered in Hydra's ConfigStore as Hydra scans its plugins; imported here, before any test
# saves Hydra's singletons to put them back after it (`hydra_restore_singletons`, the launcher kit's fixture).
import hydra_plugins.project_launchers.parallel  # noqa: F401
import hydra_plugins.project_launchers.sequential  # noqa: F401
from src.fast_path import float32_math
from src.launch import progress
from src.launch.ranks import usable_cores
import src.tasks  # noqa: F401  the run's own modules, torch's and Lightning's, with the filters they install
from tests.helpers import DATA_ROOT, LINEAR_LR, QUICK, REPO, Run, note_import_filters, trained_once

note_import_filters(_filters_before_imports)

# The property tests draw the same examples at every run, so that a run of the suite fails only where the code
# changed; `HYPOTHESIS_PROFILE=search` draws new ones each run, to look further.
hypothesis_settings.register_profile("suite", derandomize=True)
hypothesis_settings.register_profile("search", derandomize=False)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

OUTPUTS = REPO / "outputs"


@pytest.fixture(scope="session")
def data_root():
    """The real Fashion-MNIST copy; its absence is an error, not a skip."""
    if not (DATA_ROOT / "FashionMNIST" / "raw").is_dir():
        pytest.fail(f"Fashion-MNIST not found in {DATA_ROOT}; set FASHION_MNIST_ROOT to a folder holding FashionMNIST/raw")
    return DATA_ROOT


def pytest_configure(config):
    """Test processes side by side (`-n`) share the cores: each computes with its share, one thread each on 2 cores,
    as the project's side-by-side jobs do; with every core each, their threads would wait on one another (a quick run
    beside another busy process on a 2-core EPYC: 2.9 s of CPU on 2 threads, 2.0 s on 1). OMP_NUM_THREADS, where set,
    rules. A test that compares this process's arithmetic with another's to the bit gives that one the same count."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(usable_cores()) // workers))


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The warning filters that the test modules' imports install, which pytest drops once it has collected them."""
    before = warnings.filters[:]
    try:
        return (yield)
    finally:
        note_import_filters(before)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def _checkout_runs() -> set[str]:
    return {p.relative_to(OUTPUTS).as_posix() for p in OUTPUTS.glob("*/*")}


@pytest.fixture(autouse=True)
def checkout_outputs_untouched():
    """Every test runs in folders of its own: a folder it leaves in the checkout's outputs/ (a run's, a sweep's, an
    eval's) is an error of that test, and would mix with a user's runs."""
    before = _checkout_runs()
    yield
    added = _checkout_runs() - before
    assert not added, f"the test left folders in {OUTPUTS}: {sorted(added)}"


@pytest.fixture(autouse=True)
def no_hydra_config_left_behind():
    """The config a test set as Hydra's current one (`tests.helpers.composed`, as a job has it) is cleared after it:
    Hydra's next composition in this process would resolve that config's folders, and claim them. So is the sweep a
    launcher tallied (Hydra's launcher kit runs our launchers without a command around them)."""
    yield
    HydraConfig.instance().cfg = None
    progress.tally = None


@pytest.fixture(autouse=True)
def environment_and_threads_put_back():
    """What a test changed of this process's environment and torch's thread count ends with it: a run started later
    takes its threads from them (Lightning's DDP set-up, run in this process, writes OMP_NUM_THREADS), and another
    thread count sums in another order, so a later run's weights would differ from its reference in the last bits."""
    environment, threads = dict(os.environ), torch.get_num_threads()
    yield
    if dict(os.environ) != environment:
        os.environ.clear()
        os.environ.update(environment)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def exact_cuda_math():
    """TF32 rounds convolutions and matmuls to 10 mantissa bits; compare in full float32."""
    saved = torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    float32_math("32-true", "gpu")
    yield
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory, data_root) -> Run:
    """`python -m src.train debug=quick` (LeNet, one process), trained once for every test that reads such a run; a
    test that changes the folder works in a `Run.copy` of it."""
    return trained_once(tmp_path_factory, "quick_run", *QUICK, here=True)


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory, data_root) -> Run:
    """The same on 2 DDP processes, with a global batch of 128 and linear learning-rate scaling (`LINEAR_LR`), trained
    once for every test that reads such a run."""
    return trained_once(tmp_path_factory, "ddp_run", *QUICK, "strategy=ddp", "devices=2", *LINEAR_LR)


@pytest.fixture(scope="session")
def ddp_sweep(tmp_path_factory, data_root) -> Run:
    """A sweep of LeNet under DDP on 2 processes and on 1, 2 epochs of 4 steps each, in this process (each job's ranks
    are processes): the report's and TensorBoard's tests read it. Without the disturbance marks: the suite's other
    test process competes with these runs, and their speed-ups would be left out of the report."""
    return trained_once(tmp_path_factory, "ddp_sweep", "-m", "model=lenet", "strategy=ddp", "devices=2,1", *QUICK,
                        "max_epochs=2", "data.batch_size=64", "trainer.limit_train_batches=4",
                        "trainer.log_every_n_steps=1", "~callbacks.disturbance", here=True)


# Interpreters a test starts (`python -m ...`, a DDP worker, a sweep job), each of which imports torch and Lightning
# (5-10 s of a core on 2 cores, by the CPU): only a test marked `slow` may, so that `-m "not slow"` starts none. The
# fixtures seen to start one make every test that uses them slow as well.
_started: list[str] = []
_process_fixtures: set[tuple[str, str]] = set()  # (where defined, name): modules reuse names such as `runs`
_popen_init, _process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
_refusing = [False]  # in a test not marked slow: the interpreter is refused as it starts, so the test ends at once


def _started_here(what: str) -> None:
    _started.append(what[:120])
    if _refusing[0]:
        raise RuntimeError(f"an interpreter started outside a slow test: {what[:120]}")


def _watched_popen(self, args, *rest, **kwargs):
    command = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
    if "python" in command:
        _started_here(command)
    _popen_init(self, args, *rest, **kwargs)


def _watched_start(self):
    _started_here(f"multiprocessing: {self.name}")
    _process_start(self)


subprocess.Popen.__init__ = _watched_popen
multiprocessing.process.BaseProcess.start = _watched_start


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = len(_started)
    result = yield
    if len(_started) > before:
        _process_fixtures.add((fixturedef.baseid, fixturedef.argname))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _started.clear()  # a fixture that starts one is only noted: a session fixture that failed would fail slow tests too
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _refusing[0] = "slow" not in item.keywords
    try:
        result = yield
    finally:
        _refusing[0] = False
    fixtures = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                      if any((d.baseid, d.argname) in _process_fixtures for d in defs[-1:]))
    if "slow" not in item.keywords and (_started or fixtures):
        what = _started[0] if _started else f"the fixture {fixtures[0]}"
        pytest.fail(f"starts an interpreter ({what}) but is not marked slow: test the logic in this process, or "
                    "mark it @pytest.mark.slow where the process is the point")
    return result
