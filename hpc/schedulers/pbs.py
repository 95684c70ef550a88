"""PBS Pro: qsub scripts, ranks started by mpiexec (PALS or hydra), and the one PBS client.

The client (:func:`query` and its readers) is what both ``hpc status`` and the
submitit PBS executor (``hpc.executors.pbs``) ask, so the two never disagree on a
job. It reads ``qstat -x -f -F json`` leniently, falls back to ``qstat -f`` text and
plain ``qstat``, understands job arrays (``123[].srv``, subjobs ``123[4].srv``) and
the id forms submitit uses for them (``123[].srv_4``).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hpc.schedulers import JobState, Scheduler, SchedulerError, last_line, run

if TYPE_CHECKING:
    from hpc.job import Job

#: ``qstat`` answers within this many seconds, or the next form is tried.
QSTAT_TIMEOUT_S = 60
#: State of a job the server no longer knows (finished, no job history kept).
GONE = JobState.FINISHED

# number, subjob; [0-9], not \d: \d and str.isdigit take any script's digits (١٢٣, １２３)
_JOB_ID = re.compile(r"^([0-9]+)(?:\[([0-9]*)\])?(?:\.[A-Za-z0-9_.-]+)?\Z")
_SUBJOB = re.compile(r"^(?P<seq>[0-9]+)\[(?P<index>[0-9]+)\](?P<rest>.*)$")
_SUBMITIT_ARRAY = re.compile(r"^(?P<parent>[0-9]+\[\](?:\.[^_]*)?)_(?P<index>[0-9]+)$")

# job_state letters (PBS Pro reference guide); F/X are looked at with Exit_status.
_STATES = {
    "Q": "PENDING", "H": "PENDING", "W": "PENDING", "T": "PENDING", "M": "PENDING",
    "S": "PENDING", "U": "PENDING",
    "R": "RUNNING", "E": "RUNNING", "B": "RUNNING",
}
# Exit_status values PBS sets itself (negative JOB_EXEC_* codes, 256+signal for kills).
_WALLTIME_KILLED = {-29}  # JOB_EXEC_KILL_WALLTIME
_CANCEL_CODES = {271, 265}  # SIGTERM / SIGKILL from qdel (only read when there is no substate)
# Substates of finished jobs (job.h JOB_SUBSTATE_*): 91 terminated, 92 finished, 93 failed.
_TERMINATED, _FINISHED, _FAILED = "91", "92", "93"


def normalize(state: str, exit_status: int | None = None, substate: str | None = None) -> JobState:
    """PBS job_state letter (+ substate, then Exit_status, once finished) -> a normalized state.

    The substate decides first because the real server's Exit_status cannot tell a
    ``qdel`` apart: a running job deleted by ``qdel`` ends with substate 91 and
    Exit_status 271 (256+SIGTERM) *or* 0 or the script's own code (143 from a shell
    that traps TERM), depending on how fast the script dies (seen on OpenPBS 23.06,
    tests/hpc/data/openpbs/*deleted*.json). Within substate 93 (failed) Exit_status -29
    still says the walltime killed it. Without a substate (``qstat -f`` of servers that
    hide it, Torque) Exit_status alone decides, as before.
    """
    return JobState(_normalize(state, exit_status, substate))


def _normalize(state: str, exit_status: int | None, substate: Any) -> str:
    state = state.strip().upper()[:1]
    if state in _STATES:
        return _STATES[state]
    if state not in ("F", "X"):
        return "UNKNOWN"
    sub = str(substate if substate is not None else "").strip()
    if sub == _TERMINATED:
        return "CANCELLED"
    if sub == _FINISHED:
        return "COMPLETED"
    if sub == _FAILED:
        return "TIMEOUT" if exit_status in _WALLTIME_KILLED else "FAILED"
    if exit_status is None:
        return "COMPLETED" if state == "X" else "UNKNOWN"
    if exit_status == 0:
        return "COMPLETED"
    if exit_status in _WALLTIME_KILLED:
        return "TIMEOUT"
    if exit_status in _CANCEL_CODES:
        return "CANCELLED"
    return "FAILED"



def loads_qstat_json(text: str) -> dict[str, Any]:
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


def _state(attrs: dict[str, Any]) -> JobState:
    """Normalized state of one job from its attributes (job_state + Exit_status/substate)."""
    letter = str(attrs.get("job_state", "")).strip().upper()[:1]
    code = attrs.get("Exit_status")
    try:
        exit_status = None if code is None or str(code).strip() == "" else int(str(code).strip())
    except ValueError:
        exit_status = None
    state = normalize(letter, exit_status, attrs.get("substate"))
    return GONE if state == "UNKNOWN" and letter in ("F", "X") else state


def submitit_id(pbs_id: str, attrs: dict[str, Any] | None = None) -> str:
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


def _info(pbs_id: str, attrs: dict[str, Any]) -> dict[str, str]:
    """The few attributes callers use, as strings (submitit's info dicts hold strings)."""
    out = {"JobID": pbs_id, "State": _state(attrs).value}
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
    out: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) < 6 or not re.match("[0-9]", words[0]):
            continue
        pbs_id, letter = words[0].rstrip("*"), words[-2]
        state = normalize(letter) if letter not in ("F", "X") else GONE
        info = {"JobID": pbs_id, "State": state.value, "job_state": letter, "queue": words[-1]}
        out[pbs_id] = info
        out[submitit_id(pbs_id)] = info
    return out


def _seq(job_id: str) -> str:
    """The sequence number part of an id: ``123`` of ``123.srv``, ``123[4].srv`` or ``123[].srv_4``."""
    match = re.match(r"^[0-9]+", job_id)
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
    try:
        return run(argv, timeout=QSTAT_TIMEOUT_S)
    except SchedulerError:
        return None


def _gone(stderr: str, ids: Iterable[str]) -> set[str]:
    """Ids qstat says it does not know (any more), from its error lines."""
    gone = set()
    for line in stderr.splitlines():
        if "Unknown Job Id" in line or "has finished" in line:
            for job_id in ids:
                if re.search(rf"(^|[^0-9]){re.escape(_seq(job_id))}([^0-9]|$)", line):
                    gone.add(job_id)
    return gone


def query(job_ids: Iterable[str]) -> dict[str, dict[str, str]]:
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
    attempts: list[tuple[list[str], Callable[[str], dict[str, dict[str, str]]]]] = [
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
                out[job_id] = {"JobID": job_id, "State": GONE.value}
        if out:
            return out
    return {}


def state_of(info: dict[str, dict[str, str]], job_id: str) -> JobState:
    """The state of ``job_id`` in a reader's answer (UNKNOWN when it is not there)."""
    found = lookup(info, job_id)
    return JobState(found["State"]) if found else JobState.UNKNOWN


def parse_qstat_json(text: str, job_id: str) -> JobState:
    """State of one job from ``qstat -x -f -F json``."""
    return state_of(read_qstat_json(text), job_id)


def parse_qstat_text(text: str) -> JobState:
    """State of the (first) job in ``qstat -f`` text."""
    info = read_qstat_text(text)
    return JobState(next(iter(info.values()))["State"]) if info else JobState.UNKNOWN


class PBS(Scheduler):
    """PBS Pro: qsub scripts with ``#PBS`` directives; ranks started by mpiexec."""

    name = "pbs"
    script_suffix = ".pbs"
    launchers = ("mpiexec",)
    queue_directives = ("queue",)
    client = "qstat"
    detect_order = 20
    array_index_var = "PBS_ARRAY_INDEX"
    # `-J 0-9%2` sets max_run_subjobs: seen accepted by OpenPBS 23.06 (the test server);
    # older PBS Pro releases reject the suffix (unverified for ALCF's PBS Pro version).
    array_throttle = True
    # `-o DIR/` (a folder): JOBID.OU (subjobs 123[4].server.OU); without -o, PBS writes
    # NAME.oJOBNUM in the submit folder.
    log_patterns = (r"(?P<job>[0-9]+(?:\[[0-9]*\])?(?:\.[A-Za-z0-9_.-]+?)?)\.OU",
                    r"(?P<name>.+)\.o(?P<job>[0-9]+(?:\.[0-9]+)?)")
    id_examples = "123.server, 123[3].server"

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
        return key[0] + (f"[{task}]" if task is not None else "") + (f".{server}" if server else "") + ".OU"

    def launch(self, job: Job) -> tuple[list[str], list[str]]:
        """``mpiexec`` with the profile's PALS or hydra flags."""
        from hpc import launchers

        return [], launchers.mpiexec(job)

    def submit_command(self, script: str) -> list[str]:
        """``qsub SCRIPT``: every setting is in the script's directives."""
        return ["qsub", script]

    def parse_job_id(self, stdout: str) -> str:
        """qsub prints the id alone: ``123.server`` (or ``123``, ``123[].server`` for arrays)."""
        for line in stdout.splitlines():
            if _JOB_ID.match(line.strip()):
                return line.strip()
        raise SchedulerError(f"qsub: no job id in its answer: {last_line(stdout)!r}")

    def status(self, job_id: str) -> JobState:
        """The state :func:`query` finds (JSON, then text, then plain qstat)."""
        found = query([job_id]).get(job_id)
        return JobState(found["State"]) if found else JobState.UNKNOWN

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
            raise SchedulerError(f"qdel {job_id} failed (exit {proc.returncode}): "
                                 f"{last_line(proc.stderr or proc.stdout)}")


SCHEDULER = PBS
