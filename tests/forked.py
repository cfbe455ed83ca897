"""`python -m src.train ...` and the project's other entry points, each in a process of its own, forked from a
server that imported torch, Lightning and the project once.

A new interpreter imports them again, 4 to 8 seconds of a core, which no test of the command line is about;
a test process starts one server and forks every command from it. What a test sees is what `subprocess`
gives it: a process of its own (its own pid, session and signals), its exit status, its output on the
descriptors it was handed. In the child, what a new interpreter would set up is set up as it would be:
argv, environment, working folder and `sys.path[0]`, signal handlers, the random generators, and the
module run as `__main__` (the server never imports an entry module, see `ENTRIES`); at the end, the
interpreter's own exit: waiting for threads, atexit handlers, the exit status of a `SystemExit` or of an
uncaught exception. A setting that native libraries read when they load (`OMP_NUM_THREADS`, ...) cannot be
changed in a forked child: a command whose environment changes one runs in a new interpreter
(`needs_interpreter`), as does anything whose own start-up is under test. Nor can a child lose what the
server imported: a module of the checkout (`tests.*`) is found from any working folder.

A command that starts multiprocessing's forkserver (local DDP) forks that too, where a new interpreter would import
the training code again for it (`fork_forkserver`): the fork runs `multiprocessing.forkserver.main` with the
descriptors, signals and `__main__` that a new interpreter would have, and the project's module state that its
import would give; a command that runs threads by then gets a new interpreter. A test of that import itself asks
for a new interpreter (`new_forkserver=True`).
"""

import atexit
import contextlib
import ctypes
import json
import os
import random
import re
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Callable
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import resource_tracker, util
from pathlib import Path
from typing import IO, Any

# Entry points, run as `python -m <name>`: the server drops them after its imports, so that each runs as
# `__main__` without runpy's warning about a module imported before it ran.
ENTRIES = ("src.train", "src.eval", "src.report", "src.sysinfo", "src.scaling.__main__")
# What the commands import: the training code with torch and Lightning, the sweep launchers, the readers.
PRELOAD = ("src.runner", "src.launch.workers", "src.launch.parallel_launcher", "src.report", "src.scaling.predict",
           "src.scaling.cli", "hydra_plugins.project_launchers.parallel", "hydra_plugins.project_launchers.sequential")
# Settings that native libraries read once, when they load: a child cannot take other values of them.
LOAD_TIME = re.compile(r"(OMP|GOMP|KMP|MKL|OPENBLAS|ONEDNN|DNNL|ATEN|TORCH|PYTORCH|LD|MALLOC)_\w*|PYTHON\w*|GLIBC_TUNABLES")
PID, STATUS = struct.Struct("q"), struct.Struct("i")
# The signals whose handling a new interpreter takes over from its parent: one the parent ignores stays ignored
# (SIGINT too: Python then leaves it out of KeyboardInterrupt), any other starts at its default.
INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# ---------------------------------------------------------------- the server, in a process of its own

def serve(address: str) -> None:
    """Import `PRELOAD` as a command imports it (out of the garbage collector's walks: `src.launch.frozen`, or each
    child's first full walk copies the pages it shares with the server), then fork a child for each request on
    `address` until standard input closes."""
    from src.launch import frozen

    at_start = {signum: signal.getsignal(signum) for signum in INHERITED}  # what the test process's commands inherit
    for name in PRELOAD:
        frozen.import_module(name)
    for name in ENTRIES:
        sys.modules.pop(name, None)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    reaped_r, reaped_w = os.pipe()
    os.set_blocking(reaped_w, False)
    signal.set_wakeup_fd(reaped_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup descriptor hears of the signal
    waiting: dict[int, socket.socket] = {}
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ, "request")
    events.register(reaped_r, selectors.EVENT_READ, "reaped")
    events.register(sys.stdin, selectors.EVENT_READ, "end")
    sys.stdout.flush()
    while True:
        for key, _ in events.select():
            if key.data == "end" and not os.read(sys.stdin.fileno(), 1024):
                return
            if key.data == "reaped":
                os.read(reaped_r, 1024)
                _report_ended(waiting)
            if key.data == "request":
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
                if not message or len(fds) != 3:  # a test process that only checked the server listens
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    for closed in (listener, connection, *waiting.values()):
                        closed.close()
                    os.close(reaped_r)
                    os.close(reaped_w)
                    _run(json.loads(message), fds, at_start)  # never returns
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):  # the test is gone; its command runs on, as a Popen's would
                    connection.sendall(PID.pack(pid))
                waiting[pid] = connection
                _report_ended(waiting)  # one that ended before it was listed


def _report_ended(waiting: dict[int, socket.socket]) -> None:
    for pid in list(waiting):
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            connection = waiting.pop(pid)
            with contextlib.suppress(OSError):  # the test gave up waiting
                connection.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
            connection.close()


def _run(request: dict[str, Any], fds: list[int], handlers: dict[int, Any]) -> None:
    """In the child: become `python -m <module> <args>` as a new interpreter would, run it, exit as it would."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it up
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # as `python -m` puts the working folder first
    sys.argv = ["-m", *request["args"]]
    sys.orig_argv = [sys.executable, "-m", request["module"], *request["args"]]
    _seed_anew()
    if not request["new_forkserver"]:
        util.spawnv_passfds = fork_forkserver(util.spawnv_passfds)
    code = 1
    try:
        runpy._run_module_as_main(request["module"])  # what `python -m` calls
        code = 0
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        _shut_down()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python ends by its signal, so its status says so
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001  printed and ended on, as the interpreter does
        sys.excepthook(*sys.exc_info())
    _shut_down()
    os._exit(code)


def _seed_anew() -> None:
    """The random generators seeded afresh, as in a new interpreter."""
    random.seed()
    with contextlib.suppress(ImportError):
        import numpy
        import torch

        numpy.random.seed()
        torch.seed()


FORKSERVER = "from multiprocessing.forkserver import main"
FORKSERVER_NAME = b"mp-forkserver"  # the name in /proc/<pid>/comm of a forkserver forked so, and of its workers
PR_SET_NAME = 15
Spawn = Callable[[str, list[str], list[int]], int]  # multiprocessing.util.spawnv_passfds(path, args, passfds) -> pid


def fork_forkserver(spawnv_passfds: Spawn) -> Spawn:
    """`multiprocessing.util.spawnv_passfds` that forks the forkserver instead of starting a new interpreter for it:
    that one's import of torch and Lightning is 5 s of a core, each time a test's command starts local DDP. Only a
    process of one thread forks it: a thread pool (OpenMP's, once this process has trained, as a sweep's earlier
    job does) does not survive a fork, and the workers' first parallel region would wait forever."""
    def spawn(path: str, args: list[str], passfds: list[int]) -> int:
        if not args[-1].startswith(FORKSERVER) or len(os.listdir("/proc/self/task")) > 1:
            return spawnv_passfds(path, args, passfds)
        for stream in (sys.stdout, sys.stderr):  # or the server and its workers would write it again
            stream.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            _as_a_new_interpreter(args, passfds)
            exec(args[-1], {"__name__": "__main__"})  # the `-c` code: `main(...)`, until the last client is gone
            code = 0
        except SystemExit as exit_:
            code = _exit_status(exit_.code)
        except BaseException:  # noqa: BLE001  printed, as the interpreter would
            traceback.print_exc()
        os._exit(code)

    return spawn


def is_forked_forkserver(pid: int) -> bool:
    """A forkserver that `fork_forkserver` forked, or a worker of one (its command line is still the server's)."""
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip() == FORKSERVER_NAME
    except OSError:
        return False


def _as_a_new_interpreter(args: list[str], passfds: list[int]) -> None:
    """What `exec` of `python -c` would leave: only descriptors 0-2 and `passfds` open, signals that had a handler
    at their default (ignored ones stay ignored), an empty `__main__`, and the module state of the project's import
    (the environment `src.launch.workers` records, which tells a worker the agent's variables from its own)."""
    keep = {0, 1, 2, *passfds}
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            signal.signal(signum, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(PR_SET_NAME, FORKSERVER_NAME, 0, 0, 0)  # its command line is still the server's
    sys.modules["__main__"] = types.ModuleType("__main__")
    # multiprocessing's forkserver and resource tracker as they start in a new interpreter: the caller is inside
    # `ensure_running`, holding the forkserver's lock, and its server and tracker are not this process's.
    # (Its record of the current process each worker sets up for itself.)
    mp_forkserver._forkserver.__init__()  # type: ignore[misc]
    resource_tracker._resource_tracker.__init__()  # type: ignore[misc]
    sys.argv = ["-c"]
    sys.orig_argv = list(args)
    if "src.launch.workers" in sys.modules:
        sys.modules["src.launch.workers"]._IMPORTED_WITH = dict(os.environ)
    _seed_anew()


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _shut_down() -> None:
    """The interpreter's exit: its other threads, its atexit handlers, what the streams still hold."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# ---------------------------------------------------------------- the test process's side

class Server:
    """The server of this test process, started at its first command; it ends when this process does, and
    `end` (at the end of the test session) takes its folder away too."""

    _instance: "Server | None" = None

    def __init__(self) -> None:
        from tests.helpers import REPO, user_env

        self.folder = tempfile.mkdtemp(prefix="forked_")
        self.address = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "server.log"), "w+")
        self.env = user_env()
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from tests.forked import serve; serve({self.address!r})"], cwd=REPO,
            env=self.env, stdin=subprocess.PIPE, stdout=self.log, stderr=self.log)

    @classmethod
    def get(cls) -> "Server":
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = Server()
        return cls._instance

    def end(self) -> None:
        """Close its standard input, wait for it to end, and remove its socket, log and folder."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def connect(self) -> socket.socket:
        """A connection to the server, once it listens (it imports first: seconds)."""
        while True:
            connection = socket.socket(socket.AF_UNIX)
            try:
                connection.connect(self.address)
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if self.process.poll() is not None:
                    self.log.seek(0)
                    raise RuntimeError(f"the command server ended:\n{self.log.read()[-3000:]}") from None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(0.05)


def needs_interpreter(env: dict[str, str]) -> bool:
    """Whether a command with environment `env` needs a new interpreter: it changes a setting that the server's
    libraries read when they loaded."""
    base = Server.get().env
    return any(LOAD_TIME.fullmatch(name) and env.get(name) != base.get(name) for name in {*env, *base})


class Forked:
    """`python -m <module> <args>` in a forked process, with what a test uses of `subprocess.Popen`: `pid`,
    `poll`, `wait`, `communicate`, `send_signal`, `returncode`, and `stdout`/`stderr` to read from. The
    output goes to files (`merged`: both streams to one, as a terminal shows them)."""

    def __init__(self, module: str, *args: str, cwd: Path, env: dict[str, str], new_session: bool = False,
                 merged: bool = False, new_forkserver: bool = False) -> None:
        self.args = [sys.executable, "-m", module, *args]
        # The child writes to files of its own (its descriptors share their position); these read them.
        written = [tempfile.NamedTemporaryFile("ab") for _ in range(1 if merged else 2)]
        self.stdout: IO[str] = open(written[0].name, errors="replace")
        self.stderr: IO[str] = open(written[-1].name, errors="replace")
        self.returncode: int | None = None
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env, "new_session": new_session,
                   "new_forkserver": new_forkserver}
        self._connection = Server.get().connect()
        with open(os.devnull) as stdin:
            socket.send_fds(self._connection, [json.dumps(request).encode()],
                            [stdin.fileno(), written[0].fileno(), written[-1].fileno()])
        for file in written:
            file.close()  # the name goes, the child's copy of the file stays
        self.pid: int = PID.unpack(_receive(self._connection, PID.size))[0]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._connection.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                self._ended(self._connection.recv(STATUS.size))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.setblocking(True)
            self._connection.settimeout(timeout)
            try:
                self._ended(_receive(self._connection, STATUS.size))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """What the command wrote, once it has ended (stderr is "" where it went with stdout)."""
        self.wait(timeout)
        return self._read(self.stdout), "" if self.stderr.name == self.stdout.name else self._read(self.stderr)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, data: bytes) -> None:
        if len(data) == STATUS.size:
            self.returncode = STATUS.unpack(data)[0]
            self._connection.close()

    @staticmethod
    def _read(file: IO[str]) -> str:
        file.seek(0)
        return file.read()


def _receive(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise RuntimeError("the command server ended")
        data += chunk
    return data


def run(module: str, *args: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """As `subprocess.run([python, -m, module, *args], capture_output=True, text=True, timeout=timeout)`."""
    process = Forked(module, *args, cwd=cwd, env=env)
    try:
        stdout, stderr = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
