"""`hydra.sweeper.storage=postgresql://...`: two searches, each its own command with its own sweep folder, add to one
study on a PostgreSQL server at the same time, as machines sharing a search do. The server is the one
`DPTRAIN_TEST_POSTGRES` names (`.ci/run` starts a throwaway one); without it the test is skipped."""

import os
import uuid

import optuna
import pytest
import yaml

from src.launch.optuna_sweeper import storage
from tests.helpers import QUICK, start_cli

SERVER = os.environ.get("DPTRAIN_TEST_POSTGRES")
N_TRIALS = 4


@pytest.mark.slow  # two searches at once, each a command of its own: the concurrency is the point
@pytest.mark.skipif(not SERVER, reason="no PostgreSQL server: set DPTRAIN_TEST_POSTGRES=postgresql://<user>@/<db>?host=<socket dir> "
                                       "(.ci/run starts one)")
def test_two_searches_at_once_share_one_postgresql_study_and_run_n_trials_in_all_each_once(tmp_path, data_root):
    name = f"shared-{uuid.uuid4().hex[:8]}"  # a study of its own on a server that may hold others
    searches = [start_cli("src.train", "-m", "hydra/sweeper=optuna", "optim.lr=tag(log, interval(0.001, 1))", *QUICK,
                          f"hydra.sweep.dir={tmp_path / folder}", f"hydra.sweeper.n_trials={N_TRIALS}",
                          f"hydra.sweeper.storage='{SERVER}'", f"hydra.sweeper.study_name={name}", f"hydra.sweeper.seed={seed}")
                for seed, folder in enumerate(("a", "b"))]  # a seed each, as docs/sweeps.md says
    ended = [search.communicate(timeout=900) for search in searches]
    assert [search.returncode for search in searches] == [0, 0], [err[-3000:] for _, err in ended]
    study = optuna.load_study(study_name=name, storage=storage(SERVER))
    run = [t for t in study.trials if "not run" not in t.user_attrs]  # a trial asked past n_trials is never launched
    assert len(run) == N_TRIALS and all(t.state == optuna.trial.TrialState.COMPLETE for t in run)
    assert len({t.params["optim.lr"] for t in run}) == N_TRIALS  # no point asked twice
    assert all(t.state == optuna.trial.TrialState.FAIL for t in study.trials if t not in run)
    # each trial ran once, in the folder of the search that asked for it, with the point it was asked for
    jobs = [yaml.safe_load(config.read_text()) for folder in ("a", "b") for config in (tmp_path / folder).glob("*/config.yaml")]
    assert sorted(job["callbacks"]["optuna_trial"]["trial"] for job in jobs) == [t.number for t in run]
    by_number = {t.number: t for t in run}
    assert all(job["optim"]["lr"] == by_number[job["callbacks"]["optuna_trial"]["trial"]].params["optim.lr"] for job in jobs)
    assert {t.user_attrs["sweep"].rsplit("/", 1)[1] for t in run} <= {"a", "b"}
    assert all((tmp_path / t.user_attrs["sweep"].rsplit("/", 1)[1] / t.user_attrs["folder"] / "result.json").is_file()
               for t in run)
