"""The PBS job seen from a rank on the compute node: submitit's job environment for PBS.

Rank, size and hosts come from PALS (Aurora, Polaris) or MPICH hydra; the requeue
that PBS has no command for (``scontrol requeue`` on SLURM) is a fresh ``qsub`` of
the same script, followed by ``PBSJob`` through the ids file.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import threading
import time
import typing as tp
from pathlib import Path

from submitit.core import job_environment as _job_environment
from submitit.core import logger, utils

from hpc.errors import SchedulerError
from hpc.schedulers.pbs import QSTAT_TIMEOUT_S


def ids_file(folder: Path, job_id: str) -> Path:
    """Where the PBS ids of a requeued submitit job are appended, one per line."""
    return folder / f"{job_id}_pbs_ids"


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
        qsub = pbs_client("qsub")
        from hpc.schedulers import last_line, run
        from hpc.schedulers.pbs import PBS

        proc = run([qsub, str(script)], timeout=QSTAT_TIMEOUT_S, cwd=workdir)  # decodes once

        if proc.returncode != 0:
            raise SchedulerError(
                f"requeue: {qsub} refused {script} (exit {proc.returncode}): "
                f"{last_line(proc.stderr or proc.stdout)}"
            )
        new_id = PBS().parse_job_id(proc.stdout)
        with ids_file(paths.folder, job_id).open("a") as fh:
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
