"""This machine: run the script now, stream its output, keep its exit code."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hpc._pipes import detach, reader_gone
from hpc.errors import UserError
from hpc.schedulers import JobState, Scheduler, Submission
from hpc_ddp.procs import descendants, group_members, process_start, process_state

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.job import Job


#: Linux's largest pid (PID_MAX_LIMIT, 2**22, in the kernel's include/linux/threads.h).
PID_MAX = 4_194_304
#: Set in the environment of each job ``hpc run`` or ``hpc.executor`` starts (its run
#: directory): a cancel signals only a process that carries it, whatever a run.json says
#: (:func:`_marked`).
MARK = "HPC_LOCAL_RUN"
#: How long ``hpc cancel`` gives an ``hpc.executor`` job to end on SIGINT before SIGKILL
#: (slurmd's KillWait between its SIGTERM and SIGKILL is 30 s by default; submitit's
#: own controller gives its ranks 1 s).
CANCEL_WAIT_S = 10.0
MAX_ENVIRON = 4 << 20  # bytes of /proc/PID/environ read: an environment is kilobytes


class Local(Scheduler):
    """Runs the rendered script with bash in the current directory, to the end."""

    name = "local"
    script_suffix = ".sh"
    default_launcher = "torchrun"  # the launch builder: hpc.launchers.local
    supervised_launchers = ("torchrun",)  # one node: the same line again
    runs_here = True
    # submit writes output.log, then output-2.log ... for each --resume (create_free)
    log_patterns = (r"output(?:-(?P<seq>[0-9]+))?\.log",)
    id_examples = "local-PID-START"

    def template_values(self, job: Job) -> dict[str, Any]:
        """The signals ``hpc run`` passes on that ask the job to end, for the trap of a
        sweep's loop (SIGCONT asks nothing)."""
        asks_to_end = [s for s in _Forward.SIGNALS if s != signal.SIGCONT]
        return {"stop_signals": " ".join(s.name.removeprefix("SIG") for s in asks_to_end)}

    def owns_id(self, job_id: str) -> bool:
        """``local-PID-START`` (older runs: ``local-PID``)."""
        try:
            _parse(job_id)
        except UserError:
            return False
        return True

    def log_name(self, job_name: str, job_id: str, task: str | None, seq: int) -> str | None:
        """``output.log`` for a run's first job, ``output-N.log`` for its Nth (no id in the name)."""
        return "output.log" if seq == 1 else f"output-{seq}.log"

    def submit_command(self, script: str, after: After | None = None) -> list[str]:
        """``bash SCRIPT``."""
        return ["bash", script]

    def parse_job_id(self, stdout: str) -> str:
        """Local ids are ``local-PID``."""
        return stdout.strip()

    def submit(
        self,
        script: str,
        run_dir: str,
        on_start: Callable[[str], None] | None = None,
        after: After | None = None,
    ) -> Submission:
        """Run to the end, streaming output to the terminal and a new ``output*.log``.

        ``on_start`` gets the job id as soon as the process exists, so ``hpc status``
        and ``hpc cancel`` work while it runs. The id is ``local-PID-START``: START is
        the process's start time (clock ticks since boot, /proc/PID/stat), so a later
        cancel can tell the run from an unrelated process that reused the pid.

        The job outlives anything that happens to hpc's own output (:func:`_tee`) and
        gets the signals sent to hpc (:class:`_Forward`), so the exit code returned and
        recorded is always the job's own.
        """
        from hpc.runs import create_free

        log = create_free(Path(run_dir), "output", ".log")  # a resumed run keeps older logs
        with open(log, "wb", buffering=0) as sink, _Forward() as forward:
            # Its own session: `hpc cancel` signals the whole job (srun-like), not only bash.
            proc = subprocess.Popen(
                self.submit_command(script),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, MARK: str(Path(run_dir).absolute())},
            )
            forward.to(proc.pid)  # before anything else: a signal from now on is the job's
            job_id = f"local-{proc.pid}-{process_start(proc.pid) or 0}"
            if on_start is not None:
                on_start(job_id)
            assert proc.stdout is not None
            _tee(proc.stdout, sink, log)
            # Wait without reaping: while the job is a zombie its pid (the group's id)
            # cannot be reused, so a signal forwarded until here reaches no stranger.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        rc = proc.wait()
        # killed by signal N: 128+N, as a shell says
        return Submission(job_id, exit_code=128 - rc if rc < 0 else rc)

    def status(self, job_id: str) -> JobState:
        """RUNNING while the very process of the job lives; a finished one from its run dir."""
        return JobState.RUNNING if _alive(*_parse(job_id)) else JobState.UNKNOWN

    def ended_state(self, run_dir: Path, job_id: str, cancelled: bool) -> JobState:
        """From submitit's files in the run directory: :func:`executor_end_state`."""
        return executor_end_state(run_dir, job_id, cancelled)

    def cancel(self, job_id: str) -> None:
        """Stop the job, only if its pid is still the job's process.

        A job of ``hpc run`` is a session of its own: SIGTERM to all of it, as scancel
        does. A job of ``hpc.executor`` is submitit's controller (under the shell that
        runs its setup lines) and its ranks, inside the caller's group: SIGINT to each of
        them, which is a Ctrl-C in the terminal and submitit's own ``job.cancel()`` (its
        ranks ignore SIGTERM, which SLURM sends before a preemption).
        """
        pid, start = _parse(job_id)
        if not _alive(pid, start):
            raise UserError(
                f"job: {job_id!r} is not running (finished, or its pid now belongs "
                "to another process); allowed: a running local job"
            )
        if _leader(pid):
            os.killpg(pid, signal.SIGTERM)  # the job's session leader: every process of it
            return
        _stop_tree(pid, start)

    # --- the Python API (hpc.executor): issue 29 ----------------------------------------

    def submitit_executor(
        self, job: Job, folder: Path, max_num_timeout: int = 3, run_dir: Path | None = None
    ) -> Any:
        """submitit's LocalExecutor: the ranks as processes here, the walltime as its timeout."""
        from hpc.executors import params
        from hpc.executors.recorded import LocalExecutor

        ex = LocalExecutor(folder, max_num_timeout=max_num_timeout, run_dir=run_dir, scheduler=self)
        local = params.local_parameters(job)
        if run_dir is not None:  # the mark that lets `hpc status`/`hpc cancel` act on it
            mark = f"export {MARK}={shlex.quote(str(run_dir.absolute()))}"
            local["setup"] = [mark, *local.get("setup", [])]
        ex.update_parameters(**local)
        return ex

    def record_ids(self, submitit_ids: Sequence[str]) -> list[str]:
        """submitit's local ids are pids (of the shell that runs the setup lines, then
        its controller): recorded as ``local-PID-START`` like ``hpc run``'s, read at once
        while that process (or its zombie, which submitit reaps later) is there."""
        return [f"local-{j}-{process_start(int(j)) or 0}" for j in submitit_ids]


class _Forward:
    """Pass the signals sent to ``hpc run`` on to the job's process group while it runs.

    The job has its own session (so ``hpc cancel`` can signal all of it), which also
    means a terminal's Ctrl-C, a hang-up or a batch system's warning signal no longer
    reaches it directly; without forwarding, hpc died of them (SIGUSR1's default is to
    terminate) and the job ran on with nobody reading its output. The list is srun's,
    which forwards these to its tasks. The handlers are in place before the job exists:
    a signal that comes earlier waits for it (:meth:`to`); one that comes when no job
    could be started is taken by hpc itself, as it would have been without a job.
    """

    SIGNALS = (
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGALRM,
        signal.SIGCONT,
    )

    def __init__(self) -> None:
        self.pgid: int | None = None
        self.pending: list[int] = []
        self.old: dict[int, Any] = {}

    def __enter__(self) -> _Forward:
        for signum in self.SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: nothing to forward
                self.old[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.pgid is None:
            self.pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signum)

    def to(self, pgid: int) -> None:
        """Forward to ``pgid`` from now on, first what came before it existed."""
        self.pgid = pgid
        while self.pending:
            self._handle(self.pending.pop(0), None)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.old.items():
            signal.signal(signum, handler)
        if self.pgid is None and self.pending:  # no job took them: they were hpc's
            signal.raise_signal(self.pending[0])


def _tee(source: IO[bytes], sink: IO[bytes], log: Path) -> None:
    """Copy the job's output to its log and to hpc's stdout until the job closes it.

    Each side may fail on its own: stdout's reader gone (``hpc run | head -1``, a pager
    quit early), a hung-up terminal, the log's disk full. The failed side is dropped,
    with one line unless it is a reader that left (quiet, as ``tee -p`` is), and the
    other goes on getting every byte: the job is never blocked or killed by SIGPIPE
    because hpc stopped reading, and its log holds all it wrote.
    """
    out = getattr(sys.stdout, "buffer", None)
    echo = sys.stdout is not None
    to_log = True
    for chunk in iter(lambda: source.read1(65536), b""):  # type: ignore[attr-defined]
        if to_log:
            try:
                _write_all(sink, chunk)  # unbuffered: `hpc logs -f` reads it while it runs
            except OSError as exc:
                to_log = False
                _say(
                    f"hpc: cannot write the log {str(log)!r}: {exc.strerror}; the job goes "
                    "on, its output only here"
                )
        if echo:
            try:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stdout.write(chunk.decode(errors="replace"))
            except OSError as exc:
                echo = False
                if not reader_gone(sys.stdout):
                    _say(
                        f"hpc: cannot write to stdout: {exc.strerror}; the job goes on, "
                        f"its log: {str(log)!r}"
                    )
                detach(sys.stdout)  # what is still buffered goes nowhere, without an error


def _write_all(fh: IO[bytes], data: bytes) -> None:
    """All of ``data`` to an unbuffered file (a write may take part of it)."""
    view = memoryview(data)
    while view:
        written = fh.write(view)
        if not written:
            raise OSError(errno.EIO, "the log took no more bytes")
        view = view[written:]


def _say(line: str) -> None:
    """One line on stderr, unless stderr is gone too (then there is nobody to tell)."""
    with contextlib.suppress(OSError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _parse(job_id: str) -> tuple[int, int | None]:
    """(pid, start ticks) of ``local-PID-START``; older ``local-PID`` ids have no start.

    PID is 1 to :data:`PID_MAX`: 0 would signal hpc's own process group, and a larger
    number is no pid (``os.kill`` raises OverflowError past a C int)."""
    parts = job_id.removeprefix("local-").split("-")
    # [0-9] only: str.isdigit takes any script's digits (١٢٣), and int() reads them.
    if (
        not job_id.startswith("local-")
        or len(parts) > 2
        or not all(re.fullmatch("[0-9]{1,20}", p) for p in parts)
        or not 1 <= int(parts[0]) <= PID_MAX
    ):
        raise UserError(
            f"job: {job_id!r} is not a local job id; allowed: local-PID-START, PID 1 to {PID_MAX}"
        )
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else None


def _marked(pid: int) -> bool:
    """Whether process ``pid`` is one ``hpc run`` started: its environment holds
    :data:`MARK` (``/proc/PID/environ``, the environment it was started or last exec'd
    with, which the script's ``exec`` of the launcher keeps). A leader that has exited
    and waits for ``hpc run`` to reap it (a zombie: no environment to read) while ranks
    of its group live on is asked through those ranks; with none left there is nothing
    a signal could reach. True where there is no ``/proc`` to ask (the pid and start
    checks then stand alone)."""
    if process_state(pid, None) == "Z":
        members = group_members(pid)
        return not members or any(_has_mark(m) for m in members)
    return _has_mark(pid)


def _has_mark(pid: int) -> bool:
    """Whether ``pid`` carries :data:`MARK`: in its environment, or (the shell that
    runs an ``hpc.executor`` job's setup lines, the first of which exports it) as the
    start of its ``sh -c`` script. True where there is no ``/proc`` to ask (the pid and
    start checks then stand alone)."""
    if not os.path.isdir("/proc/self"):
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read(MAX_ENVIRON)
        if any(item.startswith(MARK.encode() + b"=") for item in env.split(b"\0")):
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read(MAX_ENVIRON).split(b"\0")
    except OSError:  # gone, or another user's process: no job of this user's hpc
        return False
    return argv[1:2] == [b"-c"] and argv[2].startswith(f"export {MARK}=".encode())


def _alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    # Without a recorded start time the pid alone proves nothing: treat as gone.
    if start is None or (process_start(pid) or 0) != start:  # 0: no /proc
        return False
    if _leader(pid):  # hpc run's job: its own session
        return _marked(pid)
    # hpc.executor's: the setup shell, then submitit's controller; once the shell has
    # exited (a zombie until submitit reaps it) the job is over.
    return process_state(pid, start) not in (None, "Z") and _has_mark(pid)


def _stop_tree(pid: int, start: int | None) -> None:
    """SIGINT to every marked process of the tree under ``pid``, ranks before their
    controller; what has not ended after :data:`CANCEL_WAIT_S` gets SIGKILL. SIGINT
    alone is not enough: a job started from a background shell, ``nohup`` or a service
    inherits SIGINT ignored (POSIX, for asynchronous lists), and Python then keeps it
    ignored, so submitit's controller and ranks would never see it. Each look adds the
    marked processes that appeared since (a rank started meanwhile), and remembers them
    by start time, so one reparented when its parent died is still reached and a reused
    pid is not."""
    import time

    known: dict[int, int] = {}

    def look() -> list[int]:
        roots = [pid, *known]
        for member in [*reversed(descendants(*roots)), *roots]:  # one read of the table
            started = process_start(member)
            if member not in known and started is not None and _has_mark(member):
                known[member] = started
        return [m for m, t in known.items() if process_state(m, t) not in (None, "Z")]

    if start is not None and process_state(pid, start) is not None:
        known[pid] = start
    for member in look():
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGINT)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while (left := look()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for member in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


#: Bytes of a submitit result pickle read for its first word ("success" or "error"): the
#: word comes right after the protocol and frame opcodes, in the first few dozen bytes.
RESULT_HEAD = 4096


def executor_end_state(run_dir: Path, job_id: str, cancelled: bool) -> JobState:
    """How an ``hpc.executor`` local job that is no longer running ended, from the files
    submitit leaves in its folder (the run directory): each task it started has a
    ``PID_T_log.out``, and each task that returned or raised has a ``PID_T_result.pkl``
    whose tuple starts with ``"success"`` or ``"error"``.

    The pickle is untrusted input, so it is never loaded: :func:`pickletools.genops`
    walks its opcodes (it builds no object and calls nothing) to the first string.
    Every task a success: COMPLETED; any error, or a task that ended with no result (a
    rank killed, say by the OOM killer, or the controller gone before it started them):
    FAILED; ended with no result after ``hpc cancel`` (``cancelled``): CANCELLED.
    UNKNOWN where nothing can be said: no ``/proc`` to tell a running job from an ended
    one while results are missing, or a damaged result."""
    pid, start = _parse(job_id)
    tasks = {
        m.group(1)
        for f in run_dir.glob(f"{pid}_*_log.out")  # a folder gone or unreadable: none
        if (m := re.fullmatch(rf"{pid}_([0-9]{{1,6}})_log\.out", f.name)) is not None
    }
    words = [_result_word(run_dir / f"{pid}_{t}_result.pkl") for t in sorted(tasks)]
    if "error" in words:
        return JobState.FAILED
    if tasks and all(w == "success" for w in words):
        return JobState.COMPLETED
    # An old ``local-PID`` id (no start time) or no /proc: "not running" was a guess.
    if "?" in words or start is None or not os.path.isdir("/proc/self"):
        return JobState.UNKNOWN
    return JobState.CANCELLED if cancelled else JobState.FAILED


def _result_word(path: Path) -> str | None:
    """The first string of a submitit result pickle: ``"success"`` or ``"error"`` for
    one submitit wrote; None when there is no such file; ``"?"`` when it is damaged,
    not a regular file, or starts otherwise (read, never unpickled: :func:`executor_end_state`)."""
    import io
    import pickletools

    from hpc_ddp.files import Missing, NotRegular, open_regular

    try:
        fd, _info = open_regular(path)
    except NotRegular as exc:  # a FIFO, folder or device in its place is damage
        return None if isinstance(exc, Missing) else "?"
    try:
        with os.fdopen(fd, "rb") as fh:
            head = fh.read(RESULT_HEAD)
        for op, arg, _pos in pickletools.genops(io.BytesIO(head)):
            if isinstance(arg, str) and "UNICODE" in op.name:
                return arg if arg in ("success", "error") else "?"
            if op.name not in ("PROTO", "FRAME", "MARK"):
                return "?"
    except (OSError, ValueError, EOFError, KeyError):  # unreadable, truncated, no pickle
        return "?"
    return "?"


def _leader(pid: int) -> bool:
    try:
        return os.getsid(pid) == pid
    except OSError:
        return False


SCHEDULER = Local
