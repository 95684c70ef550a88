"""SLURM's requeue after a preemption checkpoint: ``scontrol requeue`` of this job or
array task, or, when SLURM refuses, the next segment submitted with
``sbatch --dependency=afterany`` (a PBS job's rerun belongs to the PBS job environment,
not here).

Split from :mod:`ddp.preemption` (the signals, the vote and the exit), which calls
:func:`requeue` from rank 0 and re-exports these names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping

log = logging.getLogger("ddp")


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id that names this job alone: ``${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}``
    in an array task, else ``SLURM_JOB_ID`` (None outside SLURM).

    An array task's ``SLURM_JOB_ID`` may be the array's own id (SLURM gives it to one of
    the tasks: on SLURM 22.05 the last task started): ``scontrol requeue`` of it requeues
    every task of the array, killing the others mid-run (Lightning #15022)."""
    env = os.environ if environ is None else environ
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env.get("SLURM_JOB_ID") or None


def requeue(enabled: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """Rank 0, after the preemption checkpoint: requeue this SLURM job (or array task).

    ``enabled`` is ``preemption.requeue``; ``DDP_REQUEUE=1`` (exported by ``hpc render``
    for a spec with ``requeue: true``) turns it on too. Outside SLURM it does nothing.

    First ``scontrol requeue ID`` (ID from :func:`slurm_job_id`). When SLURM refuses
    (a job submitted with ``--no-requeue``, ``JobRequeue=0``, a job the preemption is
    already cancelling under ``PreemptMode=CANCEL``, where it would never come back), the
    next segment is submitted instead (:func:`submit_next_segment`): the same batch script
    into the same working directory and log, after this job ends, so it resumes from the
    run's checkpoints. Returns the path taken (``"requeue"``, ``"sbatch"``) or None; the
    log says which, and a fallback that fails too is one error line naming both failures.
    """
    env = os.environ if environ is None else environ
    job = slurm_job_id(env)
    if not (enabled or env.get("DDP_REQUEUE") == "1") or not job:
        return None
    why = _client(["scontrol", "requeue", job], env)
    if why is None:
        log.warning("requeued SLURM job %s (scontrol requeue)", job)
        return "requeue"
    if why.startswith(_NO_ANSWER):  # it may still requeue: a second segment would run twice
        log.error(
            "scontrol requeue %s: %s; not submitting another segment (the controller "
            "may still requeue the job): check `squeue -j %s`",
            job,
            why,
            job,
        )
        return None
    log.warning("scontrol requeue %s failed (%s); submitting the next segment instead", job, why)
    try:
        new = submit_next_segment(job, env)
    except _SegmentError as exc:
        log.error(
            "SLURM job %s was not requeued: scontrol requeue failed (%s) and the next "
            "segment could not be submitted (%s); resubmit it by hand",
            job,
            why,
            exc,
        )
        return None
    log.warning(
        "submitted the next segment of SLURM job %s as job %s (sbatch "
        "--dependency=afterany:%s, same script, directory and log)",
        job,
        new,
        job,
    )
    return "sbatch"


class _SegmentError(Exception):
    """The next segment could not be submitted (the message says why)."""


CLIENT_TIMEOUT_S = 20.0
"""Seconds a SLURM client may take (a controller that does not answer): the requeue and
its fallback run between the preemption signal and SLURM's SIGKILL (KillWait, 30 s by
default) and within ``preemption.grace_s``; a slow controller ends the wait, not the job."""


#: Variables that describe this job's ranks, not the job: the launcher sets them per task
#: (srun, torchrun, PMI/PALS/Open MPI). The next segment's batch script inherits sbatch's
#: environment, and a stale RANK or MASTER_ADDR there would reach every new rank.
_PER_TASK = ("SLURM_", "SLURMD_", "PMI_", "PMIX_", "OMPI_", "PALS_", "TORCHELASTIC_")


_PER_TASK_NAMES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "ZE_AFFINITY_MASK",
    }
)


_NO_ANSWER = "no answer"


def _run(argv: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """A SLURM client, its output captured as text, bounded by :data:`CLIENT_TIMEOUT_S`
    (a hung slurmctld must not hang the job that asks it); raises what ``run`` raises."""
    return subprocess.run(
        argv,
        env=dict(env),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=CLIENT_TIMEOUT_S,
    )


def _last_line(text: str, default: str) -> str:
    """A client's last output line, cut to 300 characters, for a one-line error."""
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else default


def _client(argv: list[str], env: Mapping[str, str]) -> str | None:
    """Run a SLURM client; None on success, else why it failed (its stderr's last line;
    a timeout starts with :data:`_NO_ANSWER`: the request may still be carried out)."""
    try:
        proc = _run(argv, env)
    except subprocess.TimeoutExpired:
        return f"{_NO_ANSWER} within {CLIENT_TIMEOUT_S:g} s"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{argv[0]}: {exc}"
    if proc.returncode == 0:
        return None
    return f"exit {proc.returncode}: {_last_line(proc.stderr or proc.stdout, 'no message')}"


def _job_fields(job: str, env: Mapping[str, str]) -> dict[str, str]:
    """``scontrol show job -o ID`` as a dict (one line, ``Key=Value`` words; values
    without spaces except the last keys, which this code does not read)."""
    try:
        proc = _run(["scontrol", "show", "job", "-o", job], env)
    except (OSError, subprocess.SubprocessError) as exc:
        raise _SegmentError(f"scontrol show job {job}: {exc}") from None
    if proc.returncode != 0:
        why = _last_line(proc.stderr or proc.stdout, "no message")
        raise _SegmentError(f"scontrol show job {job}: {why}")
    fields: dict[str, str] = {}
    for word in proc.stdout.split():
        key, eq, value = word.partition("=")
        if eq and key not in fields:
            fields[key] = value
    return fields


def submit_next_segment(job: str, environ: Mapping[str, str] | None = None) -> str:
    """``sbatch --dependency=afterany:JOB`` of JOB's own batch script: its id.

    The script is the copy SLURM stored (``scontrol write batch_script``), so an edited
    or removed file on disk does not change what runs. What the first sbatch may have
    had on its command line is given again from ``scontrol show job``: the job's name,
    partition, account, QOS, time limit and working directory, and its log, appended to
    (``--open-mode=append``). An array task submits that one task (``--array=T``), never
    the whole array again. ``afterany`` starts it once this job has ended in any state.
    """
    env = dict(os.environ if environ is None else environ)
    fields = _job_fields(job, env)
    clean = {
        k: v
        for k, v in env.items()
        if k == "SLURM_CONF" or not (k.startswith(_PER_TASK) or k in _PER_TASK_NAMES)
    }
    fd, script = tempfile.mkstemp(prefix="ddp-segment-", suffix=".sh")
    os.close(fd)
    try:
        why = _client(["scontrol", "write", "batch_script", job, script], env)
        if why is not None or not os.path.getsize(script):
            raise _SegmentError(f"scontrol write batch_script {job}: {why or 'empty script'}")
        argv = _sbatch_argv(job, fields, script)
        try:
            proc = _run(argv, clean)
        except (OSError, subprocess.SubprocessError) as exc:
            raise _SegmentError(f"sbatch: {exc}") from None
        new = proc.stdout.strip().split(";")[0]
        if proc.returncode != 0 or not new:
            why = _last_line(proc.stderr, "no job id")
            raise _SegmentError(f"sbatch exit {proc.returncode}: {why}")
        return new
    finally:
        with contextlib.suppress(OSError):
            os.unlink(script)  # sbatch keeps its own copy


def _sbatch_argv(job: str, fields: dict[str, str], script: str) -> list[str]:
    """The next segment's sbatch command: after JOB ends, appending to its log, with
    what the first sbatch may have had on its command line (``scontrol show job``'s
    fields); an array task submits that task alone."""
    argv = ["sbatch", "--parsable", f"--dependency=afterany:{job}", "--open-mode=append"]
    for key, flag in (
        ("JobName", "--job-name"),
        ("Partition", "--partition"),
        ("Account", "--account"),
        ("QOS", "--qos"),
        ("TimeLimit", "--time"),
        ("WorkDir", "--chdir"),
        ("StdOut", "--output"),
        ("StdErr", "--error"),
    ):
        value = fields.get(key, "")
        if value and value not in ("(null)", "UNLIMITED", "Partition_Limit", "N/A"):
            if key in ("StdOut", "StdErr"):
                value = value.replace("%", "%%")  # the file as it is, no pattern
            argv.append(f"{flag}={value}")
    if "_" in job:
        argv.append(f"--array={job.rsplit('_', 1)[1]}")
    argv.append(script)
    return argv
