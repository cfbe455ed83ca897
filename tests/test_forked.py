"""A command forked from the test process's server (tests/forked.py) sees what it would see in a new interpreter.

Run as `python -m tests.test_forked <how to end>`, this module prints what a command can see of its start,
then ends as asked; the tests run it both ways and compare.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import forked
from tests.helpers import REPO, user_env


def facts() -> dict[str, object]:
    return {
        "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
        "spec": __spec__.name if __spec__ else None, "main": sys.modules["__main__"].__file__,
        "env": os.environ.get("FORKED_PROBE"), "stdin": sys.stdin.read(),
        "handlers": {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE", "SIGCHLD")},
        "session_leader": os.getsid(0) == os.getpid(), "random": random.random(),
    }


def probe(how: str) -> None:
    print(json.dumps(facts()), flush=True)
    if how == "raise":
        raise ValueError("uncaught")
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "thread":  # the interpreter waits for a thread that is not a daemon, then runs the atexit handlers
        import atexit

        atexit.register(lambda: print("atexit ran", flush=True))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread ended", flush=True))).start()
        return
    if how == "wait":
        time.sleep(600)
    if how in ("forkserver", "forkserver after a thread"):
        print(json.dumps(through_a_forkserver(threaded=how != "forkserver")), flush=True)
        return
    sys.exit(int(how) if how.isdigit() else how)


def through_a_forkserver(threaded: bool) -> dict[str, object]:
    """What a process of multiprocessing's forkserver sees of its server, as a local DDP run starts it (with the
    training code preloaded), after a variable is set that the project's import there records."""
    import multiprocessing

    from src.launch import forkserver

    if threaded:  # a process with another thread has its forkserver started as a new interpreter
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    os.environ["SET_BEFORE_THE_SERVER"] = "yes"
    forkserver.ensure_running(forkserver.PRELOAD)
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        return pool.apply(server_facts)


def server_facts() -> dict[str, object]:
    import gc

    from lightning import Trainer

    from src.launch import workers

    server = os.getppid()
    status = dict(line.split(":\t", 1) for line in open(f"/proc/{server}/status").read().splitlines() if ":\t" in line)
    fds = [os.readlink(f"/proc/{server}/fd/{fd}").split(":[")[0] for fd in os.listdir(f"/proc/{server}/fd")
           if int(fd) > 2]  # past the command's own streams, which `both` hands out in two ways
    return {"server_forked": forked.is_forked_forkserver(server),
            "ignored": status["SigIgn"].strip(), "caught": status["SigCgt"].strip(), "server_fds": sorted(fds),
            "recorded": workers._IMPORTED_WITH.get("SET_BEFORE_THE_SERVER"), "main": sys.modules["__main__"].__name__,
            "argv": sys.argv, "cwd": os.getcwd(), "trainer_walked": any(obj is Trainer for obj in gc.get_objects())}


def both(*args: str, new_session: bool = False) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """This module run as a command in a new interpreter and forked, from the checkout (where `tests` is found)."""
    env = {**user_env(), "FORKED_PROBE": "set"}
    interpreter = subprocess.run([sys.executable, "-m", "tests.test_forked", *args], cwd=REPO, env=env,
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                                 start_new_session=new_session)
    process = forked.Forked("tests.test_forked", *args, cwd=REPO, env=env, new_session=new_session)
    out, err = process.communicate(120)
    return interpreter, subprocess.CompletedProcess(process.args, process.returncode, out, err)


def seen(result: subprocess.CompletedProcess) -> dict[str, object]:
    return json.loads(result.stdout.splitlines()[0])


@pytest.mark.parametrize("how", ["0", "3", "a message"])
def test_a_forked_command_starts_and_exits_as_in_a_new_interpreter(how):
    interpreter, fork = both(how, new_session=True)
    assert (fork.returncode, fork.stderr) == (interpreter.returncode, interpreter.stderr)
    assert fork.returncode == {"0": 0, "3": 3, "a message": 1}[how]
    expected, got = seen(interpreter), seen(fork)
    assert got.pop("random") != expected.pop("random")
    assert got == expected
    assert got["name"] == "__main__" and got["path0"] == str(REPO) and got["env"] == "set" and got["session_leader"]


def test_signals_the_test_process_ignores_stay_ignored_as_in_a_new_interpreter(monkeypatch):
    """A suite started in the background of a script (`... &`) ignores SIGINT, and a new interpreter it starts
    inherits that; so must a forked command, from a server started the same way."""
    monkeypatch.setattr(forked.Server, "_instance", None)
    ignored = (signal.SIGINT, signal.SIGHUP)
    saved = [signal.signal(signum, signal.SIG_IGN) for signum in ignored]
    try:
        interpreter, fork = both("0")
    finally:
        for signum, handler in zip(ignored, saved):
            signal.signal(signum, handler)
        if forked.Server._instance is not None:
            forked.Server._instance.end()
    assert seen(interpreter)["handlers"] == seen(fork)["handlers"]
    assert seen(fork)["handlers"]["SIGINT"] == seen(fork)["handlers"]["SIGHUP"] == str(signal.SIG_IGN)


def test_its_working_folder_comes_first_on_its_path(tmp_path):
    process = forked.Forked("tests.test_forked", "0", cwd=tmp_path, env=user_env())
    assert process.wait(120) == 0
    got = json.loads(process.communicate()[0])
    assert (got["cwd"], got["path0"]) == (str(tmp_path), str(tmp_path))


def test_an_uncaught_exception_and_ctrl_c_end_it_as_in_a_new_interpreter():
    for how, status in (("raise", 1), ("interrupt", -signal.SIGINT)):
        interpreter, fork = both(how)
        assert fork.returncode == interpreter.returncode == status
        assert fork.stderr.splitlines()[0] == "Traceback (most recent call last):"
        assert fork.stderr.splitlines()[-1] == interpreter.stderr.splitlines()[-1]


def test_it_waits_for_its_threads_then_runs_its_atexit_handlers():
    interpreter, fork = both("thread")
    assert fork.stdout.splitlines()[1:] == interpreter.stdout.splitlines()[1:] == ["thread ended", "atexit ran"]


def test_two_forked_commands_draw_other_random_numbers():
    first, second = (forked.Forked("tests.test_forked", "0", cwd=REPO, env=user_env()) for _ in range(2))
    assert json.loads(first.communicate(120)[0])["random"] != json.loads(second.communicate(120)[0])["random"]


def test_a_signal_ends_it_and_its_status_says_so(tmp_path):
    process = forked.Forked("tests.test_forked", "wait", cwd=tmp_path, env=user_env())
    while not process.stdout.readline():  # started
        assert process.poll() is None
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == -signal.SIGTERM


def test_a_setting_that_libraries_read_when_they_load_needs_a_new_interpreter():
    assert not forked.needs_interpreter({**user_env(), "HOOK_NOTES": "/tmp/notes"})
    assert forked.needs_interpreter({**user_env(), "OMP_NUM_THREADS": "1"})
    assert forked.needs_interpreter({name: value for name, value in user_env().items() if name != "PYTHONUNBUFFERED"})


def test_a_forkserver_forked_for_a_command_is_as_one_started_in_a_new_interpreter():
    """A command forks the forkserver that local DDP starts (instead of importing torch and Lightning again in a new
    interpreter): its descriptors and signals, and what the project's import there records, are a new one's. Its
    workers find torch and Lightning out of the garbage collector's walks, as the server imported them
    (src/launch/preload.py): a full walk would copy every page the fork shares."""
    interpreter, fork = both("forkserver")
    assert interpreter.returncode == fork.returncode == 0, interpreter.stderr[-3000:] + fork.stderr[-3000:]
    new, forked_server = json.loads(interpreter.stdout.splitlines()[1]), json.loads(fork.stdout.splitlines()[1])
    assert (new.pop("server_forked"), forked_server.pop("server_forked")) == (False, True)
    assert forked_server == new and new["recorded"] == "yes" and new["trainer_walked"] is False


def test_a_command_with_threads_starts_its_forkserver_as_a_new_interpreter():
    """A thread pool does not survive a fork: where the command runs threads, its forkserver is a new interpreter."""
    process = forked.Forked("tests.test_forked", "forkserver after a thread", cwd=REPO, env=user_env())
    out, err = process.communicate(120)
    assert process.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[1])["server_forked"] is False


if __name__ == "__main__":
    probe(sys.argv[1])
