"""``hpc logs RUN_DIR|JOB_ID [-f]``: find a run's job log and print it, following it as it grows.

Each scheduler names the log itself, from the directives that ``hpc submit`` renders
into the run directory; what the names look like is the scheduler's own
(``Scheduler.log_patterns``, ``log_name``, ``split_id`` in ``hpc.schedulers.NAME``), so
a new scheduler's logs are found without a change here:

- SLURM: ``--output=RUN_DIR/%x-%j.out`` -> ``NAME-JOBID.out``; an array's task logs are
  ``NAME-ARRAYID_TASK.out`` (``%x-%A_%a.out``: ``%j`` of a task is an unrelated id);
- PBS: ``-o RUN_DIR/`` (a folder) -> ``JOBID.OU`` (``123.server.OU``; array subjobs
  ``123[4].server.OU``); without ``-o`` PBS writes ``NAME.oJOBNUM`` in the submit folder;
- local: ``output.log``, then ``output-2.log`` ... for each ``--resume`` (no id in the
  name: matched to the run record's submissions in order).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

from hpc._pipes import reader_gone
from hpc.errors import UserError

if TYPE_CHECKING:
    from hpc.schedulers import Scheduler


class _Log(NamedTuple):
    path: Path
    scheduler: str
    key: tuple[str, str | None] | None  # (job number, task); None: no id in the name
    seq: int  # no id in the name: 1 for the run's first log, N for its Nth


def _schedulers() -> list[Scheduler]:
    from hpc import schedulers

    return [schedulers.get(name) for name in schedulers.names()]


def job_key(job: str, known: list[Scheduler] | None = None) -> tuple[str, str | None] | None:
    """``(number, task)`` of a job id of any scheduler (SLURM ``12345_3``, PBS
    ``123[3].server``); None for anything else. ``known``: the schedulers, when the
    caller has listed them already (listing reads the package folder)."""
    for scheduler in _schedulers() if known is None else known:
        key = scheduler.split_id(job.strip())
        if key is not None:
            return key
    return None


def _scan(run_dir: Path, known: list[Scheduler]) -> list[_Log]:
    found = []
    try:
        entries = sorted(run_dir.iterdir())
    except OSError as exc:
        raise UserError(f"logs: cannot list {str(run_dir)!r}: {exc.strerror}") from None
    patterns = [(s, regex) for s in known for regex in s.log_patterns]
    for path in entries:
        for scheduler, regex in patterns:
            match = re.fullmatch(regex, path.name)
            if match is None or not path.is_file():
                continue
            job = match.groupdict().get("job")
            if job is None:
                found.append(_Log(path, scheduler.name, None, int(match.group("seq") or 1)))
            else:
                found.append(_Log(path, scheduler.name, scheduler.split_id(job), 0))
            break
    return found


def _submissions(run_dir: Path) -> list[dict[str, Any]]:
    """The run's submissions, oldest first ([] when there is no record)."""
    from hpc import runs

    if not (run_dir / runs.RECORD).is_file():
        return []
    record = runs.read_record(run_dir)
    earlier = record.get("submissions", [])
    subs = [s for s in earlier if isinstance(s, dict)] if isinstance(earlier, list) else []
    return [*subs, record]


def _latest(logs: list[_Log]) -> Path:
    """The most recently written; ties (same mtime) go to the higher array task."""

    def order(log: _Log) -> tuple[float, int]:
        try:
            mtime = log.path.stat().st_mtime
        except OSError:
            mtime = 0.0
        task = log.key[1] if log.key else None
        return mtime, int(task) if task else log.seq

    return max(logs, key=order).path


def find_log(run_dir: Path, job: str | None = None) -> Path:
    """The log of ``job`` (a job id of this run, an array task's ``12345_3`` or
    ``123[3].server``, or a local ``local-PID-START``), else of the run's latest job.

    For an array without a task the most recently written task log is returned. A
    job that has not started yet has no log: the path its scheduler will write is
    returned (``Scheduler.log_name`` and the run record) so that :func:`follow` can
    wait for it. Anything not found is one line naming what the run has.
    """
    if not run_dir.is_dir():
        raise UserError(f"logs: {str(run_dir)!r} is not a directory; allowed: a run directory")
    known = _schedulers()
    logs = _scan(run_dir, known)
    subs = _submissions(run_dir)
    if job is not None and not job.strip():
        raise UserError("logs: empty job id; allowed: a job id of this run, or none for the latest")
    wanted = job.strip() if job else None
    if wanted is None and subs and subs[-1].get("job_id"):
        wanted = str(subs[-1]["job_id"])
    if wanted is None:  # no record (a folder of logs): the newest log there
        if not logs:
            raise UserError(f"logs: no log file in {str(run_dir)!r} and no run record naming a job")
        return _latest(logs)

    key = job_key(wanted, known)
    if key is not None:
        matches = [g for g in logs if g.key and g.key[0] == key[0] and key[1] in (None, g.key[1])]
        if matches:
            return _latest(matches)

    def same(sub: dict[str, Any]) -> bool:
        recorded = str(sub.get("job_id") or "")
        return recorded == wanted or (key is not None and (job_key(recorded, known) or ("",))[0] == key[0])

    sub = next((s for s in reversed(subs) if same(s)), None)
    if sub is None:
        if not any(s.owns_id(wanted) for s in known):
            examples = ", ".join(s.id_examples for s in known if s.id_examples)
            raise UserError(f"logs: {wanted!r} is not a job id; allowed: e.g. {examples}")
        if subs:
            raise UserError(f"logs: job {wanted!r} is not a job of {str(run_dir)!r}; "
                            f"its jobs: {_ids(subs)}")  # fmt: skip
        raise UserError(f"logs: no log of job {wanted!r} in {str(run_dir)!r}")
    return run_dir / _expected_name(sub, subs, key, is_array=(run_dir / "sweep.json").is_file())


def err_log(run_dir: Path, out: Path) -> Path:
    """The stderr log beside the job log ``out`` (found by :func:`find_log`), for a job
    submitted with ``split_logs: true`` (its run record says so) or whose stderr file is
    there already; any other job's stderr is inside ``out``: one line saying so."""
    subs = _submissions(run_dir)
    split = bool(subs and subs[-1].get("split_logs"))
    for scheduler in _schedulers():
        if not any(re.fullmatch(regex, out.name) for regex in scheduler.log_patterns):
            continue
        name = scheduler.err_log_name(out.name)
        if name is not None and (split or (out.parent / name).is_file()):
            return out.parent / name
        break
    raise UserError(f"logs: {out.name!r} holds the job's stdout and stderr together; allowed: "
                    "--err for a job submitted with split_logs: true (SLURM or PBS)")


RANKS_DIR = "ranks"  # per_rank_logs: ddp.rank_logs writes RUN/ranks/rank-NNNNN.log
_RANK_FILE = re.compile(r"rank-([0-9]{5,9})\.log")
_HEADER = re.compile(r"# rank [0-9]+ of [0-9]+ on (\S+)")


def rank_logs(run_dir: Path) -> dict[int, Path]:
    """``{rank: file}`` of a run with ``per_rank_logs`` (empty without them)."""
    folder = run_dir / RANKS_DIR
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _RANK_FILE.fullmatch(path.name)
        if match and path.is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def rank_log(run_dir: Path, rank: int) -> Path:
    """The log of ``rank``; one line naming what the run has otherwise."""
    logs = rank_logs(run_dir)
    if rank in logs:
        return logs[rank]
    if not logs:
        raise UserError(f"logs: {str(run_dir)!r} has no per-rank logs; allowed: --rank for a "
                        "job submitted with per_rank_logs: true (or --per-rank-logs)")  # fmt: skip
    span = f"{min(logs)}-{max(logs)}" if len(logs) > 1 else str(min(logs))
    raise UserError(f"logs: no log of rank {rank} in {str(run_dir / RANKS_DIR)!r}; allowed: "
                    f"ranks {span}")  # fmt: skip


#: A launcher's rank label at a line's start, where per-rank files are off
#: (hpc.launchers.labelled): ``N: `` from ``srun --label`` (N right-aligned with spaces
#: to the widest rank) and PALS ``--label``; ``[N] `` from MPICH hydra's ``-prepend-rank``.
_LABEL = re.compile(rb" *([0-9]{1,9}): |\[([0-9]{1,9})\] ")
#: The longest line read whole from a merged log (a longer one is read in pieces).
_MAX_LINE = 1 << 20


def labelled_lines(path: Path) -> Any:
    """``(rank, line without its label)`` for each rank-labelled line of a merged job
    log (bytes, newline kept); the batch script's own lines (no label) are skipped.
    The log is untrusted: a regular file only, read a bounded line at a time."""
    from hpc._util import open_regular

    fh = open_regular(path, "logs", missing_ok=True)
    if fh is None:
        return
    with fh:
        for raw in iter(lambda: fh.readline(_MAX_LINE), b""):
            match = _LABEL.match(raw)
            if match:
                yield int(match.group(1) or match.group(2)), raw[match.end():]


def _merged(run_dir: Path, job: str | None) -> list[Path]:
    """The job log (and its ``--err`` file with ``split_logs``) whose lines carry labels."""
    out = find_log(run_dir, job)
    with contextlib.suppress(UserError):  # no split_logs: the one file holds both
        return [out, err_log(run_dir, out)]
    return [out]


def print_rank(run_dir: Path, rank: int, out: TextIO, job: str | None = None) -> None:
    """Print rank ``rank``'s lines of the merged job log, labels removed (as its own
    file would hold them); one line naming what the log has otherwise."""
    seen: set[int] = set()
    try:
        merged = _merged(run_dir, job)
    except UserError:  # neither per-rank files nor a job log: say the first
        raise UserError(f"logs: {str(run_dir)!r} has no per-rank logs and no job log; "
                        "allowed: --rank for a job submitted with per_rank_logs: true, or "
                        "one whose log has rank labels") from None
    for path in merged:
        for r, line in labelled_lines(path):
            seen.add(r)
            if r == rank:
                out.write(line.decode("utf-8", "replace"))
    out.flush()
    if rank in seen:
        return
    if not seen:
        raise UserError(f"logs: {str(run_dir)!r} has no per-rank logs and its job log has no "
                        "rank labels; allowed: --rank for a job submitted with per_rank_logs: "
                        "true, or one launched with rank labels (srun --label, mpiexec --label "
                        "or -prepend-rank)")  # fmt: skip
    span = f"{min(seen)}-{max(seen)}" if len(seen) > 1 else str(min(seen))
    raise UserError(f"logs: no line of rank {rank} in the job log of {str(run_dir)!r}; "
                    f"allowed: ranks {span}")  # fmt: skip


def _hosts(run_dir: Path) -> list[str]:
    """Each rank's host, from the trainer's ``ranks.jsonl`` (its first line); empty
    when the run has none (not a Trainer run, or not started)."""
    from hpc import ranks

    for path in (run_dir / "ranks.jsonl", *sorted(run_dir.glob("*/ranks.jsonl"))):
        if path.is_file():
            try:
                return ranks.read(path).hosts
            except UserError:
                return []
    return []


def grep(run_dir: Path, text: str, out: TextIO, job: str | None = None) -> list[tuple[int, str]]:
    """Print every line of the per-rank logs that holds ``text`` (plain text, not a
    pattern), as ``rank N (HOST): line``; returns the (rank, host) pairs it was found in.
    Without per-rank files, the rank-labelled lines of the merged job log are searched
    (hosts from the trainer's ``ranks.jsonl`` where it wrote one, else ``?``)."""
    from hpc._util import open_regular

    if not text:
        raise UserError("logs: empty --grep text; allowed: the text to find")
    logs = rank_logs(run_dir)
    if not logs:
        return _grep_merged(run_dir, text, out, job)
    needle = text.encode("utf-8", "surrogateescape")
    found: list[tuple[int, str]] = []
    for rank, path in logs.items():
        host = "?"
        fh = open_regular(path, "logs", missing_ok=True)
        if fh is None:
            continue
        with fh:
            for number, raw in enumerate(iter(lambda fh=fh: fh.readline(1 << 20), b""), 1):
                if number == 1 and (m := _HEADER.match(raw.decode("utf-8", "replace"))):
                    host = m.group(1)
                    continue
                if needle in raw:
                    line = raw.decode("utf-8", "replace").rstrip("\n")
                    out.write(f"rank {rank} ({host}): {line}\n")
                    if not found or found[-1][0] != rank:
                        found.append((rank, host))
    return found


def _grep_merged(run_dir: Path, text: str, out: TextIO, job: str | None) -> list[tuple[int, str]]:
    """:func:`grep` over a rank-labelled merged job log."""
    needle = text.encode("utf-8", "surrogateescape")
    hosts = _hosts(run_dir)
    found: dict[int, str] = {}
    labelled = False
    for path in _merged(run_dir, job):
        for rank, raw in labelled_lines(path):
            labelled = True
            if needle in raw:
                host = hosts[rank] if rank < len(hosts) else "?"
                line = raw.decode("utf-8", "replace").rstrip("\n")
                out.write(f"rank {rank} ({host}): {line}\n")
                found.setdefault(rank, host)
    if not labelled:
        print_rank(run_dir, 0, out, job)  # the one-line error: no per-rank logs, no labels
    return sorted(found.items())


def _expected_name(sub: dict[str, Any], subs: list[dict[str, Any]],
                   key: tuple[str, str | None] | None, is_array: bool) -> str:
    """The log name a submitted job's scheduler will write (it has not started yet)."""
    from hpc import schedulers

    name = str(sub.get("scheduler"))
    job_id = str(sub.get("job_id"))
    try:
        scheduler = schedulers.get(name)
    except UserError:
        scheduler = None
    task = key[1] if key is not None and key[1] is not None else ("0" if is_array else None)
    seq = 1 + [s for s in subs if s.get("scheduler") == name].index(sub)
    log = scheduler.log_name(str(sub.get("name") or "job"), job_id, task, seq) if scheduler else None
    if log is None:
        raise UserError(f"logs: job {job_id!r} ran on {name!r}, whose logs hpc cannot name; "
                        f"allowed: runs of {', '.join(schedulers.names())}")  # fmt: skip
    if os.path.basename(log) != log or log in (".", ".."):  # the name came from run.json
        raise UserError(f"logs: the record's job name makes the log name {log!r}, which is not "
                        "a file in the run directory; allowed: a name without '/'")  # fmt: skip
    return log


def _ids(subs: list[dict[str, Any]]) -> str:
    return ", ".join(str(s.get("job_id")) for s in subs if s.get("job_id")) or "none"


class Backoff:
    """When ``hpc logs -f`` asks the scheduler again: now, then after ``first_s``, and
    twice as long each time up to ``most_s`` (the profile's ``poll_s``).

    A shared scheduler answers every user's queries; a follow that asked every half
    second for a day-long job made 170,000 of them. The log itself is a local file
    and is still read every poll: only the scheduler is asked less often, so the end
    of a job shows at most ``most_s`` late. ``clock``: for tests.
    """

    def __init__(self, first_s: float = 1.0, most_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.most_s = most_s
        self.interval = min(first_s, most_s)
        self.clock = clock
        self.next: float | None = None

    def due(self) -> bool:
        """True when it is time to ask (and then the next time is set)."""
        now = self.clock()
        if self.next is not None and now < self.next:
            return False
        self.next = now + self.interval
        self.interval = min(self.interval * 2, self.most_s)
        return True


def follow(
    path: Path,
    is_running: Callable[[], bool],
    out: TextIO,
    poll_s: float = 0.5,
    settle_s: float = 0.0,
    ask: Backoff | None = None,
) -> None:
    """Print ``path`` and then what is appended to it until the job ends.

    ``is_running`` is asked before a read (every read, or when ``ask`` says it is
    time: a scheduler query backs off, the file read does not), so once it says False
    one more read prints everything the job wrote before it ended. A file that does not exist yet is
    waited for; one truncated in place is read again from the start; one replaced
    (rotation: a new inode at the path) is read to its end, then the new one from the
    start. Bytes are decoded incrementally, so a UTF-8 character split across two
    reads prints whole, and undecodable bytes print as U+FFFD instead of failing.

    ``settle_s``: after the job ends, keep reading until the file has not grown for this
    long. A scheduler may append its own last lines (SLURM's ``CANCELLED`` notice) after
    the job's state changed, and a login node on NFS may see the last writes late.

    A reader of ``out`` that left (``| grep -m1 started``) ends the follow at the next
    poll with ``BrokenPipeError``, as ``tail -f`` does, although the job may write
    nothing for hours (a write would be the first to notice).
    """
    fh = None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        running = True
        while True:
            if ask is None or ask.due():
                running = is_running()
            fh = _reopen_if_replaced(path, fh, decoder, out)
            if fh is not None:
                _drain(fh, decoder, out)
            if not running:
                fh = _settle(path, fh, decoder, out, poll_s, settle_s)
                out.write(decoder.decode(b"", final=True))
                out.flush()
                return
            if reader_gone(out):
                raise BrokenPipeError(errno.EPIPE, "the reader of the output left")
            time.sleep(poll_s)
    finally:
        if fh is not None:
            fh.close()


def _settle(path: Path, fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO,
            poll_s: float, settle_s: float) -> Any:  # fmt: skip
    """Read on until ``path`` has not grown for ``settle_s`` seconds; the handle read last."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle_s:
        time.sleep(min(poll_s, settle_s) or 0.01)
        before = fh.tell() if fh is not None else -1
        fh = _reopen_if_replaced(path, fh, decoder, out)
        if fh is not None:
            _drain(fh, decoder, out)
            if fh.tell() != before:
                quiet_since = time.monotonic()
    return fh


def _reopen_if_replaced(
    path: Path, fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO
) -> Any:
    """The handle to read next: opened once the file exists, reopened after rotation."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return fh  # not there yet, or moved away mid-rotation: keep what we have
    except OSError as exc:
        raise UserError(f"logs: cannot read {str(path)!r}: {exc.strerror}") from None
    if fh is not None:
        cur = os.fstat(fh.fileno())
        if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
            if cur.st_size < fh.tell():  # truncated in place (copytruncate): start over
                fh.seek(0)
            return fh
        _drain(fh, decoder, out)  # the rest of the rotated file first
        fh.close()
    return _open_log(path)


def _open_log(path: Path) -> Any:
    """The log opened for reading, None while it does not exist; a named pipe (whose
    ``open`` would wait for a writer forever) or a device is refused (``open_regular``)."""
    from hpc._util import open_regular

    return open_regular(path, "logs", missing_ok=True)  # closed by the caller


def _drain(fh: Any, decoder: codecs.IncrementalDecoder, out: TextIO) -> None:
    wrote = False
    while chunk := fh.read(65536):
        out.write(decoder.decode(chunk))
        wrote = True
    if wrote:
        out.flush()


def print_log(path: Path, out: TextIO) -> None:
    """Print a job's log as it is now (``hpc logs`` without ``-f``).

    Bounded by the size the log has when opened: a job that writes faster than the
    terminal reads would otherwise keep this going for as long as it runs (``-f`` is
    for that)."""
    fh = _open_log(path)
    if fh is None:
        raise UserError(f"logs: {str(path)!r} does not exist yet (the job has not started?); "
                        "allowed: hpc logs -f to wait for it")  # fmt: skip
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with fh:
        left = os.fstat(fh.fileno()).st_size
        while left > 0 and (chunk := fh.read(min(65536, left))):
            left -= len(chunk)
            out.write(decoder.decode(chunk))
    out.write(decoder.decode(b"", final=True))
    out.flush()


def locate(ident: str, runs_dir: Path) -> tuple[Path, str | None]:
    """``(run directory, job)`` for ``hpc logs IDENT``: a run directory or its name (job
    None: the latest), or a job id, an array task's included (``12345_3``, ``123[3].server``)."""
    from hpc import runs

    found = runs.find(ident, runs_dir, history=True)  # a resumed run's earlier jobs too
    if found is not None:
        run_dir, record = found
        is_job = ident.strip() not in (str(run_dir), run_dir.name) and not Path(ident).is_dir()
        return run_dir, (ident.strip() if is_job and record.get("job_id") else None)
    known = _schedulers()
    key = job_key(ident, known)
    if key is not None and key[1] is not None:  # a task: find the array's run by its number
        with contextlib.suppress(UserError):
            for candidate in (key[0], *(s.array_of(ident.strip()) for s in known)):
                found = runs.find(candidate, runs_dir, history=True) if candidate else None
                if found is not None:
                    return found[0], ident.strip()
    raise UserError(f"logs: {ident!r} is neither a run directory nor a job id of a run under "
                    f"{str(runs_dir)!r}")  # fmt: skip
