"""PBS Pro: qsub scripts, ranks started by mpiexec (PALS or hydra), and the one PBS client.

The :class:`PBS` scheduler lives here; the client it asks lives in
:mod:`hpc.schedulers._pbs_qstat` (qstat's answers read into states, job ids in PBS's
and submitit's forms, the server's ``max_array_size``) and
:mod:`hpc.schedulers._pbs_json` (``qstat -F json`` read leniently as it streams). The
client's public names are re-exported here: ``hpc.schedulers.pbs.query`` is what both
``hpc status`` and the submitit PBS executor (``hpc.executors.pbs``) ask, so the two
never disagree on a job.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hpc.schedulers import JobState, Scheduler, SchedulerError, last_line, run
from hpc.schedulers._pbs_json import loads_qstat_json
from hpc.schedulers._pbs_qstat import (
    _JOB_ID,
    DEFAULT_MAX_ARRAY_SIZE,
    GONE,
    QSTAT_TIMEOUT_S,
    QstatInfo,
    job_key,
    lookup,
    normalize,
    parse_max_array_size,
    parse_qstat_json,
    parse_qstat_text,
    pbs_id,
    pbs_query_id,
    query,
    read_qstat_json,
    read_qstat_plain,
    read_qstat_text,
    state_of,
    submitit_id,
)

if TYPE_CHECKING:
    from hpc.chain import After
    from hpc.job import Job
    from hpc.stage import Stage

__all__ = [
    "DEFAULT_MAX_ARRAY_SIZE",
    "GONE",
    "PBS",
    "QSTAT_TIMEOUT_S",
    "SCHEDULER",
    "QstatInfo",
    "job_key",
    "loads_qstat_json",
    "lookup",
    "normalize",
    "parse_max_array_size",
    "parse_qstat_json",
    "parse_qstat_text",
    "pbs_id",
    "pbs_query_id",
    "query",
    "read_qstat_json",
    "read_qstat_plain",
    "read_qstat_text",
    "state_of",
    "submitit_id",
]


class PBS(Scheduler):
    """PBS Pro: qsub scripts with ``#PBS`` directives; ranks started by mpiexec."""

    name = "pbs"
    script_suffix = ".pbs"
    default_launcher = "mpiexec"
    array_min_size = 2  # "qsub: illegal -J value" for -J 0-0 (hpc.sweep.split)
    supervised_launchers = ("mpiexec",)  # a rewritten host file per relaunch
    queue_directives = ("queue",)
    client = "qstat"
    detect_order = 20
    array_index_var = "PBS_ARRAY_INDEX"
    # `-J 0-9%2` sets max_run_subjobs: seen accepted by OpenPBS 23.06 (the test server);
    # older PBS Pro releases reject the suffix (unverified for ALCF's PBS Pro version).
    array_throttle = True
    # `-o DIR/` (a folder): JOBID.OU (subjobs 123[4].server.OU); without -o, PBS writes
    # NAME.oJOBNUM in the submit folder.
    log_patterns = (
        r"(?P<job>[0-9]+(?:\[[0-9]*\])?(?:\.[A-Za-z0-9_.-]+?)?)\.OU",
        r"(?P<name>.+)\.o(?P<job>[0-9]+(?:\.[0-9]+)?)",
    )
    id_examples = "123.server, 123[3].server"
    job_id_var = "PBS_JOBID"
    # A sweep wider than the server's max_array_size is several arrays (issue 32): qsub
    # passes a script no arguments, so each part's offset travels as a variable (qsub -v).
    array_parts = True
    array_offset_word = "${HPC_SWEEP_OFFSET:-0}"
    array_size_setting = "max_array_size"

    def array_size_limit(self) -> int:
        """The server's ``max_array_size`` from ``qstat -Bf`` (readable by every user:
        "Readable by all; settable by Operator and Manager"), read at submit time; the
        default 10000 where it cannot be read (:data:`DEFAULT_MAX_ARRAY_SIZE`)."""
        try:
            proc = run(["qstat", "-Bf"], timeout=30)
        except SchedulerError:
            return DEFAULT_MAX_ARRAY_SIZE
        return parse_max_array_size(proc.stdout if proc.returncode == 0 else "")

    def array_part_command(
        self,
        script: str,
        count: int,
        offset: int,
        max_parallel: int | None = None,
        after: After | None = None,
    ) -> list[str]:
        """``qsub -J 0-(count-1)[%P] -v HPC_SWEEP_OFFSET=OFFSET SCRIPT``: the command
        line's ``-J`` wins over the script's ``#PBS -J`` (qsub(1B): "Attributes set via
        command-line options take precedence over those set using PBS directives"), and
        ``-v`` adds the offset to the job's environment (qsub(1B) ``-v``), where the
        script reads it (:attr:`array_offset_word`)."""
        spec = f"0-{count - 1}" + (f"%{max_parallel}" if max_parallel else "")
        return [
            "qsub",
            "-J",
            spec,
            "-v",
            f"HPC_SWEEP_OFFSET={offset}",
            *(self.dependency(after) if after else []),
            script,
        ]

    def template_values(self, job: Job) -> dict[str, Any]:
        """The array range for ``#PBS -J`` (a subjob's log is ``DIR/ID[i].server.OU``)."""
        return {"array": self.array_spec(job)}

    def task_id(self, job_id: str, index: int) -> str:
        """Subjob ``index`` of array ``123[].server``: ``123[index].server``."""
        seq, sep, rest = job_id.partition("[]")
        return f"{seq}[{index}]{rest}" if sep else f"{job_id}[{index}]"

    def split_id(self, job_id: str) -> tuple[str, str | None] | None:
        """``123.server`` -> (123, None); a subjob ``123[4].server`` -> (123, 4); the
        array itself ``123[].server`` -> (123, None)."""
        match = _JOB_ID.match(job_id)
        return (match.group(1), match.group(2) or None) if match else None

    def array_of(self, task_id: str) -> str | None:
        """``123[4].server`` -> ``123[].server``, as ``qsub -J`` gave the array's id."""
        match = re.match(r"([0-9]+)\[[0-9]+\](.*)\Z", task_id)
        return f"{match.group(1)}[]{match.group(2)}" if match else None

    def log_name(self, job_name: str, job_id: str, task: str | None, seq: int) -> str | None:
        """``ID.OU`` in the ``-o`` folder, the server suffix kept: ``123[4].server.OU``
        (an array recorded as ``123[].server`` waits for its subjob 0)."""
        key = self.split_id(job_id)
        if key is None:
            return None
        server = job_id.split(".", 1)[1] if "." in job_id else ""
        if task is None and "[]" in job_id:
            task = "0"
        return (
            key[0]
            + (f"[{task}]" if task is not None else "")
            + (f".{server}" if server else "")
            + ".OU"
        )

    def err_log_name(self, out_name: str) -> str | None:
        """``ID.ER`` beside ``ID.OU`` (``split_logs``: ``-e`` to the same folder, no ``-j
        oe``); a log named ``NAME.oJOB`` (no ``-o``) has ``NAME.eJOB`` beside it."""
        if out_name.endswith(".OU"):
            return out_name[: -len(".OU")] + ".ER"
        match = re.fullmatch(r"(.+)\.o([0-9]+(?:\.[0-9]+)?)", out_name)
        return f"{match.group(1)}.e{match.group(2)}" if match else None

    def stage_lines(self, job: Job, stage: Stage) -> list[str]:
        """One ``mpiexec`` rank per node unpacks the pack from the run directory (PBS has
        no broadcast of its own; each node makes one sequential read of one file)."""
        ppn = "--ppn" if job.cluster.launcher.flavor == "pals" else "-ppn"
        return stage.lines(
            self.job_id_var or "",
            spread=[],
            unpack=[
                f'mpiexec -n {job.nodes} {ppn} 1 bash -c "$HPC_STAGE_UNPACK" unpack '
                f'"$HPC_STAGE_TAR" "$HPC_STAGE_DEST" {shlex.quote(stage.venv)}{stage.ok_arg}'
            ],
            cleanup=[],
        )

    def submit_command(self, script: str, after: After | None = None) -> list[str]:
        """``qsub SCRIPT``: every setting is in the script's directives."""
        return ["qsub", *(self.dependency(after) if after else []), script]

    def dependency(self, after: After) -> list[str]:
        """``-W depend=afterok:ID`` (OpenPBS qsub(1B), "-W depend=dependency_list":
        https://github.com/openpbs/openpbs/blob/master/doc/man1/qsub.1B). An array's own
        id (``123[].server``) takes the same plain forms and stands for the whole array;
        Torque's ``afterokarray``/``afteranyarray`` are no PBS Pro words: the real
        OpenPBS 23.06 server refuses them ("qsub: illegal -W value") and takes
        ``afterany:123[].server`` (checked by hand on it, 2026-11-26)."""
        return ["-W", f"depend=after{after.kind}:{after.job_id}"]

    def parse_job_id(self, stdout: str) -> str:
        """qsub prints the id alone: ``123.server`` (or ``123``, ``123[].server`` for arrays)."""
        for line in stdout.splitlines():
            if _JOB_ID.match(line.strip()):
                return line.strip()
        raise SchedulerError(f"qsub: no job id in its answer: {last_line(stdout)!r}")

    def status(self, job_id: str) -> JobState:
        """The state :func:`query` finds (JSON, then text, then plain qstat)."""
        return self.statuses([job_id])[job_id]

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        """Every id's state from :func:`query`: one ``qstat`` names them all (an
        array's subjobs by the array's id), its answer streamed."""
        found = query(job_ids)
        return {
            j: JobState(found[j]["State"]) if j in found else JobState.UNKNOWN
            for j in dict.fromkeys(job_ids)
        }

    def exit_code(self, job_id: str) -> int | None:
        """``Exit_status`` (``qstat -x``): the script's code below 256, 256+N for a job
        that signal N ended (128+N here, as a shell says it); PBS's own negative codes
        (``-29``: walltime) are no exit code of the job, so None."""
        found = query([job_id]).get(job_id) or {}
        try:
            status = int(found.get("Exit_status", ""))
        except ValueError:
            return None
        if status < 0:
            return None
        return 128 + status - 256 if status >= 256 else status

    def cancel(self, job_id: str) -> None:
        """``qdel ID``."""
        proc = run(["qdel", job_id])
        if proc.returncode != 0:
            raise SchedulerError(
                f"qdel {job_id} failed (exit {proc.returncode}): "
                f"{last_line(proc.stderr or proc.stdout)}"
            )

    # --- the Python API (hpc.executor): issue 29 ----------------------------------------

    def script_executor(self) -> type:
        """The PBS submitit plugin's executor (``hpc.executors.pbs``): the script
        executor with PBS's additions, holding the job as ``submitit_executor`` gives it."""
        from hpc.executors.pbs import PBSExecutor

        return PBSExecutor

    def submitit_array(self, job: Job, size: int) -> Job | None:
        """One PBS job array (``#PBS -J 0-N``); its subjobs are ``123[].srv_i`` to submitit."""
        return job.with_spec(directives=[*job.spec.directives, f"-J 0-{size - 1}"])

    def record_ids(self, submitit_ids: Sequence[str]) -> list[str]:
        """Subjobs as PBS names them (``123[].srv_4`` -> ``123[4].srv``)."""
        return [pbs_id(j) for j in submitit_ids]

    usage_client = "qstat"

    def job_usage(self, job_id: str) -> tuple[float, int] | str:
        """``qstat -xf``'s stime, obittime and nodect (the reader lives with the charges)."""
        from hpc.charges import _pbs_used

        return _pbs_used(job_id)


SCHEDULER = PBS
