"""The one PBS client: qstat's answers read into states, and job ids in PBS's and submitit's forms.

:func:`query` is what both ``hpc status`` (through :class:`hpc.schedulers.pbs.PBS`)
and the submitit PBS executor (``hpc.executors.pbs``) ask, so the two never disagree
on a job. It reads ``qstat -x -f -F json`` leniently (:mod:`hpc.schedulers._pbs_json`),
falls back to ``qstat -f`` text and plain ``qstat``, understands job arrays
(``123[].srv``, subjobs ``123[4].srv``) and the id forms submitit uses for them
(``123[].srv_4``). The server's ``max_array_size`` (``qstat -Bf``) is read here too.
Its public names are re-exported by :mod:`hpc.schedulers.pbs`, the module users name;
the leading underscore keeps this one out of scheduler discovery.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from hpc.errors import UserError
from hpc.schedulers import JobState, SchedulerError, chunks, stream
from hpc.schedulers._pbs_json import _qstat_json_jobs

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
    "Q": "PENDING",
    "H": "PENDING",
    "W": "PENDING",
    "T": "PENDING",
    "M": "PENDING",
    "S": "PENDING",
    "U": "PENDING",
    "R": "RUNNING",
    "E": "RUNNING",
    "B": "RUNNING",
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
    for key in (
        "job_state",
        "substate",
        "Exit_status",
        "comment",
        "exec_host",
        "queue",
        "Job_Name",
        "array_id",
        "array_index",
    ):
        if attrs.get(key) is not None:
            out[key] = str(attrs[key])
    return out


class QstatInfo(dict):  # type: ignore[type-arg]
    """What a qstat reader found: info per job keyed by PBS id and submitit id, and
    :attr:`by_key` per server-free key (:func:`job_key`), so a lookup in another
    spelling of the server name is one dict access, never a scan of every job."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: dict[str, dict[str, str]] = {}

    def add(self, pbs_id: str, attrs: dict[str, Any]) -> None:
        """Keep one job (its few attributes, as :func:`_info` makes them)."""
        info = _info(pbs_id, attrs)
        self[pbs_id] = info
        self[submitit_id(pbs_id, attrs)] = info
        self.by_key.setdefault(job_key(pbs_id), info)


_KEY = re.compile(r"^([0-9]+)(?:\[([0-9]*)\])?")


def job_key(job_id: str) -> str:
    """A job's id without its server: ``123`` for ``123.host.domain``, ``123.host``
    and ``123`` alike; ``123[4]`` for subjob ``123[4].srv`` and submitit's
    ``123[].srv_4``; an array's own ``123[].srv`` is ``123`` (no plain job shares its
    number). qsub prints the full name (``123.aurora-pbs-0001.hostmgmt...``) where
    qstat may print a shorter one, or cut the id to its column: the id is
    normalised once, here, where it is asked and where it is read."""
    match = _SUBMITIT_ARRAY.match(job_id)
    if match:
        return f"{_seq(match['parent'])}[{match['index']}]"
    match = _KEY.match(job_id)
    if match is None:
        return job_id
    return match.group(1) + (f"[{match.group(2)}]" if match.group(2) else "")


def _wanted(job_ids: Iterable[str] | None) -> set[str] | None:
    return None if job_ids is None else {job_key(j) for j in job_ids}


def read_qstat_json(
    source: str | bytes | IO[str] | IO[bytes], wanted: Iterable[str] | None = None
) -> QstatInfo:
    """Info per job from ``qstat -x -f -F json [-t]``, keyed by PBS id and submitit id.

    ``source``: the answer, or a stream of it (read as it comes, one job at a time);
    ``wanted``: the ids asked for (any server spelling, submitit's array form): only
    those are kept, so memory is flat in jobs not asked for (``qstat -t`` of a
    50,000-subjob array asked for one subjob); None keeps every job.
    """
    keys = _wanted(wanted)
    out = QstatInfo()
    for pbs_id, attrs in _qstat_json_jobs(source):
        if isinstance(attrs, dict) and (keys is None or job_key(pbs_id) in keys):
            out.add(pbs_id, attrs)
    return out


def _lines(source: str | IO[str]) -> Iterator[str]:
    """The lines of an answer (a string, or a stream read as it comes)."""
    if isinstance(source, str):
        yield from source.splitlines()
    else:
        for line in source:
            yield line.rstrip("\r\n")


def _join_continuations(source: str | IO[str]) -> Iterator[str]:
    """``qstat -f`` wraps long values onto lines that start with a tab: join them back."""
    last: str | None = None
    for raw in _lines(source):
        if raw.startswith("\t") and last is not None:
            last += raw[1:]
            continue
        if last is not None:
            yield last
        last = raw
    if last is not None:
        yield last


def read_qstat_text(source: str | IO[str], wanted: Iterable[str] | None = None) -> QstatInfo:
    """Info per job from ``qstat -f`` (blocks of ``Job Id: ID`` and ``    key = value``),
    read as it streams and keeping only ``wanted`` jobs (see :func:`read_qstat_json`)."""
    keys = _wanted(wanted)
    out = QstatInfo()
    pbs_id: str | None = None
    attrs: dict[str, str] = {}

    def flush() -> None:
        if pbs_id is not None and (keys is None or job_key(pbs_id) in keys):
            out.add(pbs_id, attrs)

    for line in _join_continuations(source):
        if line.startswith("Job Id:"):
            flush()
            pbs_id, attrs = line.split(":", 1)[1].strip(), {}
        elif pbs_id is not None and " = " in line and (keys is None or job_key(pbs_id) in keys):
            key, value = line.strip().split(" = ", 1)
            attrs[key.strip()] = value.strip()
    flush()
    return out


def read_qstat_plain(source: str | IO[str], wanted: Iterable[str] | None = None) -> QstatInfo:
    """Info per job from plain ``qstat`` (a table; the S column is the state letter).

    Long ids are cut to the column width and end in ``*``; they are kept as the
    prefix they are, and matched by their key (:func:`job_key`).
    """
    keys = _wanted(wanted)
    out = QstatInfo()
    for line in _lines(source):
        words = line.split()
        if len(words) < 6 or not re.match("[0-9]", words[0]):
            continue
        pbs_id, letter = words[0].rstrip("*"), words[-2]
        if keys is not None and job_key(pbs_id) not in keys:
            continue
        state = normalize(letter) if letter not in ("F", "X") else GONE
        info = {"JobID": pbs_id, "State": state.value, "job_state": letter, "queue": words[-1]}
        out[pbs_id] = info
        out[submitit_id(pbs_id)] = info
        out.by_key.setdefault(job_key(pbs_id), info)
    return out


def _seq(job_id: str) -> str:
    """The sequence number part of an id: ``123`` of ``123.srv``, ``123[4].srv`` or ``123[].srv_4``."""
    match = re.match(r"^[0-9]+", job_id)
    return match.group(0) if match else job_id


def lookup(info: dict[str, dict[str, str]], job_id: str) -> dict[str, str] | None:
    """The entry for ``job_id``: exact, else the same job in another spelling of the
    server name (or cut by plain qstat): the same :func:`job_key`, one dict access
    on a reader's answer (a plain dict is keyed once, here)."""
    if job_id in info:
        return info[job_id]
    by_key = getattr(info, "by_key", None)
    if by_key is None:
        by_key = {}
        for key, value in info.items():
            by_key.setdefault(job_key(key), value)
    return by_key.get(job_key(job_id))


def _gone(stderr: str, ids: Iterable[str]) -> set[str]:
    """Ids qstat says it does not know (any more), from its error lines: each number
    in such a line names the ids of that sequence number (a dict access, no scan)."""
    by_seq: dict[str, list[str]] = {}
    for job_id in ids:
        by_seq.setdefault(_seq(job_id), []).append(job_id)
    gone: set[str] = set()
    for line in stderr.splitlines():
        if "Unknown Job Id" in line or "has finished" in line:
            for number in re.findall(r"[0-9]+", line):
                gone.update(by_seq.get(number, ()))
    return gone


def _subjob_array(job_id: str) -> str | None:
    """``123[].srv`` for subjob ``123[4].srv``; None for any other id."""
    match = re.match(r"([0-9]+)\[[0-9]+\](.*)\Z", job_id)
    return f"{match.group(1)}[]{match.group(2)}" if match else None


def _query_ids(ids: list[str]) -> dict[str, list[str]]:
    """What to name to qstat -> the asked ids its answer covers. A subjob is asked
    through its array (``-t`` lists every subjob) when the array is asked too or
    two or more of its subjobs are: one id instead of a thousand."""
    plain = [pbs_query_id(j) for j in ids]
    arrays: dict[str, int] = {}
    for q in plain:
        parent = _subjob_array(q)
        arrays[parent or q] = arrays.get(parent or q, 0) + (1 if parent else 2)
    out: dict[str, list[str]] = {}
    for job_id, q in zip(ids, plain, strict=True):
        parent = _subjob_array(q)
        name = parent if parent is not None and arrays.get(parent, 0) >= 2 else q
        out.setdefault(name, []).append(job_id)
    return out


def _stream(
    argv: list[str], reader: Callable[[IO[str]], QstatInfo]
) -> tuple[QstatInfo, int, str] | None:
    """Run a PBS client, its answer read as it streams; None when it is missing or
    hangs (the caller falls back). A damaged answer raises the reader's error."""
    try:
        return stream(argv, reader, timeout=QSTAT_TIMEOUT_S)
    except SchedulerError:
        return None


def query(job_ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """States of ``job_ids`` (PBS or submitit ids) with the fallbacks a site may need.

    1. ``qstat -x -f -F json [-t] IDS``: PBS Pro 19+ with job history.
    2. ``qstat -x -f IDS``, then ``qstat -f IDS``: servers without ``-F json`` (older
       PBS Pro; Torque, whose ``-x`` means XML and yields no ``Job Id:`` blocks).
    3. ``qstat IDS``: anything with a qstat at all.

    One call names many ids (an array's subjobs by the array's one id, see
    :func:`_query_ids`; a thousand ids or 32 KiB at most per call, see
    :func:`hpc.schedulers.chunks`), and its answer is read as it streams, keeping only
    the jobs asked for. qstat exits non-zero when one id is unknown but still prints
    the others, so the output is read whatever the exit code; ids it calls unknown or
    finished (no history kept) get the state ``FINISHED``: done, outcome only in the
    job's files. An answer that names none of the ids moves on to the next form.
    """
    ids = list(dict.fromkeys(job_ids))
    covers = _query_ids(ids)
    out: dict[str, dict[str, str]] = {}
    for group in chunks(covers, sep=1):
        asked = [j for q in group for j in covers[q]]
        out.update(_query_group(group, asked))
    return out


def _query_group(query_ids: list[str], ids: list[str]) -> dict[str, dict[str, str]]:
    """:func:`query` of one call's worth of ids, each form in turn."""
    arrays = ["-t"] if any("[" in q for q in query_ids) else []
    readers: list[tuple[list[str], Callable[..., QstatInfo]]] = [
        (["qstat", "-x", "-f", "-F", "json", *arrays, *query_ids], read_qstat_json),
        (["qstat", "-x", "-f", *arrays, *query_ids], read_qstat_text),
        (["qstat", "-f", *arrays, *query_ids], read_qstat_text),
        (["qstat", *arrays, *query_ids], read_qstat_plain),
    ]
    # OpenPBS 23.06's `qstat -x -f -F json A B C` of finished jobs prints A alone (seen on
    # the real server: a chain's three segments); the ids an answer leaves out are asked
    # by the next form, which names them all.
    out: dict[str, dict[str, str]] = {}
    for argv, reader in readers:
        try:
            done = _stream(argv, lambda text, reader=reader: reader(text, ids))  # type: ignore[misc]
        except (ValueError, AttributeError, TypeError):
            continue
        if done is None:
            break
        info, _, stderr = done
        gone = _gone(stderr, ids)
        for job_id in ids:
            found = lookup(info, job_id)
            if job_id in out:
                continue
            if found is not None:
                out[job_id] = found
            elif job_id in gone:
                out[job_id] = {"JobID": job_id, "State": GONE.value}
        if out and all(j in out for j in ids):
            return out
    return out


def state_of(info: dict[str, dict[str, str]], job_id: str) -> JobState:
    """The state of ``job_id`` in a reader's answer (UNKNOWN when it is not there)."""
    found = lookup(info, job_id)
    return JobState(found["State"]) if found else JobState.UNKNOWN


def parse_qstat_json(text: str, job_id: str) -> JobState:
    """State of one job from ``qstat -x -f -F json``."""
    return state_of(read_qstat_json(text, [job_id]), job_id)


def parse_qstat_text(text: str) -> JobState:
    """State of the (first) job in ``qstat -f`` text."""
    info = read_qstat_text(text)
    return JobState(next(iter(info.values()))["State"]) if info else JobState.UNKNOWN


DEFAULT_MAX_ARRAY_SIZE = 10000
"""OpenPBS pbs_server_attributes(7B), max_array_size: "The maximum number of subjobs that
are allowed in any array job ... Default: 10000"
(https://github.com/openpbs/openpbs/blob/master/doc/man1/pbs_server_attributes.7B; the
server applies the same when it is unset, src/server/array_func.c ``setup_ajinfo``:
``PBS_MAX_ARRAY_JOB_DFL /* default limit 10000 */``). It caps the number of subjobs,
not the index (``count > limit``; ``qsub -J 10-14`` passes at 5, ``-J 0-5`` is refused:
"qsub: Array job exceeds server or queue size limit", both seen on OpenPBS 23.06)."""


def parse_max_array_size(text: str) -> int:
    """Most subjobs of one array from ``qstat -Bf``'s text (the lowest where several
    servers answer); :data:`DEFAULT_MAX_ARRAY_SIZE` where no server lists it. Below 2
    no sweep fits: PBS takes no array of one subjob (``hpc.sweep.split``)."""
    found = [int(v) for v in re.findall(r"^\s*max_array_size\s*=\s*([0-9]{1,9})\s*$", text, re.M)]
    limit = min(found) if found else DEFAULT_MAX_ARRAY_SIZE
    if limit < 2:
        raise UserError(
            f"--sweep: this PBS server's max_array_size is {limit}, and PBS takes no "
            "array of fewer than 2 subjobs (qsub: illegal -J value); allowed: one "
            "hpc submit per point, no --sweep"
        )
    return limit
