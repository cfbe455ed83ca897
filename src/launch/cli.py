"""Around every entry point (`src.train`, `src.eval`): the command line in, one line and an exit status out. Bad input
is one `error:` line, exit status 2 (a diverged loss: 1), and no folder left; a stop or a failed rank is one line naming
what is kept; a sweep prints a summary, writes its report, and fails with its jobs."""

import copy
import logging
import os
import re
import shlex
import sys
from collections.abc import Callable
from datetime import datetime
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src import config, records, resume
from src.records import Result, has_checkpoints
from src.errors import RunFailed, UsageError, interpreter, said
from src.folders import no_link, open_file, own_file, read_bytes, remove_empty, write_file
from src.launch import load, lock, naming, progress, ranks, stops
from src.launch.console import counted, print_error, print_line
from src.launch.stops import RankFailed, RunStopped, signal_name


def folder_argument(key: str, folder: object) -> str:
    """`key=<folder>` as a shell passes it on and Hydra reads it back: quoted for Hydra where the path holds one of its
    grammar's characters, then for the shell (a folder name with a space broke a printed resume command)."""
    value = str(folder)
    if re.search(r"[\s\\()\[\]{}:=,'\"]", value):
        # Hydra's quoted string: a backslash is itself except before a quote or the end, where it is doubled
        value = "'" + re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\'" if m[2] else ""), value) + "'"
    word = f"{key}={value}"
    # In double quotes where the shell would change nothing inside them: readable, `'/a b'` stays Hydra's quoting
    return f'"{word}"' if word != shlex.quote(word) and not re.search(r'["\\$`!]', word) else shlex.quote(word)


def kept(output_dir: Path) -> str:
    """What a stopped run leaves to resume from, and the command that resumes it."""
    sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    python = shlex.quote(interpreter())
    again = (f"{python} -m src.train -m {folder_argument('hydra.sweep.dir', HydraConfig.get().sweep.dir)} ckpt_path=auto"
             if sweep else f"{python} -m src.train ckpt_path=last {folder_argument('hydra.run.dir', output_dir)}")
    again += "".join(f" {folder_argument(key, value)}" for key, value in typed_again())
    if not any((output_dir / "checkpoints").glob("*.ckpt")) and not sweep:
        return "no epoch finished, so there is no checkpoint" + ("" if output_dir.exists() else " (nor its folder)")
    last = output_dir / "checkpoints" / "last.ckpt"
    held = f"{last} holds the last finished epoch" if last.is_file() else "no epoch finished yet"
    return f"{held}; resume with: {again}"


def typed_again() -> list[tuple[str, str]]:
    """The keys a resume must be typed again with, as this run's command typed them: where its data is, which a
    record never carries (`src.resume.TYPED_TO_CHANGE`)."""
    from src.resume import TYPED_TO_CHANGE, typed_values

    return [(key, value) for key, value in typed_values().items() if key in TYPED_TO_CHANGE]


def end_run(line: str, status: int, ended: bool = False) -> NoReturn:
    """`line` on the terminal; where it `ended` a run (stopped or failed, not refused), in its log too."""
    if ended:
        log_ending(line)
    if ranks.is_rank_zero():
        with suppress(OSError, ValueError):  # SIGHUP: the terminal may be gone
            print_error(line)
    sys.exit(status)


def log_ending(line: str) -> None:
    """How the run ended, as the last line of its own log files (`train.log`): a folder that a `nohup` or SLURM run
    left says whether it was stopped, failed or is still running. Not on the terminal, which `end_run` writes."""
    record = logging.LogRecord("src.train", logging.ERROR, __file__, 0, f"error: {line}", None, None)
    for handler in logging.root.handlers:
        if isinstance(handler, logging.FileHandler):
            with suppress(OSError, ValueError):
                handler.handle(record)


def save_records(cfg: DictConfig) -> None:
    """`.hydra/` as Hydra writes it, and `config.yaml` resolved, once the checks pass (Hydra's own writing is off,
    `hydra.output_subdir: null`, so that a refused resume rewrites nothing). A resume keeps `overrides.yaml` as the
    run's start wrote it, and adds its own command line to `resumes.yaml` beside it."""
    folder = Path(cfg.output_dir)
    overrides = folder / ".hydra" / "overrides.yaml"
    goes_on = str(cfg.get("ckpt_path")) in records.CKPT_WORDS and has_checkpoints(folder) and overrides.is_file()
    write_file(folder / ".hydra" / "config.yaml", OmegaConf.to_yaml(cfg), root=folder)
    write_file(folder / ".hydra" / "hydra.yaml", OmegaConf.to_yaml(HydraConfig.instance().cfg), root=folder)
    if goes_on:
        first = records.overrides(records.load(overrides, root=folder), overrides)
        resumes = [*records.resumes(folder), {"at": datetime.now().astimezone().isoformat(timespec="seconds"),
                                              "overrides": resume_overrides(first)}]
        write_file(folder / records.RESUMES, OmegaConf.to_yaml(resumes), root=folder)
    else:
        write_file(overrides, OmegaConf.to_yaml(HydraConfig.get().overrides.task), root=folder)
    write_file(folder / "config.yaml", OmegaConf.to_yaml(OmegaConf.to_container(cfg, resolve=True)), root=folder)


# The overrides this command typed (`-m` aside), set by `main`; None in a process that did not start at `main` (a
# parallel sweep's job).
_typed: list[str] | None = None


def resume_overrides(first: list[str]) -> list[str]:
    """What a resume's command typed; where this process did not read its command line, the overrides of this job
    that its run did not start with."""
    if _typed is not None:
        return list(_typed)
    return [line for line in HydraConfig.get().overrides.task if line not in first]


# The running entry's step before its config is checked (src.eval takes the scored run's model), set by `main`.
_prepare: Callable[[DictConfig], None] | None = None


class CheckFirst(Callback):
    """Hydra's hook between composing a run's config and naming its folder (conf/hydra/default.yaml): the name says
    the precision used, which asks torch about the GPUs, so a config the checks refuse is said before torch is
    imported, and no folder is made for it. `run_job` checks again, as it checks each sweep job."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_first(config)


def check_first(cfg: DictConfig) -> None:
    """`config.check` on a composed run's config, `prepare`d as its job will be; a refusal ends the command."""
    try:
        with naming.hydra_config_of(cfg):  # as Hydra's run_job does first: `${hydra:...}` values resolve
            if _prepare is not None:
                cfg = copy.deepcopy(cfg)
                _prepare(cfg)
            config.check(cfg, named=False)
    except Exception as error:
        line = said(error)
        if line is None:
            raise  # Hydra warns of it, and the job's own checks meet it again
        end_run(str(line), 2 if isinstance(line, UsageError) else 1)  # raised, Hydra would make it a warning


def run_job(cfg: DictConfig, task: Callable[[DictConfig], Result],
            prepare: Callable[[DictConfig], None] | None = None) -> Result:
    """One Hydra job: `prepare`d (src.eval takes the scored run's model), checked, its folder locked, its resume
    checked, its records written, then launched (`src.launch.workers`)."""
    output_dir = Path(cfg.output_dir)
    try:
        with lock.held(output_dir) if ranks.is_rank_zero() else nullcontext():
            ours = ranks.is_rank_zero() and naming.untouched(output_dir)  # decided under the lock: no race with a holder
            try:
                naming.check_own_logs(output_dir)
                if prepare is not None:
                    prepare(cfg)
                config.check(cfg)
                from src.checkpoints import clean_partial  # torch and Lightning: once the config passed its checks
                from src.launch import workers

                if ranks.is_rank_zero():
                    clean_partial(output_dir)
                finished = resume.check(cfg)
                if finished is not None:
                    return finished
                if ranks.is_rank_zero():
                    save_records(cfg)
                if ranks.external_rank() is None:  # torchrun's or SLURM's other ranks start beside this one
                    load.say_if_busy(int(cfg.threads) * workers.processes_per_node(cfg))
                return workers.launch(task, cfg)
            except RunStopped:
                if ours and not has_checkpoints(output_dir):  # stopped before its first checkpoint: nothing to resume
                    naming.unclaim_dir(output_dir)
                raise
            except Exception as error:
                if ours and said(error) is not None:
                    naming.unclaim_dir(output_dir)  # still held: what this command made, and never a checkpoint
                elif not ranks.is_rank_zero() and said(error) is not None:
                    remove_empty([output_dir])  # the folder Hydra made again for this rank, if it holds nothing
                raise
    except RunStopped as stop:
        end_run(f"run stopped by {signal_name(stop.signum)}{stop.where}; {kept(output_dir)}", 128 + stop.signum,
                ended=True)
    except Exception as error:
        line = said(error)  # the user's input, or the machine's refusal (a full disk)
        if line is not None:
            if HydraConfig.get().mode == RunMode.MULTIRUN:
                if not isinstance(line, UsageError):
                    log_ending(str(line))
                raise line from None  # the job fails alone: its launcher says so, and the sweep goes on
            # one line: Hydra would add one of its own; a refusal is no ending of the run
            end_run(str(line), 2 if isinstance(line, UsageError) else 1, ended=not isinstance(line, UsageError))
        # under torchrun or SLURM: a collective that lost its peer or timed out
        failure = error if isinstance(error, RankFailed) else stops.rank_failure(error, cfg)
        if failure is None:
            raise
        end_run(f"{failure.line}; {kept(output_dir)}", 1, ended=True)


def main(hydra_main: Callable[[], object], config_name: str, report: bool = False,
         prepare: Callable[[DictConfig], None] | None = None) -> None:
    """Run the Hydra entry of `conf/<config_name>.yaml` and exit with the status it earned; with `report` (training), a
    resume takes the run's recorded settings first (`src.resume`), and a sweep writes its report. `prepare`: as
    `run_job`'s, for `CheckFirst`."""
    global _prepare, _typed
    _prepare = prepare
    progress.tally = None  # the command's own sweep: none yet, whatever ran before it in this process
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its refusals here, where they become one line
    stops.handle_stop_signals()
    args = sys.argv[1:]
    naming.note_given(args)
    _typed = [arg for arg in args if arg not in ("-m", "--multirun")]
    status = 0
    try:
        config.check_args(args)
        check_log_file(args, config_name)
        if answered_help(config_name, args):
            sys.exit(0)
        sweep_dir = typed_sweep_dir(args)
        fresh = sweep_dir is not None and not sweep_dir.exists()
        # one writer a sweep folder, for the command's life (a new folder is its own)
        with lock.held(sweep_dir, "sweep") if sweep_dir is not None else nullcontext():
            try:
                if sweep_dir is not None:
                    no_link(sweep_dir / "multirun.yaml")  # Hydra's sweeper writes it where it is
                if report:
                    args = resume.with_record(args)
                sweep = [arg for arg in args if arg in ("-m", "--multirun")]  # Hydra takes it before its overrides only
                sys.argv = [sys.argv[0], *sweep, *ranks.rank_argv([arg for arg in args if arg not in sweep])]
                hydra_main()
            except Exception:
                if fresh and progress.tally is None:
                    naming.unclaim_dir(sweep_dir)  # still held, and made by this command
                raise
    except RunStopped as stop:  # outside a job: while Hydra starts, between sweep jobs
        end_run(f"run stopped by {signal_name(stop.signum)}{stop.where}", 128 + stop.signum)
    except Exception as error:
        status = failed(error, args)
    sweep = progress.tally
    if sweep is not None:
        written = write_report(sweep.sweep_dir, sweep.failures, sweep.appendix) if report and sweep.sweep_dir else None
        print_line(sweep.summary(written))
        if sweep.failures:
            jobs = " | ".join(f"{f.name}: {f.line}" for f in sweep.failures)
            print_error(f"{counted(len(sweep.failures), 'sweep job')} failed: {jobs}")
            status = max([status, *(f.status for f in sweep.failures)])
    sys.exit(status)


def answered_help(config_name: str, args: list[str]) -> bool:
    """`--help` with overrides alone (and `-m`), answered without Hydra's slow listing of the config groups."""
    from src.launch import help

    if not help.wants_help(args):
        return False
    overrides = [arg for arg in args if arg not in ("-m", "--multirun", *help.HELP_FLAGS)]
    text = None if any(arg.startswith("-") for arg in overrides) else help.help_text(config_name, overrides)
    if text is None:
        return False
    print(text, flush=True)
    return True


def check_log_file(args: list[str], config_name: str) -> None:
    """Hydra opens `<run folder>/<entry>.log` before the project checks anything: there a FIFO would block it, a link
    or a second name (hard link) carry its lines elsewhere; refused first, in one line."""
    for arg in args:
        if arg.startswith("hydra.run.dir="):
            log_file = Path(arg.partition("=")[2]) / f"{config_name}.log"
            if os.path.lexists(log_file):
                os.close(own_file(open_file(log_file, os.O_RDONLY), log_file, writing=True))


def typed_sweep_dir(args: list[str]) -> Path | None:
    """The folder of `-m hydra.sweep.dir=<folder>`; None for a run, or a sweep in a new folder (`claim_dir`)."""
    if "-m" not in args and "--multirun" not in args:
        return None
    typed = [o for o in config.parse(args) if o.key_or_group == "hydra.sweep.dir" and not o.is_sweep_override()]
    return Path(str(typed[-1].value())) if typed else None


def failed(error: Exception, args: list[str]) -> int:
    """The exit status of a command that raised `error`, once its line is said (a sweep's failed job was, as it
    ended); what is neither the user's input nor a job's failure is a traceback."""
    if progress.tally is not None and any(error is f.error for f in progress.tally.failures):
        return 0
    causes = [error]
    while causes[-1].__cause__ is not None and len(causes) < 10:  # a launcher's refusal, wrapped by Hydra's instantiate
        causes.append(causes[-1].__cause__)
    error = next((e for e in causes if said(e) is not None), error)
    line = str(said(error) or "") or config.explain(error, args)
    if line is None:
        raise error
    if ranks.is_rank_zero():
        print_error(line)
    if progress.tally is None:  # refused before any job ran: no folder is left that this command made for it
        naming.unclaim_unused()
    return 1 if isinstance(said(error), RunFailed) else 2


def write_report(sweep_dir: Path, failures: list[progress.Failure], appendix: str = "") -> Path | None:
    """The sweep's report, its failed jobs listed, with what its sweeper adds; None where no run could be reported."""
    from src.report import write_sweep_report  # matplotlib and TensorBoard: only once a sweep has ended

    written = write_sweep_report(sweep_dir, {f.name: f.line for f in failures})
    if written is not None and appendix:
        write_file(written, read_bytes(written, records.LIMIT).decode() + appendix)
    return written
