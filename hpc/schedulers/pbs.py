"""PBS Pro: qsub scripts, ranks started by mpiexec (PALS or hydra), and the one PBS client.

The client (:func:`query` and its readers) is what both ``hpc status`` and the
submitit PBS executor (``hpc.executors.pbs``) ask, so the two never disagree on a
job. It reads ``qstat -x -f -F json`` leniently, falls back to ``qstat -f`` text and
plain ``qstat``, understands job arrays (``123[].srv``, subjobs ``123[4].srv``) and
the id forms submitit uses for them (``123[].srv_4``).
"""

from __future__ import annotations

import codecs
import json
import re
import shlex
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from hpc.errors import UserError
from hpc.schedulers import JobState, Scheduler, SchedulerError, chunks, last_line, run, stream

if TYPE_CHECKING:
    from pathlib import Path

    from hpc.chain import After
    from hpc.job import Job
    from hpc.stage import Stage

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


_WS = re.compile(r"[ \t\n\r]*")
_TOKEN = re.compile(r'["{}\[\]]')
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SCALAR = re.compile(r"[^\s,}\]]*")
#: Characters read from qstat at a time, and the most one value (one job's attributes)
#: may take: a real job is a few kilobytes; a bigger one is damage.
_CHUNK = 256 * 1024
_MAX_VALUE = 64 * 1024 * 1024


class _JsonStream:
    """``qstat -F json`` read a value at a time as it streams.

    Each value is decoded with :class:`json.JSONDecoder` (C speed) from a buffer that
    holds the current job and at most one chunk more; what was read is dropped. A job
    that strict JSON refuses (PBS Pro before 2021: unescaped backslashes in
    ``Variable_List``) is cut out by a tolerant scan and read as
    :func:`loads_qstat_json` reads a whole answer.
    """

    def __init__(self, source: str | bytes | IO[str] | IO[bytes]) -> None:
        if isinstance(source, bytes):
            source = source.decode(errors="replace")
        self.src = None if isinstance(source, str) else source
        self.buf = source if isinstance(source, str) else ""
        self.eof = self.src is None
        self.pos = 0
        self.decoder = json.JSONDecoder(strict=False)
        self.bytes_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _more(self) -> bool:
        """Read the next chunk (dropping what was read); False at the end."""
        if self.eof or self.src is None:
            self.eof = True
            return False
        if len(self.buf) - self.pos > _MAX_VALUE:
            raise ValueError(f"qstat JSON: one value is over {_MAX_VALUE:,} characters")
        # as much again as the value read so far: a long value is read in O(its size)
        size = max(_CHUNK, len(self.buf) - self.pos)
        # what the client wrote so far (read1), not `size` of it: a pipe's read(size)
        # would wait for all of it, and damage early in a long answer would go unseen
        raw = getattr(self.src, "buffer", self.src)
        read = getattr(raw, "read1", None) or self.src.read
        text = ""
        while not text:
            chunk = read(size)
            if not chunk:
                text = self.bytes_decoder.decode(b"", final=True)
                if not text:
                    self.eof = True
                    return False
            else:
                text = self.bytes_decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ("" at the end)."""
        while True:
            match = _WS.match(self.buf, self.pos)
            self.pos = match.end() if match else self.pos
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                return ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            found = self.peek() or "the end"
            raise ValueError(f"qstat JSON: {found!r} where {char!r} belongs")
        self.pos += 1

    def value(self) -> Any:
        """The next JSON value."""
        self.peek()
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(self.buf) - 8
                if not self.eof and cut:  # the value goes on in the next chunk
                    self._more()
                    continue
                return self._lenient()
            if end >= len(self.buf) and not self.eof:  # a number or word may go on
                self._more()
                continue
            self.pos = end
            return obj

    def _lenient(self) -> Any:
        """The value at ``pos`` that strict JSON refused, cut out and read leniently."""
        while (end := _value_end(self.buf, self.pos, self.eof)) is None:
            if not self._more() and (end := _value_end(self.buf, self.pos, True)) is None:
                raise ValueError("qstat JSON: the answer ends inside a value")
        text = self.buf[self.pos:end]
        self.pos = end
        return loads_qstat_json(text)


def _value_end(buf: str, start: int, eof: bool) -> int | None:
    """Where the JSON value at ``start`` ends, strings and nesting followed and escapes
    taken as pairs whatever they are; None while it may go on past ``buf``."""
    if start >= len(buf):
        return None
    if buf[start] == '"':
        match = _STRING.match(buf, start)
        return match.end() if match else None
    if buf[start] not in "{[":
        end = _SCALAR.match(buf, start).end()  # type: ignore[union-attr]
        return end if end < len(buf) or eof else None
    depth, pos = 0, start
    while (token := _TOKEN.search(buf, pos)) is not None:
        if token.group() == '"':
            match = _STRING.match(buf, token.start())
            if match is None:
                return None
            pos = match.end()
            continue
        depth += 1 if token.group() in "{[" else -1
        pos = token.end()
        if depth == 0:
            return pos
    return None


def _qstat_json_jobs(source: str | bytes | IO[str] | IO[bytes]) -> Iterator[tuple[str, Any]]:
    """(id, attributes) of each job in a ``qstat -F json`` answer, one at a time."""
    reader = _JsonStream(source)
    if reader.peek() == "":  # no answer at all (no job matched)
        return
    reader.expect("{")
    if reader.peek() == "}":
        return
    while True:
        key = reader.value()
        if not isinstance(key, str):
            raise ValueError("qstat JSON: a key that is not a string")
        reader.expect(":")
        if key == "Jobs" and reader.peek() == "{":
            reader.expect("{")
            while reader.peek() != "}":
                job = reader.value()
                if not isinstance(job, str):
                    raise ValueError("qstat JSON: a job id that is not a string")
                reader.expect(":")
                yield job, reader.value()
                if reader.peek() == ",":
                    reader.pos += 1
            reader.expect("}")
        else:
            value = reader.value()
            if key == "Jobs" and value and not isinstance(value, dict):
                raise ValueError("qstat JSON: 'Jobs' is not a mapping")
        if reader.peek() == ",":
            reader.pos += 1
            continue
        reader.expect("}")
        return


def read_qstat_json(source: str | bytes | IO[str] | IO[bytes],
                    wanted: Iterable[str] | None = None) -> QstatInfo:
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


def _stream(argv: list[str], reader: Callable[[IO[str]], QstatInfo]
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
        raise UserError(f"--sweep: this PBS server's max_array_size is {limit}, and PBS takes no "
                        "array of fewer than 2 subjobs (qsub: illegal -J value); allowed: one "
                        "hpc submit per point, no --sweep")
    return limit


class PBS(Scheduler):
    """PBS Pro: qsub scripts with ``#PBS`` directives; ranks started by mpiexec."""

    name = "pbs"
    script_suffix = ".pbs"
    launchers = ("mpiexec",)
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
    log_patterns = (r"(?P<job>[0-9]+(?:\[[0-9]*\])?(?:\.[A-Za-z0-9_.-]+?)?)\.OU",
                    r"(?P<name>.+)\.o(?P<job>[0-9]+(?:\.[0-9]+)?)")
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

    def array_part_command(self, script: str, count: int, offset: int,
                           max_parallel: int | None = None, after: After | None = None
                           ) -> list[str]:
        """``qsub -J 0-(count-1)[%P] -v HPC_SWEEP_OFFSET=OFFSET SCRIPT``: the command
        line's ``-J`` wins over the script's ``#PBS -J`` (qsub(1B): "Attributes set via
        command-line options take precedence over those set using PBS directives"), and
        ``-v`` adds the offset to the job's environment (qsub(1B) ``-v``), where the
        script reads it (:attr:`array_offset_word`)."""
        spec = f"0-{count - 1}" + (f"%{max_parallel}" if max_parallel else "")
        return ["qsub", "-J", spec, "-v", f"HPC_SWEEP_OFFSET={offset}",
                *(self.dependency(after) if after else []), script]

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

    def err_log_name(self, out_name: str) -> str | None:
        """``ID.ER`` beside ``ID.OU`` (``split_logs``: ``-e`` to the same folder, no ``-j
        oe``); a log named ``NAME.oJOB`` (no ``-o``) has ``NAME.eJOB`` beside it."""
        if out_name.endswith(".OU"):
            return out_name[: -len(".OU")] + ".ER"
        match = re.fullmatch(r"(.+)\.o([0-9]+(?:\.[0-9]+)?)", out_name)
        return f"{match.group(1)}.e{match.group(2)}" if match else None

    def launch(self, job: Job) -> tuple[list[str], list[str]]:
        """``mpiexec`` with the profile's PALS or hydra flags."""
        from hpc import launchers

        return [], launchers.mpiexec(job)

    def stage_lines(self, job: Job, stage: Stage) -> list[str]:
        """One ``mpiexec`` rank per node unpacks the pack from the run directory (PBS has
        no broadcast of its own; each node makes one sequential read of one file)."""
        ppn = "--ppn" if job.cluster.launcher.flavor == "pals" else "-ppn"
        return stage.lines(
            self.job_id_var or "", spread=[],
            unpack=[f'mpiexec -n {job.nodes} {ppn} 1 bash -c "$HPC_STAGE_UNPACK" unpack '
                    f'"$HPC_STAGE_TAR" "$HPC_STAGE_DEST" {shlex.quote(stage.venv)}{stage.ok_arg}'],
            cleanup=[])

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
        return {j: JobState(found[j]["State"]) if j in found else JobState.UNKNOWN
                for j in dict.fromkeys(job_ids)}

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

    # --- the Python API (hpc.executor): issue 29 ----------------------------------------

    def submitit_executor(self, job: Job, folder: Path, max_num_timeout: int = 3,
                          run_dir: Path | None = None) -> Any:
        """The PBS submitit plugin's executor (``hpc.executors.pbs``), holding ``job``."""
        from hpc.executors.pbs import PBSExecutor

        return PBSExecutor(folder, max_num_timeout=max_num_timeout,
                           python="python" if job.spec.python else None, job=job,
                           run_dir=run_dir)

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
