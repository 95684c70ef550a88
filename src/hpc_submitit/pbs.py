"""A submitit plugin for PBS Pro (ALCF Aurora and Polaris, any PBS Pro site).

submitit ships executors for SLURM and this machine only. This module adds the
four pieces a submitit plugin consists of, so that ``hpc.executor(cluster="aurora")``
(and ``submitit.AutoExecutor`` once the ``submitit`` entry points name this module)
pickle a function, run it on the compute nodes and bring its result back:

- ``PBSExecutor``: renders the job script through the same template and cluster
  profile as ``hpc render`` (``#PBS -l select=N:system=..``, ``place``, ``walltime``,
  ``filesystems``, ``-q``, ``-A``, ``-N``, ``-o`` into the job folder) with the launch
  line ``mpiexec -n RANKS --ppn PPN [site flags] python -u -m hpc_submitit.pbs FOLDER``,
  and submits it with ``qsub`` (the job id is the id line qsub prints). Several
  submissions at once (``map_array``) become one PBS job array (``-J 0-N``).
- ``PBSJob`` / ``PBSInfoWatcher``: state from ``qstat -x -f -F json`` (one call for
  all watched jobs), else ``qstat -f`` text, else plain ``qstat``; ``qdel`` cancels.
- ``PBSJobEnvironment``: what a rank knows on the compute node: PBS_JOBID,
  PALS_RANKID / PMI_RANK, PALS_LOCAL_RANKID / PMI_LOCAL_RANK, PMI_SIZE and the
  hosts of PBS_NODEFILE.

Preemption and timeouts. PBS has no ``--signal=USR2@90`` and no ``scontrol requeue``:

- The job script exports ``SUBMITIT_PBS_DEADLINE`` (start + walltime - delay) and
  each rank arms a timer that sends itself the preemption signal (USR2) then; the
  batch shell and ``mpiexec`` ignore that signal (``trap '' USR2``). The timer is the
  only reliable source: ``qsig -s USR2`` (``PBSJob._interrupt``) goes to the job's
  session, where on a real OpenPBS 23.06 server the login shell that PBS runs the
  script from dies of it (PBS then reports the job finished, substate 92, Exit_status
  0) and MPICH hydra's ranks, in sessions of their own, never see it.
- On the signal, rank 0 checkpoints a ``submitit.helpers.Checkpointable`` as submitit
  does, then ``_requeue`` submits a copy of the same script with ``qsub`` (from the
  compute node: ``$PBS_EXEC/bin/qsub`` of ``/etc/pbs.conf``, see ``pbs_client``). The copy
  exports ``SUBMITIT_PBS_JOB_ID`` so the new PBS job reads and writes the files of
  the original submitit job id, and the new PBS id is appended to
  ``FOLDER/<id>_pbs_ids``; ``PBSJob`` follows that file, so ``job.result()`` waits
  for the newest PBS job. Limitation: the new job queues again from the start (no
  priority kept), gets a new PBS id (``qstat``/``qdel`` by hand need that id, see
  ``job.scheduler_id``), and a job array's subjob comes back as a plain job.
- A PBS preemption that kills (SIGTERM, then SIGKILL) is not told apart from ``qdel``
  and is not requeued; a site whose preemption method is ``qrerun`` reruns the job
  under the same id, which restarts the function from its last checkpoint pickle.

Unlike the rest of ``hpc``, this module imports submitit at module level: it *is* a
submitit plugin (its classes derive from submitit's). Only ``hpc.python_api`` (on
first use) and submitit's plugin discovery import it; ``import hpc`` does not.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import typing as tp
import uuid
from pathlib import Path

from submitit.core import core, logger, utils
from submitit.core import job_environment as _job_environment

from hpc.errors import UserError

#: ``qstat`` JSON and text answers for these many seconds at most.
QSTAT_TIMEOUT_S = 60
#: Seconds before the walltime at which the ranks get the preemption signal.
DEFAULT_SIGNAL_DELAY_S = 90
#: State of a job the server no longer knows (finished, no job history kept).
GONE = "FINISHED"

_SUBJOB = re.compile(r"^(?P<seq>\d+)\[(?P<index>\d+)\](?P<rest>.*)$")
_SUBMITIT_ARRAY = re.compile(r"^(?P<parent>\d+\[\](?:\.[^_]*)?)_(?P<index>\d+)$")


# --- reading qstat ------------------------------------------------------------------


def loads_qstat_json(text: str) -> dict[str, tp.Any]:
    """Parse ``qstat -F json`` leniently.

    PBS Pro before 2021 writes job variables into ``Variable_List`` without escaping
    backslashes (``PS1=\\u@\\h``) and with raw control characters, which strict JSON
    refuses; such backslashes are doubled and control characters allowed.
    """
    try:
        return json.loads(text, strict=False)
    except ValueError:
        fixed = re.sub(r'\\(?!["\\/bfnrtu])', r"\\\\", text)
        fixed = re.sub(r"\\u(?![0-9a-fA-F]{4})", r"\\\\u", fixed)
        return json.loads(fixed, strict=False)


def _state(attrs: dict[str, tp.Any]) -> str:
    """Normalized state of one job from its attributes (job_state + Exit_status/substate)."""
    from hpc.schedulers.pbs import normalize

    letter = str(attrs.get("job_state", "")).strip().upper()[:1]
    code = attrs.get("Exit_status")
    try:
        exit_status = None if code is None or str(code).strip() == "" else int(str(code).strip())
    except ValueError:
        exit_status = None
    state = normalize(letter, exit_status, attrs.get("substate"))
    return GONE if state == "UNKNOWN" and letter in ("F", "X") else state


def submitit_id(pbs_id: str, attrs: dict[str, tp.Any] | None = None) -> str:
    """The id submitit uses for a PBS job: a subjob ``123[4].srv`` is ``123[].srv_4``.

    submitit names array tasks ``ARRAY_INDEX`` (``JobPaths`` splits at the first
    ``_``), so the subjob of array ``123[].srv`` with index 4 becomes ``123[].srv_4``.
    """
    match = _SUBJOB.match(pbs_id)
    if match is None:
        return pbs_id
    parent = str((attrs or {}).get("array_id") or f"{match['seq']}[]{match['rest']}")
    return f"{parent}_{match['index']}"


def pbs_id(job_id: str) -> str:
    """The PBS form of a submitit id: ``123[].srv_4`` is subjob ``123[4].srv``."""
    match = _SUBMITIT_ARRAY.match(job_id)
    if match is None:
        return job_id
    seq, rest = match["parent"].split("[]", 1)
    return f"{seq}[{match['index']}]{rest}"


def pbs_query_id(job_id: str) -> str:
    """What to ask qstat for: the array (``123[].srv``) for a subjob id ``123[].srv_4``."""
    match = _SUBMITIT_ARRAY.match(job_id)
    return match["parent"] if match else job_id


def _info(pbs_id: str, attrs: dict[str, tp.Any]) -> dict[str, str]:
    """The few attributes callers use, as strings (submitit's info dicts hold strings)."""
    out = {"JobID": pbs_id, "State": _state(attrs)}
    for key in ("job_state", "substate", "Exit_status", "comment", "exec_host", "queue",
                "Job_Name", "array_id", "array_index"):
        if attrs.get(key) is not None:
            out[key] = str(attrs[key])
    return out


def read_qstat_json(text: str | bytes) -> dict[str, dict[str, str]]:
    """Info per job from ``qstat -x -f -F json [-t]``, keyed by PBS id and submitit id."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    data = loads_qstat_json(text)
    jobs = data.get("Jobs") or {}
    if not isinstance(jobs, dict):
        raise ValueError("qstat JSON: 'Jobs' is not a mapping")
    out: dict[str, dict[str, str]] = {}
    for pbs_id, attrs in jobs.items():
        if isinstance(attrs, dict):
            info = _info(str(pbs_id), attrs)
            out[str(pbs_id)] = info
            out[submitit_id(str(pbs_id), attrs)] = info
    return out


def _join_continuations(text: str) -> list[str]:
    """``qstat -f`` wraps long values onto lines that start with a tab: join them back."""
    lines: list[str] = []
    for raw in text.splitlines():
        if raw.startswith("\t") and lines:
            lines[-1] += raw[1:]
        else:
            lines.append(raw)
    return lines


def read_qstat_text(text: str) -> dict[str, dict[str, str]]:
    """Info per job from ``qstat -f`` (blocks of ``Job Id: ID`` and ``    key = value``)."""
    out: dict[str, dict[str, str]] = {}
    pbs_id: str | None = None
    attrs: dict[str, str] = {}

    def flush() -> None:
        if pbs_id is not None:
            info = _info(pbs_id, attrs)
            out[pbs_id] = info
            out[submitit_id(pbs_id, attrs)] = info

    for line in _join_continuations(text):
        if line.startswith("Job Id:"):
            flush()
            pbs_id, attrs = line.split(":", 1)[1].strip(), {}
        elif pbs_id is not None and " = " in line:
            key, value = line.strip().split(" = ", 1)
            attrs[key.strip()] = value.strip()
    flush()
    return out


def read_qstat_plain(text: str) -> dict[str, dict[str, str]]:
    """Info per job from plain ``qstat`` (a table; the S column is the state letter).

    Long ids are cut to the column width and end in ``*``; they are kept as the
    prefix they are, and matched by sequence number.
    """
    from hpc.schedulers.pbs import normalize

    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) < 6 or not words[0][:1].isdigit():
            continue
        pbs_id, letter = words[0].rstrip("*"), words[-2]
        state = normalize(letter) if letter not in ("F", "X") else GONE
        info = {"JobID": pbs_id, "State": state, "job_state": letter, "queue": words[-1]}
        out[pbs_id] = info
        out[submitit_id(pbs_id)] = info
    return out


def _seq(job_id: str) -> str:
    """The sequence number part of an id: ``123`` of ``123.srv``, ``123[4].srv`` or ``123[].srv_4``."""
    match = re.match(r"^\d+", job_id)
    return match.group(0) if match else job_id


def _index(job_id: str) -> str | None:
    """The array index in a subjob id (``123[4].srv``) or a submitit array id (``123[].srv_4``)."""
    match = _SUBMITIT_ARRAY.match(job_id) or _SUBJOB.match(job_id)
    return match["index"] if match else None


def lookup(info: dict[str, dict[str, str]], job_id: str) -> dict[str, str] | None:
    """The entry for ``job_id``: exact, else the same sequence number and array index
    (qstat may print another form of the server name than qsub did, or cut the id)."""
    if job_id in info:
        return info[job_id]
    for key, value in info.items():
        if _seq(key) == _seq(job_id) and _index(key) == _index(job_id):
            return value
    return None


def _run(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    """Run a PBS client; None when it is missing or hangs (the caller falls back)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=QSTAT_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _gone(stderr: str, ids: tp.Iterable[str]) -> set[str]:
    """Ids qstat says it does not know (any more), from its error lines."""
    gone = set()
    for line in stderr.splitlines():
        if "Unknown Job Id" in line or "has finished" in line:
            for job_id in ids:
                if re.search(rf"(^|\D){re.escape(_seq(job_id))}(\D|$)", line):
                    gone.add(job_id)
    return gone


def query(job_ids: tp.Iterable[str]) -> dict[str, dict[str, str]]:
    """States of ``job_ids`` (PBS or submitit ids) with the fallbacks a site may need.

    1. ``qstat -x -f -F json [-t] IDS``: PBS Pro 19+ with job history.
    2. ``qstat -x -f IDS``, then ``qstat -f IDS``: servers without ``-F json`` (older
       PBS Pro; Torque, whose ``-x`` means XML and yields no ``Job Id:`` blocks).
    3. ``qstat IDS``: anything with a qstat at all.

    qstat exits non-zero when one id is unknown but still prints the others, so the
    output is read whatever the exit code; ids it calls unknown or finished (no
    history kept) get the state ``FINISHED``: done, outcome only in the job's files.
    An answer that names none of the ids moves on to the next form.
    """
    ids = list(dict.fromkeys(job_ids))
    query_ids = list(dict.fromkeys(pbs_query_id(j) for j in ids))
    arrays = ["-t"] if any("[" in q for q in query_ids) else []
    attempts: list[tuple[list[str], tp.Callable[[str], dict[str, dict[str, str]]]]] = [
        (["qstat", "-x", "-f", "-F", "json", *arrays, *query_ids], read_qstat_json),
        (["qstat", "-x", "-f", *arrays, *query_ids], read_qstat_text),
        (["qstat", "-f", *arrays, *query_ids], read_qstat_text),
        (["qstat", *arrays, *query_ids], read_qstat_plain),
    ]
    for argv, reader in attempts:
        proc = _run(argv)
        if proc is None:
            break
        try:
            info = reader(proc.stdout) if proc.stdout.strip() else {}
        except (ValueError, AttributeError, TypeError):
            continue
        gone = _gone(proc.stderr, ids)
        out: dict[str, dict[str, str]] = {}
        for job_id in ids:
            found = lookup(info, job_id)
            if found is not None:
                out[job_id] = found
            elif job_id in gone:
                out[job_id] = {"JobID": job_id, "State": GONE}
        if out:
            return out
    return {}


class PBSInfoWatcher(core.InfoWatcher):
    """One qstat call for every watched job, at growing intervals (submitit's schedule)."""

    def _make_command(self) -> list[str] | None:
        to_check = sorted({pbs_query_id(j) for j in self._registered - self._finished})
        if not to_check:
            return None
        arrays = ["-t"] if any("[" in j for j in to_check) else []
        return ["qstat", "-x", "-f", "-F", "json", *arrays, *to_check]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        """Parse ``qstat -x -f -F json`` output (submitit's hook for its own update)."""
        return read_qstat_json(string)

    def update(self) -> None:
        """Query all unfinished jobs through :func:`query` (JSON, then text, then plain)."""
        to_check = sorted(self._registered - self._finished)
        if not to_check:
            return
        self._num_calls += 1
        logger.get_logger().debug(f"Call #{self.num_calls} - qstat for {' '.join(to_check)}")
        self._info_dict.update(query(to_check))
        self._last_status_check = time.time()
        for job_id in to_check:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        """Normalized state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ..."""
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"


# --- the job, seen from the submitting side -----------------------------------------


def _ids_file(folder: Path, job_id: str) -> Path:
    """Where the PBS ids of a requeued submitit job are appended, one per line."""
    return folder / f"{job_id}_pbs_ids"


class PBSJob(core.Job[core.R]):
    """A submitted PBS job; follows the job across requeues (see the module docstring)."""

    _cancel_command = "qdel"
    watcher = PBSInfoWatcher(delay_s=60)

    @property
    def scheduler_id(self) -> str:
        """The PBS id of the newest incarnation of this job (the submitted one unless requeued)."""
        try:
            ids = _ids_file(self.paths.folder, self.job_id).read_text().split()
        except OSError:
            return self.job_id
        return ids[-1] if ids else self.job_id

    def done(self, force_check: bool = False) -> bool:
        """Result pickle present, or PBS says the newest incarnation has ended."""
        if self._sub_jobs:
            return all(sub.done(force_check) for sub in self._sub_jobs)
        folder = self.paths.folder
        try:  # refresh an NFS attribute cache, as submitit does
            folder.chmod(folder.stat().st_mode)
        except OSError:
            pass
        if self.paths.result_pickle.exists():
            return True
        return self.watcher.is_done(self.scheduler_id, mode="force" if force_check else "standard")

    @property
    def state(self) -> str:
        """Normalized state of the newest incarnation (no forced qstat call)."""
        return self.watcher.get_state(self.scheduler_id, mode="standard")

    def get_info(self, mode: str = "force") -> dict[str, str]:
        """qstat's view of the newest incarnation."""
        return self.watcher.get_info(self.scheduler_id, mode=mode)

    def cancel(self, check: bool = True) -> None:
        """``qdel`` the newest incarnation (``check``: raise when qdel fails)."""
        argv = ["qdel", self.scheduler_id]
        (subprocess.check_call if check else subprocess.call)(argv, shell=False)

    def _interrupt(self, timeout: bool = False) -> None:
        """Send the preemption signal to the job's processes, as ``qsig -s USR2``.

        ``timeout`` is accepted for submitit's signature; on PBS the ranks tell a
        timeout from a preemption by the time they have run (submitit's rule). Caution:
        on the real server this ends the job instead (see the module docstring); the
        tests preempt through the ranks' timer and ``qrerun``.
        """
        sig = "SIG" + PBSJobEnvironment.USR_SIG
        subprocess.check_call(["qsig", "-s", sig, self.scheduler_id])


# --- the job, seen from a rank on the compute node ----------------------------------


def _first_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


class PBSJobEnvironment(_job_environment.JobEnvironment):
    """Rank, size and hosts of a PBS job started by PALS (Aurora) or MPICH hydra."""

    _env: tp.ClassVar[dict[str, str]] = {
        "job_id": "PBS_JOBID",
        "array_job_id": "PBS_ARRAY_ID",
        "array_task_id": "PBS_ARRAY_INDEX",
        "num_tasks": "PMI_SIZE",
        "global_rank": "PALS_RANKID",
        "local_rank": "PALS_LOCAL_RANKID",
        "node": "PALS_NODEID",
        "num_nodes": "PBS_NODEFILE",
    }

    @property
    def job_id(self) -> str:
        """The submitit id: kept across requeues (SUBMITIT_PBS_JOB_ID), ``ARRAY_INDEX`` in arrays."""
        return os.environ.get("SUBMITIT_PBS_JOB_ID") or super().job_id

    @property
    def global_rank(self) -> int:
        return _first_int("PALS_RANKID", "PMI_RANK") or 0

    @property
    def local_rank(self) -> int:
        return _first_int("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID") or 0

    @property
    def num_tasks(self) -> int:
        return _first_int("PMI_SIZE", "PALS_SIZE") or 1

    @property
    def hostnames(self) -> list[str]:
        """Hosts of PBS_NODEFILE in order, each once (it has one line per MPI slot)."""
        path = os.environ.get("PBS_NODEFILE")
        if not path:
            return [self.hostname]
        try:
            lines = Path(path).read_text().split()
        except OSError:
            return [self.hostname]
        return list(dict.fromkeys(lines)) or [self.hostname]

    @property
    def num_nodes(self) -> int:
        return len(self.hostnames)

    @property
    def node(self) -> int:
        found = _first_int("PALS_NODEID")
        if found is not None:
            return found
        per_node = -(-self.num_tasks // max(1, self.num_nodes))
        return self.global_rank // max(1, per_node)

    def _handle_signals(self, paths: utils.JobPaths, submission: utils.DelayedSubmission) -> None:
        """submitit's handlers, plus a timer for the pre-walltime signal PBS does not send."""
        super()._handle_signals(paths, submission)
        deadline = os.environ.get("SUBMITIT_PBS_DEADLINE", "").strip()
        if deadline.isdigit():
            delay = max(0.0, int(deadline) - time.time())
            timer = threading.Timer(delay, os.kill, (os.getpid(), self._usr_sig()))
            timer.daemon = True
            timer.start()
            logger.get_logger().info(f"Preemption signal {self.USR_SIG} armed in {delay:.0f} s")

    def _requeue(self, countdown: int) -> None:
        """Submit a copy of this job's script (PBS has no requeue command for a running job)."""
        folder = Path(os.environ["SUBMITIT_FOLDER"])
        job_id = self.job_id
        paths = utils.JobPaths(folder, job_id=job_id)
        text = requeue_script(paths.submission_file.read_text(), job_id)
        script = paths.folder / f"{job_id}_requeue.pbs"
        script.write_text(text)
        workdir = os.environ.get("PBS_O_WORKDIR") or None
        out = subprocess.run([pbs_client("qsub"), str(script)], capture_output=True, text=True, cwd=workdir,
                             timeout=QSTAT_TIMEOUT_S, check=True).stdout
        from hpc.schedulers.pbs import PBS

        new_id = PBS().parse_job_id(out)
        with _ids_file(paths.folder, job_id).open("a") as fh:
            fh.write(new_id + "\n")
        logger.get_logger().info(
            f"Requeued job {job_id} as PBS job {new_id} ({countdown} remaining timeouts)"
        )


def pbs_client(name: str, conf: str | None = None) -> str:
    """The PBS client ``name``: ``$PBS_EXEC/bin/name`` from ``/etc/pbs.conf``, else PATH's.

    Why not PATH first: a job's PATH is its login shell's. A PBS install keeps its
    clients in ``$PBS_EXEC/bin`` (``/opt/pbs/bin``), which only a site's login profile
    adds, and another ``qsub`` may come first (Debian's ``slurm-wlm-torque`` installs
    ``/usr/bin/qsub``, a wrapper over sbatch). Both happened on the real test server: a
    rank requeueing its job ran the SLURM wrapper. Every PBS host has ``/etc/pbs.conf``
    (or ``$PBS_CONF_FILE``) naming ``PBS_EXEC``; without one, PATH decides.
    """
    path = Path(conf or os.environ.get("PBS_CONF_FILE") or "/etc/pbs.conf")
    try:
        match = re.search(r"^\s*PBS_EXEC\s*=\s*(\S+)", path.read_text(), re.M)
    except OSError:
        match = None
    if match and os.access(os.path.join(match.group(1), "bin", name), os.X_OK):
        return os.path.join(match.group(1), "bin", name)
    return shutil.which(name) or name


def requeue_script(text: str, job_id: str) -> str:
    """The job script for a resubmission: no ``#PBS -J`` (one subjob comes back alone),
    and ``SUBMITIT_PBS_JOB_ID`` exported so the new job uses the original job's files.

    The export goes after the directive block: PBS stops reading ``#PBS`` lines at the
    first command.
    """
    lines = [ln for ln in text.splitlines() if not re.match(r"^#PBS\s+-J\b", ln)]
    at = next(
        (i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")),
        len(lines),
    )
    export = f"export SUBMITIT_PBS_JOB_ID={shlex.quote(job_id)}  # requeued by submitit"
    return "\n".join([*lines[:at], export, *lines[at:]]) + "\n"


# --- the executor -------------------------------------------------------------------

#: JobSpec keys a PBSExecutor takes as parameters (the command and logs are its own).
SPEC_PARAMETERS = (
    "name", "nodes", "ppn", "walltime", "queue", "account", "env", "modules", "setup",
    "python", "signal", "requeue", "directives", "launcher", "gpus_per_node",
    "cpus_per_task", "filesystems",
)


class PBSExecutor(core.PicklingExecutor):
    """PBS Pro executor: pickles calls, renders and qsubs a job script per submission.

    ``cluster`` names a profile (``hpc clusters``: aurora, polaris, pbs, ...) whose site
    facts (system, place, filesystems, queues and their limits, launcher flags,
    modules, environment) fill the script; parameters are the job spec's keys
    (``nodes``, ``ppn``, ``walltime``, ``queue``, ``account``, ``env``, ...), checked
    exactly as ``hpc render`` checks them. submitit's generic names work too
    (``timeout_min``, ``tasks_per_node``, ``gpus_per_node``, ``cpus_per_task``).
    ``python`` is the interpreter command on the compute nodes (default: this one).
    """

    job_class = PBSJob

    def __init__(
        self,
        folder: str | Path,
        max_num_timeout: int = 3,
        max_pickle_size_gb: float = 1.0,
        python: str | None = None,
        cluster: str = "pbs",
    ) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout,
                         max_pickle_size_gb=max_pickle_size_gb)
        self.python = python if python is not None else shlex.quote(sys.executable)
        self.parameters = {"cluster": cluster}
        self._array_size: int | None = None

    @classmethod
    def _equivalence_dict(cls) -> core.EquivalenceDict:
        return {
            "name": "name", "timeout_min": "timeout_min", "mem_gb": "mem_gb", "nodes": "nodes",
            "cpus_per_task": "cpus_per_task", "gpus_per_node": "gpus_per_node",
            "tasks_per_node": "ppn",
        }

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return {*SPEC_PARAMETERS, "cluster", "timeout_min", "signal_delay_s", "tasks_per_node"}

    @classmethod
    def affinity(cls) -> int:
        """Available with qsub on PATH; ranked below SLURM where sbatch exists too
        (SLURM's ``slurm-wlm-torque`` installs a qsub wrapper)."""
        if shutil.which("qsub") is None:
            return -1
        return 1 if shutil.which("sbatch") else 2

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        """Check the new parameters by resolving the job (same checks as ``hpc render``)."""
        from hpc._util import check_keys

        check_keys(kwargs, sorted(self._valid_parameters()), "PBSExecutor parameters")
        if "mem_gb" in kwargs:
            raise UserError("mem_gb: PBS memory requests are not in the job template; "
                            "allowed: leave it out (nodes are allocated whole)")
        if "tasks_per_node" in kwargs:
            kwargs["ppn"] = kwargs.pop("tasks_per_node")
        if "timeout_min" in kwargs:
            kwargs["walltime"] = max(60, int(round(float(kwargs.pop("timeout_min")) * 60)))
        merged = {**self.parameters, **kwargs}
        self.resolve(merged)
        self.parameters = merged

    def _command(self) -> list[str]:
        return [*shlex.split(self.python), "-u", "-m", "hpc_submitit.pbs", str(self.folder)]

    def resolve(self, parameters: dict[str, tp.Any] | None = None) -> tp.Any:
        """The ``hpc.spec.Job`` these parameters describe, with the submitit lines added."""
        from hpc.cli import build_job

        params = dict(self.parameters if parameters is None else parameters)
        cluster = params.pop("cluster")
        delay = params.pop("signal_delay_s", None)
        if params.get("name") is None:
            params["name"] = "submitit"
        env = dict(params.pop("env", None) or {})
        overrides = {
            **params, "cluster": cluster, "command": self._command(),
            "output_dir": str(self.folder), "wrap": "never",
            "env": {**env, "SUBMITIT_EXECUTOR": "pbs"},
        }
        if self._array_size is not None:
            directives = list(overrides.get("directives") or [])
            overrides["directives"] = [*directives, f"-J 0-{self._array_size - 1}"]
        job = build_job(None, overrides)
        if job.launcher != "mpiexec":
            raise UserError(f"launcher: {job.launcher!r} cannot start submitit ranks on PBS; "
                            "allowed: auto, mpiexec")
        sig, sig_delay = signal_of(job.spec.signal, delay)
        lines = [
            "# submitit: the ranks take the preemption signal; this shell and mpiexec ignore it",
            f"trap '' {sig}",
            f"export SUBMITIT_PREEMPT_SIGNAL={sig}",
        ]
        if job.walltime > sig_delay:
            lines.append(f"export SUBMITIT_PBS_DEADLINE=$(( $(date +%s) + {job.walltime - sig_delay} ))")
        job.spec.setup = [*job.spec.setup, *lines]
        job.spec.source = "hpc.executor (submitit PBS plugin)"
        return job

    def _num_tasks(self) -> int:
        return int(self.resolve().ranks)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        from hpc.render import render

        return render(self.resolve())

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["qsub", str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        from hpc.schedulers.pbs import PBS

        return PBS().parse_job_id(string.decode() if isinstance(string, bytes) else string)

    @property
    def _submitit_command_str(self) -> str:
        return shlex.join(self._command())

    def _submit_command(self, command: str) -> core.Job[tp.Any]:
        """Write the script, qsub it, and return the job (a refusal is one clear line)."""
        from hpc.schedulers import SchedulerError, last_line, run

        uid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f".submission_file_{uid}.pbs"
        path.write_text(self._make_submission_file_text(command, uid))
        proc = run(self._make_submission_command(path))
        if proc.returncode != 0:
            raise SchedulerError(f"qsub refused the job (exit {proc.returncode}): "
                                 f"{last_line(proc.stderr or proc.stdout)}")
        job_id = self._get_job_id_from_submission_command(proc.stdout)
        job: core.Job[tp.Any] = self.job_class(folder=self.folder, job_id=job_id,
                                               tasks=list(range(self._num_tasks())))
        job.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
        return job

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        """One submission: one PBS job. Several: one PBS job array, ``-J 0-(N-1)``."""
        job = self.resolve()
        timeout_min = job.walltime / 60
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(timeout_min, self.max_num_timeout)  # type: ignore[arg-type]
            delayed.dump(path)
            pickles.append(path)
        size = sum(p.stat().st_size for p in pickles) / 1024**3
        if size > self.max_pickle_size_gb:
            for p in pickles:
                p.unlink()
            raise RuntimeError(f"Submitting {size:.2f} GB of pickled functions and arguments "
                               f"> max_pickle_size_gb={self.max_pickle_size_gb}")
        self._throttle()
        self._last_job_submitted = time.time()
        if len(delayed_submissions) == 1:
            first = self._submit_command(self._submitit_command_str)
            first.paths.move_temporary_file(pickles[0], "submitted_pickle")
            return [first]
        self._array_size = len(delayed_submissions)
        try:
            first = self._submit_command(self._submitit_command_str)
        finally:
            self._array_size = None
        tasks = list(range(first.num_tasks))
        jobs: list[core.Job[tp.Any]] = [
            PBSJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=tasks)
            for i in range(len(delayed_submissions))
        ]
        for sub, path in zip(jobs, pickles, strict=True):
            sub.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


def signal_of(spec_signal: str | None, delay: int | None = None) -> tuple[str, int]:
    """(signal name, seconds before the walltime) from a spec's ``signal: [SIG]NAME[@S]``.

    submitit's handler runs in the ranks, so ``B:`` (batch shell only) is refused.
    """
    name, seconds = _job_environment.JobEnvironment.USR_SIG, DEFAULT_SIGNAL_DELAY_S
    if spec_signal:
        text = spec_signal
        if ":" in text:
            raise UserError(f"signal: {spec_signal!r}: submitit handles the signal in every rank; "
                            "allowed: NAME[@SECONDS] without a B:/R: prefix, e.g. USR2@90")
        text, _, at = text.partition("@")
        name = text.removeprefix("SIG")
        if not hasattr(signal, "SIG" + name):
            raise UserError(f"signal: {spec_signal!r} names no signal; allowed: e.g. USR2@90")
        if at:
            seconds = int(at)
    if delay is not None:
        seconds = int(delay)
    return name, seconds


# --- the entry point on the compute node --------------------------------------------


def _ensure_registered() -> None:
    """Make submitit find PBSJobEnvironment even before the entry points are installed."""
    from submitit.core import plugins

    if "pbs" in plugins.get_job_environments():
        return
    plugins._get_plugins()[1].append(PBSJobEnvironment())
    plugins.get_job_environments.cache_clear()


def _redirect(stdout: Path, stderr: Path) -> None:
    """Each rank writes its own ``%j_%t_log.out/err``, as srun --output does on SLURM."""
    stdout.parent.mkdir(parents=True, exist_ok=True)
    for path, fd in ((stdout, 1), (stderr, 2)):
        sys.stdout.flush()
        sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


def main(argv: list[str] | None = None) -> None:
    """``python -m hpc_submitit.pbs FOLDER``: one rank of a submitit PBS job."""
    from submitit.core.submission import process_job

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m hpc_submitit.pbs FOLDER")
    os.environ.setdefault("SUBMITIT_EXECUTOR", "pbs")
    _ensure_registered()
    env = PBSJobEnvironment()
    paths = utils.JobPaths(args[0], job_id=env.job_id, task_id=env.global_rank)
    _redirect(paths.stdout, paths.stderr)
    process_job(args[0])


#: What submitit's plugin discovery reads (entry points ``executor`` and ``job_environment``).
executor = PBSExecutor
job_environment = PBSJobEnvironment

if __name__ == "__main__":
    # Run the importable module's main, so its classes are the ones submitit registers.
    from hpc_submitit.pbs import main as _main

    _main()
