"""Schedulers behind one interface, found by name: ``hpc.schedulers.<name>`` is the module.

A scheduler is one module here that defines ``SCHEDULER``, a subclass of
:class:`Scheduler`, plus its template (``templates/<name>.sh.j2``) and at least one
cluster profile that names it. Everything that differs between PBS, SLURM and this
machine lives in that module: the template and script suffix, the launchers it can
start ranks with, the queue directive, the environment it adds to a job, its own
checks, and submit/status/cancel through its command-line clients (``statuses``:
many ids in one query, where the clients allow it). Nothing outside the module
branches on a scheduler's name.

States are a :class:`JobState`, so callers never see scheduler-specific letters.
"""

from __future__ import annotations

import importlib
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hpc.errors import SchedulerError, UserError
from hpc.schedulers._client import MAX_ID_CHARS, MAX_IDS_PER_CALL, chunks, last_line, run, stream
from hpc.schedulers._launchers import LAUNCHERS, Builder, LauncherKind

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.cluster import Cluster
    from hpc.job import Job
    from hpc.spec import JobSpec
    from hpc.stage import Stage

__all__ = [
    "LAUNCHERS",
    "MAX_ID_CHARS",
    "MAX_IDS_PER_CALL",
    "STATES",
    "Builder",
    "JobState",
    "LauncherKind",
    "Scheduler",
    "SchedulerError",
    "Submission",
    "chunks",
    "detect",
    "get",
    "last_line",
    "names",
    "run",
    "stream",
]


class JobState(str, Enum):
    """A job's state in words every scheduler maps to (a ``str``: prints and compares as text)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    #: Ended, outcome unknown: the server no longer knows the job and keeps no history.
    FINISHED = "FINISHED"
    UNKNOWN = "UNKNOWN"

    def __str__(self) -> str:
        return self.value

    @property
    def ended(self) -> bool:
        """True once the job will not run again by itself."""
        return self in _ENDED


_ENDED = {
    JobState.COMPLETED,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.TIMEOUT,
    JobState.FINISHED,
}
STATES = tuple(s.value for s in JobState)


@dataclass(frozen=True)
class Submission:
    """What a submit returned: the job id, and for a job that ran to the end here, its exit code."""

    job_id: str
    exit_code: int | None = None

    @property
    def state(self) -> JobState | None:
        """COMPLETED/FAILED for a job that already ended (local runs), else None (ask status)."""
        if self.exit_code is None:
            return None
        return JobState.COMPLETED if self.exit_code == 0 else JobState.FAILED


class Scheduler:
    """One batch system. Subclasses set the class attributes and the client methods."""

    #: The profile's ``scheduler:`` value and this module's name.
    name: ClassVar[str]
    #: Suffix of rendered scripts (``.pbs``); the template is ``<name>.sh.j2``.
    script_suffix: ClassVar[str] = ".sh"
    #: The launcher kind a profile gets when it names none (a row of :data:`LAUNCHERS`
    #: with a builder for this scheduler; see :attr:`launchers`).
    default_launcher: ClassVar[str]
    #: Launcher kinds ``resilience:`` can run under ``ddp.supervise`` here: the ones whose
    #: line the supervisor can relaunch on fewer nodes (``ddp.relaunch``).
    supervised_launchers: ClassVar[tuple[str, ...]] = ()
    #: The profile's ``queue_directive`` when it gives none, and the ones it may give.
    queue_directives: ClassVar[tuple[str, ...]] = ("queue",)
    #: The client whose presence on PATH says a login node has this scheduler, and the
    #: order in which :func:`detect` asks (lower first); None: never detected.
    client: ClassVar[str | None] = None
    detect_order: ClassVar[int] = 100
    #: The variable holding an array task's index inside the job (None: submit runs the
    #: tasks one after another itself), and whether ``max_parallel`` can be expressed.
    array_index_var: ClassVar[str | None] = None
    array_throttle: ClassVar[bool] = False
    #: Whether a sweep wider than :meth:`array_size_limit` is submitted as several
    #: arrays, each told its first task in the sweep by :attr:`array_offset_word`
    #: (``hpc.sweep.split``); False: one array, whatever its size.
    array_parts: ClassVar[bool] = False
    #: The fewest tasks one array may have here (PBS: 2, ``qsub -J 0-0`` is refused).
    array_min_size: ClassVar[int] = 1
    #: The shell word that gives an array part its offset inside the job (empty: 0, the
    #: first part): the script's first argument (``sbatch SCRIPT OFFSET``), or a variable
    #: where the submit command passes a script no arguments (PBS: ``qsub -v``).
    array_offset_word: ClassVar[str] = "${1:-0}"
    #: The cluster setting :meth:`array_size_limit` reads, named in the note of a split.
    array_size_setting: ClassVar[str] = "array size"
    #: True where submit runs the job here to the end: it writes the job's log into the
    #: run directory itself and the record holds the final state; False where a
    #: directive (``-o``/``--output``) sends the log there and the scheduler knows the state.
    runs_here: ClassVar[bool] = False
    #: Whole file names (regexes) of this scheduler's job logs in a run directory, as
    #: its template's directives make them: group ``job`` is the job id as written
    #: there; a scheduler that writes no id into the name numbers them (group ``seq``).
    log_patterns: ClassVar[tuple[str, ...]] = ()
    #: Its job ids as a user would type them, for messages (``12345, 12345_3``).
    id_examples: ClassVar[str] = ""
    #: The variable that holds the job's id inside the job (names a staged venv's copy).
    job_id_var: ClassVar[str | None] = None

    @property
    def template(self) -> str:
        """The Jinja2 template this scheduler's scripts are rendered from."""
        return f"{self.name}.sh.j2"

    # --- what a job looks like here ----------------------------------------------

    def check_spec(self, spec: JobSpec, cluster: Cluster) -> None:
        """Refuse spec keys that mean nothing to this scheduler (UserError, one line)."""

    def check_runs_dir(self, path: Path) -> None:
        """Refuse a run directory this scheduler's directives cannot name."""

    def job_env(self, job: Job) -> dict[str, str]:
        """Variables this scheduler adds to every job (the spec's own win)."""
        return {}

    def template_values(self, job: Job) -> dict[str, Any]:
        """Values computed for the template, so the template does no arithmetic."""
        return {}

    def array_spec(self, job: Job) -> str | None:
        """The array's index range for the directive (``0-3``, with ``%N`` where the
        scheduler throttles that way); None for a job that is no array."""
        if not job.array_size:
            return None
        spec = f"0-{job.array_size - 1}"
        return f"{spec}%{job.max_parallel}" if job.max_parallel and self.array_throttle else spec

    def task_id(self, job_id: str, index: int) -> str:
        """The id of one array task, as the scheduler's clients take it."""
        return f"{job_id}_{index}"

    def array_size_limit(self) -> int | None:
        """Most tasks one array may hold here (indices ``0 .. N-1``), asked of the
        cluster at submit time; None: no limit known (one array)."""
        return None

    def array_part_command(
        self,
        script: str,
        count: int,
        offset: int,
        max_parallel: int | None = None,
        after: After | None = None,
    ) -> list[str]:
        """The submit command of one more array of a split sweep: ``count`` tasks whose
        first is task ``offset`` of the sweep (see :attr:`array_parts`)."""
        raise UserError(
            f"--sweep: the {self.name} scheduler cannot split a sweep into "
            "several arrays; allowed: a sweep within its array size"
        )

    def submit_array_part(
        self,
        script: str,
        count: int,
        offset: int,
        max_parallel: int | None = None,
        after: After | None = None,
    ) -> Submission:
        """Submit one more array of a split sweep (:meth:`array_part_command`)."""
        argv = self.array_part_command(script, count, offset, max_parallel, after)
        proc = run(argv)
        if proc.returncode != 0:
            raise SchedulerError(
                f"{argv[0]} refused the job (exit {proc.returncode}): "
                f"{last_line(proc.stderr or proc.stdout)}"
            )
        return Submission(self.parse_job_id(proc.stdout))

    # --- its job ids and logs (hpc logs) ---------------------------------------------

    def split_id(self, job_id: str) -> tuple[str, str | None] | None:
        """``(job number, array task or None)`` of an id this scheduler gives; None for
        any other text (or a scheduler whose ids carry no number)."""
        return None

    def owns_id(self, job_id: str) -> bool:
        """Whether ``job_id`` has the form of this scheduler's ids."""
        return self.split_id(job_id) is not None

    def array_of(self, task_id: str) -> str | None:
        """The id the array of ``task_id`` was recorded under, where that is not the
        task's job number (PBS: ``123[4].server`` -> ``123[].server``)."""
        return None

    def log_name(self, job_name: str, job_id: str, task: str | None, seq: int) -> str | None:
        """The file name this scheduler will give the log of a run's job that has not
        started yet, so ``hpc logs -f`` can wait for it: ``job_id`` as recorded,
        ``task`` an array task, ``seq`` the job's place among the run's jobs here (1:
        the first). None: it cannot say."""
        return None

    def err_log_name(self, out_name: str) -> str | None:
        """The name of the stderr log beside the log ``out_name`` of a job run with
        ``split_logs``; None: this scheduler writes one merged log."""
        return None

    @property
    def launchers(self) -> tuple[str, ...]:
        """Launcher kinds that can start ranks here: the rows of :data:`LAUNCHERS` with a
        builder for this scheduler, read at each call (a row added later counts), in the
        table's order with :attr:`default_launcher` first (a profile's default)."""
        kinds = [kind for kind, row in LAUNCHERS.items() if self.name in row.builders]
        return tuple(sorted(kinds, key=lambda kind: kind != self.default_launcher))

    def launch(self, job: Job) -> tuple[list[str], list[str]]:
        """Shell lines before the launch (our own text) and the launch words (quoted
        later), from the builder the launcher table gives ``job.launcher`` here."""
        words = LAUNCHERS[job.launcher].builders[self.name](job)
        return words if isinstance(words, tuple) else ([], words)

    def stage_lines(self, job: Job, stage: Stage) -> list[str]:
        """The lines that copy the venv to every node of the job (``hpc.stage``); a
        scheduler that cannot start one process per node says so in one line."""
        raise UserError(
            f"python.stage: the {self.name} scheduler cannot start one process "
            "per node to unpack the environment; allowed: stage: never"
        )

    # --- the clients ---------------------------------------------------------------

    def submit_command(self, script: str, after: After | None = None) -> list[str]:
        """The command that submits ``script`` (what ``--dry-run`` prints), ``after``
        another job ended (``hpc.chain``)."""
        raise NotImplementedError

    def dependency(self, after: After) -> list[str]:
        """The submit command's words for ``after``; a scheduler without job
        dependencies says so in one line."""
        raise UserError(
            f"--after/--chain: the {self.name} scheduler has no job dependencies; "
            "allowed: a SLURM or PBS cluster"
        )

    def parse_job_id(self, stdout: str) -> str:
        """The job id in the submit command's answer."""
        raise NotImplementedError

    def submit(
        self,
        script: str,
        run_dir: str,
        on_start: Callable[[str], None] | None = None,
        after: After | None = None,
    ) -> Submission:
        """Submit ``script`` (``on_start`` gets the id of a job that runs here, as it starts)."""
        argv = (
            self.submit_command(script, after) if after is not None else self.submit_command(script)
        )
        proc = run(argv)
        if proc.returncode != 0:
            raise SchedulerError(
                f"{argv[0]} refused the job (exit {proc.returncode}): "
                f"{last_line(proc.stderr or proc.stdout)}"
            )
        return Submission(self.parse_job_id(proc.stdout))

    def status(self, job_id: str) -> JobState:
        """The job's state; UNKNOWN when the scheduler cannot say."""
        raise NotImplementedError

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """The state of each of ``job_ids`` (an array's tasks, a run's jobs), every id
        a key, UNKNOWN where the scheduler cannot say.

        A scheduler is shared by thousands of users: ``hpc status`` of a 1,000-task
        sweep must be one query, not 1,001. SLURM and PBS override this with their
        batched forms (``squeue -j a,b,c``, ``qstat -f ID ID ...``, an array's id
        answering for all its tasks); this default asks :meth:`status` once per id,
        so a new scheduler works before it has a batched form.
        """
        return {job_id: self.status(job_id) for job_id in dict.fromkeys(job_ids)}

    def ended_state(self, run_dir: Path, job_id: str, cancelled: bool) -> JobState:
        """How a Python API job (``hpc.executor``) that :meth:`status` no longer knows
        ended, from what its run directory holds; ``cancelled``: ``hpc cancel`` stopped
        it. A scheduler that keeps its jobs' end states (sacct, qstat -x) has nothing
        to add: UNKNOWN. The local one, which has no such record, overrides it."""
        return JobState.UNKNOWN

    def cancel(self, job_id: str) -> None:
        """Ask the scheduler to end the job (SchedulerError when it refuses)."""
        raise NotImplementedError

    def exit_code(self, job_id: str) -> int | None:
        """The exit code of a job that ended, as a shell reports it (128+N for a job
        signal N ended), from what the scheduler keeps of it; None when it cannot say
        (``hpc logs -f`` then goes by the state alone)."""
        return None

    # --- the Python API (hpc.executor): issue 29 ----------------------------------------

    def submitit_executor(
        self, job: Job, folder: Path, max_num_timeout: int = 3, run_dir: Path | None = None
    ) -> Any:
        """The submitit executor that runs Python functions as this scheduler's jobs
        (``hpc.executor``), set up for the resolved ``job``; ``run_dir``: the run
        directory whose ``run.json`` gets the ids it submits.

        By default :meth:`script_executor`'s class: this scheduler's own template,
        ``submit``, ``statuses`` and ``cancel``, so a new scheduler module has the
        Python API as it is (it needs :attr:`job_id_var`)."""
        return self.script_executor()(
            folder,
            max_num_timeout=max_num_timeout,
            python="python" if job.spec.python else None,
            job=job,
            run_dir=run_dir,
        )

    def script_executor(self) -> type:
        """The class :meth:`submitit_executor` builds: :class:`~hpc.executors.script.ScriptExecutor`
        or a subclass with this scheduler's additions (PBS: ``PBSExecutor``)."""
        from hpc.executors.script import ScriptExecutor

        return ScriptExecutor

    def check_submitit_launcher(self, job: Job, note: str = "") -> None:
        """Refuse a launcher that does not start every rank itself (``per_rank`` False: one
        torchrun per node), whose ranks submitit's SLURM and PBS executors cannot read
        (they read the launcher's per-rank variables). ``note``: said after the choices."""
        if not LAUNCHERS[job.launcher].per_rank:
            allowed = [kind for kind in self.launchers if LAUNCHERS[kind].per_rank]
            raise UserError(
                f"launcher: {job.launcher!r} cannot start submitit's ranks on "
                f"{job.cluster.name}; allowed: auto, {', '.join(allowed)}{note}"
            )

    def submitit_array(self, job: Job, size: int) -> Job | None:
        """``job`` as one array of ``size`` tasks for ``map_array`` (its id ``ID``, the
        tasks' ``ID_0 .. ID_N-1`` as submitit names them); None: this scheduler has no
        array form for it, so each task is a job of its own."""
        return None

    def record_ids(self, submitit_ids: Sequence[str]) -> list[str]:
        """The ids ``run.json`` keeps for jobs its submitit executor returned: the form
        this scheduler's clients (and so ``hpc status``/``cancel``) take."""
        return list(submitit_ids)

    # --- what no caller asks by this scheduler's name (issue 29) ----------------------

    #: The client that keeps a finished job's start, end and node count (``hpc status
    #: --used``); None: no scheduler times (``hpc.charges.used_lines`` says so).
    usage_client: ClassVar[str | None] = None

    def job_usage(self, job_id: str) -> tuple[float, int] | str:
        """(seconds, nodes) the job held, from :attr:`usage_client`; or why not."""
        return f"the {self.name} scheduler keeps no job times"

    def supervises(self, job: Job) -> bool:
        """Whether ``ddp.supervise`` can relaunch this job's launch line inside its
        allocation (``resilience:``, :func:`hpc.launchers.supervised`): its launcher is
        one of :attr:`supervised_launchers`."""
        return job.launcher in self.supervised_launchers


_NAME = r"^[a-z][a-z0-9_]*\Z"


def names() -> list[str]:
    """Every scheduler module in this package's folders (its ``__path__``), sorted."""
    return sorted(
        {
            p.stem
            for folder in __path__
            for p in Path(folder).glob("*.py")
            if re.match(_NAME, p.stem)
        }
    )


def get(name: str) -> Scheduler:
    """The scheduler a profile's ``scheduler:`` names (its module's ``SCHEDULER``).

    The module is imported directly (a render asks several times; the folder is listed
    only to name the choices when the name is unknown)."""
    module = None
    if re.match(_NAME, name):
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":  # the module exists but its import broke
                raise
    if module is None:
        from hpc._util import did_you_mean

        known = names()
        raise UserError(
            f"scheduler: {name!r} is not known{did_you_mean(name, known)}; "
            f"allowed: {', '.join(known)}"
        )
    scheduler: Scheduler = module.SCHEDULER()
    return scheduler


def detect() -> str | None:
    """Which scheduler this login node has, asking in each one's ``detect_order``
    (SLURM first: Debian's slurm-wlm-torque installs a ``qstat`` wrapper over SLURM)."""
    classes = [importlib.import_module(f"{__name__}.{n}").SCHEDULER for n in names()]
    for cls in sorted(classes, key=lambda c: c.detect_order):
        if cls.client and shutil.which(cls.client):
            return str(cls.name)
    return None
