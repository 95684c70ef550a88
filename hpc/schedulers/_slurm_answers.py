"""What SLURM's clients answer, read: state words, ``squeue``/``scontrol``/``sacct``
lines and the array limit of ``scontrol show config``.

Pure functions of the clients' text (no client is run here), so the tests feed them
recorded answers; :mod:`hpc.schedulers.slurm` runs the clients and re-exports these.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hpc.errors import UserError
from hpc.schedulers import JobState

# [0-9], not \d: \d and str.isdigit take any script's digits (١٢٣, １２３), which no
# scheduler gives and int() would quietly read as 123.
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?\Z")
_MAP = {
    "PENDING": "PENDING",
    "REQUEUED": "PENDING",
    "REQUEUE_HOLD": "PENDING",
    "REQUEUE_FED": "PENDING",
    "RESV_DEL_HOLD": "PENDING",
    "SUSPENDED": "PENDING",
    "CONFIGURING": "RUNNING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "RESIZING": "RUNNING",
    "SIGNALING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "STOPPED": "RUNNING",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "NODE_FAIL": "FAILED",
    "BOOT_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "DEADLINE": "FAILED",
    "SPECIAL_EXIT": "FAILED",
    "CANCELLED": "CANCELLED",
    "REVOKED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "PREEMPTED": "PREEMPTED",
}


def normalize(state: str) -> JobState:
    """SLURM state words (``CANCELLED by 0``, ``CD``-free long form) -> a normalized state."""
    word = state.strip().split()[0].rstrip("+").upper() if state.strip() else ""
    return JobState(_MAP.get(word, "UNKNOWN"))


def _asked(ids: list[str]) -> list[str]:
    """The ids to name in a query: a task ``N_k`` is left out when its array ``N`` is
    asked too (``squeue -r -j N`` lists every task of it)."""
    numbers = {j for j in ids if "_" not in j}
    return [j for j in ids if "_" not in j or j.partition("_")[0] not in numbers]


def _in_range(index: str, spec: str) -> bool:
    """Whether array index ``index`` is in ``spec`` (``0-999``, ``1,3-5``, ``0-9%2``:
    how squeue, scontrol and sacct print the tasks of an array not yet started)."""
    if not index.isascii() or not index.isdigit():
        return False
    value = int(index)
    for part in spec.partition("%")[0].split(","):
        lo, dash, hi = part.partition("-")
        if lo.isascii() and lo.isdigit() and (hi.isascii() and hi.isdigit() if dash else True):
            if int(lo) <= value <= (int(hi) if dash else int(lo)):
                return True
    return False


def _settle(
    found: dict[str, JobState], ids: Iterable[str], answers: list[tuple[str, str, str]], first: bool
) -> None:
    """Give each of ``ids`` its state from ``answers`` ((id, array id, state word) in
    the client's order) where it has none yet; a known word only (UNKNOWN asks on).

    An id is answered by the line of that id; a task of an array not yet started by
    the array's line (``123_[0-999]``); an array's own id (``123``) by the first line
    of its tasks (``first``: squeue's and scontrol's order) or, for sacct, the last
    (a requeued job's latest run is its last line)."""
    exact: dict[str, str] = {}
    by_array: dict[str, str] = {}
    ranges: dict[str, list[tuple[str, str]]] = {}
    word: str | None
    for job, array, word in answers:
        if first:
            exact.setdefault(job, word)
            by_array.setdefault(array, word)
        else:
            exact[job] = word
            by_array[array] = word
        number, _, task = job.partition("_")
        if task.startswith("["):
            ranges.setdefault(number, []).append((task.strip("[]"), word))
    for job_id in ids:
        if job_id in found:
            continue
        number, _, task = job_id.partition("_")
        word = exact.get(job_id) if task else exact.get(job_id) or by_array.get(job_id)
        if word is None and task:
            word = next((w for spec, w in ranges.get(number, []) if _in_range(task, spec)), None)
        state = normalize(word) if word is not None else JobState.UNKNOWN
        if state != JobState.UNKNOWN:
            found[job_id] = state


def _squeue_lines(text: str) -> list[tuple[str, str, str]]:
    """``%i|%A|%T`` lines: (job or task id, array job id, state)."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0]:
            out.append((parts[0], parts[1] or parts[0].partition("_")[0], parts[2]))
    return out


def _scontrol_records(text: str) -> list[tuple[str, str, str]]:
    """``scontrol -o show job`` records (one a line with -o; also read when a record
    spans lines): (``JobId`` or ``ArrayJobId_ArrayTaskId``, array id, ``JobState``)."""
    out = []
    for record in re.split(r"(?:^|\s)(?=JobId=)", text):
        fields = dict(re.findall(r"(?<!\S)([A-Za-z]+)=(\S*)", record))
        if "JobId" not in fields or "JobState" not in fields:
            continue
        array, task = fields.get("ArrayJobId"), fields.get("ArrayTaskId")
        if array and task:
            job = f"{array}_{task}" if task.isdigit() else f"{array}_[{task}]"
        else:
            job = fields["JobId"]
        out.append((job, array or job, fields["JobState"]))
        if array and task and fields["JobId"] != array:  # the task's own id answers too
            out.append((fields["JobId"], fields["JobId"], fields["JobState"]))
    return out


def _sacct_lines(text: str) -> list[tuple[str, str, str]]:
    """``JobID|State`` lines (``-P``): (job or task id, its array's number, state)."""
    out = []
    for line in text.splitlines():
        job, sep, state = line.strip().partition("|")
        if sep and job:
            out.append((job, job.partition("_")[0], state))
    return out


DEFAULT_MAX_ARRAY_SIZE = 1001
"""slurm.conf(5) MaxArraySize: "The default value is 1001" (indices 0 to 1000)."""


def parse_array_limit(config: str) -> int:
    """Most tasks of one array from ``scontrol show config``'s text: ``MaxArraySize``,
    lowered by ``SchedulerParameters``' ``max_array_tasks`` (slurm.conf(5): "limit the
    number of tasks in any single job array"); the default where the line is missing."""
    found = re.search(r"^MaxArraySize\s*=\s*([0-9]{1,9})\s*$", config, re.M)
    limit = int(found.group(1)) if found else DEFAULT_MAX_ARRAY_SIZE
    if limit == 0:
        raise UserError(
            "--sweep: this SLURM cluster has MaxArraySize = 0 (job arrays are "
            "disabled, slurm.conf(5)); allowed: one hpc submit per point, no --sweep"
        )
    tasks = re.search(r"^SchedulerParameters\s*=.*\bmax_array_tasks=([0-9]{1,9})\b", config, re.M)
    if tasks and 0 < int(tasks.group(1)) < limit:
        limit = int(tasks.group(1))
    return limit
